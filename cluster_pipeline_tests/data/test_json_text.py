"""Strict JSON reading through every reader path (.json, .jsonl, concatenated values,
fields.json, eval.json): what json.loads rejects is refused at file:line:column, and so are
NaN/Infinity, unpaired surrogate escapes and repeated keys. Expected positions and messages
come from json.loads itself or from str.index on the text written."""

import json
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.data.formats import (
    DatasetFormatError,
    iter_file_records,
    read_dataset_folder,
    read_fields,
)
from cluster_pipeline.evaluation.suites import dataset_benchmarks

JSON_HINT = (
    "A .json file holds one JSON value (an array of records or one record) or several in a row "
    "separated by whitespace; fix or split the file."
)
JSONL_HINT = (
    "Each line of a .jsonl file must be one JSON object (a pretty-printed JSON array belongs in "
    "a .json file)."
)
A = '{"problem": "a", "solution": "b"}'
B = '{"problem": "c", "solution": "d"}'


def _stdlib_error(path: Path, text: str, hint: str, line_offset: int = 0) -> str:
    """The message the reader must give: json.loads's own problem and position."""
    with pytest.raises(json.JSONDecodeError) as e:
        json.loads(text)
    err = e.value
    return f"{path}:{err.lineno + line_offset}:{err.colno}: invalid JSON ({err.msg}). {hint}"


def _refused(path: Path) -> str:
    with pytest.raises(DatasetFormatError) as e:
        list(iter_file_records(path))
    return str(e.value)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(f"[{A} {B}]", id="missing_comma_between_objects"),
        pytest.param(f"[\n  {A}\n  {B}\n]\n", id="missing_comma_pretty_printed"),
        pytest.param(f"[{A}, {B},]", id="trailing_comma_before_bracket"),
        pytest.param(f"[\n  {A},\n  {B},\n]\n", id="trailing_comma_pretty_printed"),
        pytest.param(f"[{A},, {B}]", id="two_commas"),
        pytest.param(f"[, {A}]", id="leading_comma"),
        pytest.param('{"problem": "a", "solution": "b",}', id="trailing_comma_in_object"),
        pytest.param(
            '[{"problem": "a", "solution": "b", "meta": {"x": 1 "y": 2}}]',
            id="missing_comma_in_nested_object",
        ),
        pytest.param(
            '[{"problem": "a", "solution": "b", "tags": ["x", "y",]}]',
            id="trailing_comma_in_nested_array",
        ),
        pytest.param(f"[{A}, {B}", id="array_not_closed"),
        pytest.param(f"[{A},", id="array_ends_after_comma"),
    ],
)
def test_a_json_file_json_loads_rejects_is_refused_at_line_and_column(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert _refused(path) == _stdlib_error(path, text, JSON_HINT)


def test_the_issue_file_with_four_records_and_two_faults_is_refused(tmp_path):
    # The issue: an array of 4 records with a missing comma and a trailing comma was read whole.
    records = [json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) for i in range(4)]
    text = "[\n" + f"  {records[0]},\n  {records[1]}\n  {records[2]},\n  {records[3]},\n" + "]\n"
    path = tmp_path / "four.json"
    path.write_text(text)
    # Line 3 holds records[1] without its comma; records[2] opens line 4 at column 3.
    assert _refused(path) == f"{path}:4:3: invalid JSON (Expecting ',' delimiter). {JSON_HINT}"
    assert _refused(path) == _stdlib_error(path, text, JSON_HINT)
    with pytest.raises(DatasetFormatError):
        list(read_dataset_folder(tmp_path))


def test_concatenated_arrays_are_read_but_a_comma_between_top_level_values_is_not(tmp_path):
    # `cat a.json b.json` (two whole arrays, whitespace between) is read; a comma between two
    # top-level values is not JSON, nor a value glued to garbage.
    path = tmp_path / "cat.json"
    path.write_text(f"[{A}]\n[{B}]\n")
    assert [(line, r["problem"]) for line, r in iter_file_records(path)] == [(1, "a"), (2, "c")]
    path.write_text(f"[{A}],\n[{B}]\n")
    assert _refused(path) == f"{path}:1:{len(A) + 3}: invalid JSON (Expecting value). {JSON_HINT}"


def test_a_json_file_holding_json_lines_is_read_line_by_line(tmp_path):
    # Decision: JSON Lines in a .json file are several top-level values in a row, each a record.
    path = tmp_path / "lines.json"
    path.write_text(f"{A}\n\n{B}\n")
    assert list(iter_file_records(path)) == [(1, json.loads(A)), (3, json.loads(B))]
    path.write_text(f'{A}\n{{"problem": "c" "solution": "d"}}\n')
    # '{"problem": "c"' is 15 characters and a space: the next key starts at column 17.
    assert _refused(path) == f"{path}:2:17: invalid JSON (Expecting ',' delimiter). {JSON_HINT}"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"problem": "a" "solution": "b"}', "missing_comma"),
        ('{"problem": "a", "solution": "b",}', "trailing_comma"),
        ('{"problem": "a", "solution": "b"} {"x": 1}', "two_values"),
        ("[", "pretty_printed_array"),
    ],
)
def test_a_jsonl_line_json_loads_rejects_is_refused_at_line_and_column(tmp_path, line, problem):
    path = tmp_path / f"{problem}.jsonl"
    path.write_text(f"{A}\n\n{line}\n")
    assert _refused(path) == _stdlib_error(path, line, JSONL_HINT, line_offset=2)


@pytest.mark.parametrize(
    ("constant", "suffix"),
    [("NaN", ".json"), ("Infinity", ".json"), ("-Infinity", ".jsonl"), ("NaN", ".jsonl")],
)
def test_nan_and_infinity_are_refused_though_json_loads_accepts_them(tmp_path, constant, suffix):
    # Decision: not JSON (RFC 8259), and read as text they would become the words nan/inf.
    text = f'{A}\n{{"problem": "p", "solution": "s", "score": {constant}}}\n'
    assert json.loads(text.splitlines()[1])["score"] != 0  # json.loads does accept it
    path = tmp_path / f"nan{suffix}"
    path.write_text(text)
    column = text.splitlines()[1].index(constant) + 1
    assert _refused(path) == (
        f"{path}:2:{column}: invalid JSON ({constant} is not a JSON value; Python's json writes "
        "it for a float NaN or infinity). Write null for a missing value, or quote it as a "
        "string."
    )


def test_nan_inside_a_string_is_text(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text('[{"problem": "NaN Infinity", "solution": "-Infinity"}]')
    assert list(iter_file_records(path)) == [
        (1, {"problem": "NaN Infinity", "solution": "-Infinity"})
    ]


def _surrogate_message(path: Path, line: int, column: int, escape: str) -> str:
    return (
        f"{path}:{line}:{column}: the string holds {escape}, an unpaired UTF-16 surrogate that "
        "UTF-8 cannot store (half of a character outside the Basic Multilingual Plane, such as "
        "an emoji cut in two). Re-encode the file from its source, or replace the escape with "
        "the whole character (a high surrogate \\ud800-\\udbff followed by a low one "
        "\\udc00-\\udfff) or delete it."
    )


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
@pytest.mark.parametrize(
    ("record", "escape"),
    [
        pytest.param('{"problem": "x\\ud800", "solution": "s"}', "\\ud800", id="lone_high"),
        pytest.param('{"problem": "x", "solution": "\\udfff y"}', "\\udfff", id="lone_low"),
        pytest.param('{"problem": "\\ud800\\u0041", "solution": "s"}', "\\ud800", id="high_then_A"),
        pytest.param('{"problem": "\\uD800\\uD800", "solution": "s"}', "\\uD800", id="high_high"),
        pytest.param('{"problem": "\\ud800 \\udc00", "solution": "s"}', "\\ud800", id="apart"),
        pytest.param('{"pro\\udbffblem": "p", "solution": "s"}', "\\udbff", id="in_a_key"),
        pytest.param(
            '{"problem": "p", "solution": "s", "meta": {"k": ["\\udc00"]}}',
            "\\udc00",
            id="nested_value",
        ),
    ],
)
def test_an_unpaired_surrogate_escape_is_refused_with_its_place(tmp_path, suffix, record, escape):
    # json.loads accepts these; UTF-8 cannot encode the result (the issue's bare codec error).
    with pytest.raises(UnicodeEncodeError):
        json.dumps(json.loads(record), ensure_ascii=False).encode("utf-8")
    path = tmp_path / f"s{suffix}"
    body = f"[\n{A},\n{record}\n]\n" if suffix == ".json" else f"{A}\n{record}\n"
    path.write_text(body)
    line = 3 if suffix == ".json" else 2
    assert _refused(path) == _surrogate_message(path, line, record.index(escape) + 1, escape)
    with pytest.raises(DatasetFormatError, match="unpaired UTF-16 surrogate"):
        list(read_dataset_folder(tmp_path))


def test_surrogate_pairs_and_escaped_backslashes_are_fine(tmp_path):
    path = tmp_path / "ok.jsonl"
    # A real pair is one character; "\\ud800" is a backslash followed by the text ud800.
    path.write_text('{"problem": "\\ud83d\\ude00", "solution": "\\\\ud800 \\\\\\ud83d\\ude00"}\n')
    assert list(iter_file_records(path)) == [
        (1, {"problem": "\U0001f600", "solution": "\\ud800 \\\U0001f600"})
    ]


def test_a_surrogate_in_parquet_bytes_is_refused_with_row_and_column(tmp_path):
    # Parquet strings are UTF-8: a surrogate can only arrive as its 3 WTF-8 bytes, which
    # pyarrow writes without checking when told the bytes are a string.
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = pa.array([b"ok", b"fine"], type=pa.binary()).view(pa.string())
    bad = pa.array([b"a", b"x\xed\xa0\x80"], type=pa.binary()).view(pa.string())
    path = tmp_path / "s.parquet"
    pq.write_table(pa.table({"instruction": good, "output": bad}), path)
    with pytest.raises(Exception, match="invalid UTF-8"):
        pl.read_parquet(path)
    assert _refused(path) == (
        f"{path}:2: column 'output' holds a string that is not UTF-8 (bytes ed a0 80 at byte 2 "
        "(the UTF-8 form of an unpaired UTF-16 surrogate, which UTF-8 cannot store)). Write the "
        "column as UTF-8 text (re-encode it from its source) or remove the character."
    )


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_a_key_twice_in_one_object_is_refused(tmp_path, suffix):
    # Decision: json.loads keeps the last value; the first would vanish without a count.
    record = '{"problem": "a", "solution": "first", "solution": "second"}'
    path = tmp_path / f"dup{suffix}"
    path.write_text(f"{A}\n{record}\n" if suffix == ".jsonl" else f"[{A},\n {record}]\n")
    assert json.loads(record)["solution"] == "second"
    column = 1 if suffix == ".jsonl" else 2
    assert _refused(path) == (
        f"{path}:2:{column}: the value starting here has the key 'solution' twice in one "
        "object; JSON readers keep only the last, so the first would vanish. Remove or rename "
        "one of them."
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '{"question": "instruction" "answer": "output"}',
            "{path}:1:28: invalid JSON (Expecting ',' delimiter). {hint}",
            id="missing_comma",
        ),
        pytest.param(
            '{"question": "instruction",}',
            "{path}:1:28: invalid JSON (Expecting property name enclosed in double quotes). {hint}",
            id="trailing_comma",
        ),
        pytest.param(
            '{"question": "instruction"}\n{"answer": "output"}',
            "{path}:2:1: invalid JSON (Extra data). {hint}",
            id="two_values",
        ),
        pytest.param("", "{path}:1:1: invalid JSON (no value). {hint}", id="empty"),
    ],
)
def test_fields_json_is_read_strictly(tmp_path, text, expected):
    path = tmp_path / "fields.json"
    path.write_text(text)
    (tmp_path / "d.jsonl").write_text(A + "\n")
    hint = 'It must be one object, e.g. {"question": "instruction"}.'
    with pytest.raises(DatasetFormatError) as e:
        read_fields(tmp_path)
    assert str(e.value) == expected.format(path=path, hint=hint)
    if text:
        assert expected.format(path=path, hint=hint) == _stdlib_error(path, text, hint)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            '{"benchmarks": ["mmlu_medical"] "x": 1}',
            "{path}:1:33: invalid JSON (Expecting ',' delimiter). {hint}",
            id="missing_comma",
        ),
        pytest.param(
            '{"benchmarks": ["mmlu_medical",]}',
            "{path}:1:32: invalid JSON (Expecting value). {hint}",
            id="trailing_comma",
        ),
        pytest.param(
            '{"benchmarks": ["mmlu_medical\\ud800"]}',
            "{path}:1:30: the string holds \\ud800, an unpaired UTF-16 surrogate",
            id="surrogate",
        ),
    ],
)
def test_eval_json_is_read_strictly(tmp_path, text, expected):
    (tmp_path / "med").mkdir()
    path = tmp_path / "med" / "eval.json"
    path.write_text(text)
    hint = 'Write one JSON object like {"benchmarks": ["mmlu_medical"]}.'
    with pytest.raises(ValueError) as e:
        dataset_benchmarks("med", tmp_path)
    assert str(e.value).startswith(expected.format(path=path, hint=hint))
    if "surrogate" not in expected:
        assert str(e.value) == _stdlib_error(path, text, hint)
