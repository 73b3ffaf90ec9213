"""Reading every accepted form, with source lines, and clear errors for bad input."""

import json
from collections import Counter

import polars as pl
import pytest

from cluster_pipeline.core.formats import (
    DatasetFormatError,
    empty_file_reason,
    iter_file_records,
    normalise_record,
    read_dataset_folder,
    sample_id,
)
from cluster_pipeline_tests.helpers import SHARED_DATASETS

# Assistant turns per dialogue, counted from the raw file with json and collections.Counter.
EXPECTED_SHAREGPT_TURNS = {1: 167, 2: 166, 3: 167}


@pytest.mark.parametrize(
    ("record", "form", "prompt", "response", "system"),
    [
        ({"instruction": "Add.", "input": "1 2", "output": "3"}, "alpaca", "Add.\n\n1 2", "3", ""),
        ({"instruction": "Add.", "input": "", "output": "3"}, "alpaca", "Add.", "3", ""),
        ({"instruction": "Say hi", "response": "hi"}, "instruction_response", "Say hi", "hi", ""),
        ({"problem": "P", "solution": "S"}, "magicoder", "P", "S", ""),
        (
            {
                "conversations": [
                    {"from": "system", "value": "sys"},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ]
            },
            "sharegpt",
            "Q",
            "A",
            "sys",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Q1"},
                    {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": "Q2"},
                    {"role": "assistant", "content": "A2"},
                ]
            },
            "openai",
            "User: Q1\n\nAssistant: A1\n\nUser: Q2",
            "A2",
            "",
        ),
    ],
)
def test_every_form_normalises(record, form, prompt, response, system):
    s = normalise_record(record, "f.jsonl", 7)
    assert (s.form, s.prompt, s.response, s.system) == (form, prompt, response, system)
    assert (s.source_file, s.source_line) == ("f.jsonl", 7)


def test_multi_turn_records_keep_every_turn_and_their_old_sample_id():
    record = {
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "Q1"},
            {"from": "gpt", "value": "A1"},
            {"from": "human", "value": "Q2"},
            {"from": "function_call", "value": "f(x)"},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "A2"},
            {"from": "human", "value": "unanswered"},
        ]
    }
    s = normalise_record(record, "f.json", 1)
    assert json.loads(s.messages or "null") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "f(x)"},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "A2"},
    ]
    assert s.prompt == ("User: Q1\n\nAssistant: A1\n\nUser: Q2\n\nAssistant: f(x)\n\nTool: 42")
    # The id hashes (system, flattened prompt, last answer) as before turns were kept.
    assert s.sample_id == sample_id("sys", s.prompt, "A2")
    single = normalise_record(
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        "f",
        1,
    )
    assert single.messages is None and single.sample_id == sample_id("", "Q", "A")


@pytest.mark.parametrize(
    ("record", "form", "system", "prompt", "response"),
    [
        ({"prompt": "Q", "completion": "A"}, "prompt_completion", "", "Q", "A"),
        (
            {
                "prompt": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "Q"},
                ],
                "completion": [{"role": "assistant", "content": "A"}],
            },
            "prompt_completion_chat",
            "S",
            "Q",
            "A",
        ),
        ({"text": "Once upon a time."}, "text", "", "", "Once upon a time."),
    ],
)
def test_trl_forms_and_text(record, form, system, prompt, response):
    s = normalise_record(record, "t.jsonl", 1)
    assert (s.form, s.system, s.prompt, s.response, s.messages) == (
        form,
        system,
        prompt,
        response,
        None,
    )


def test_sample_id_is_a_content_hash():
    assert sample_id("", "a", "b") == sample_id("", "a", "b")
    assert len({sample_id("", "a", "b"), sample_id("", "ab", ""), sample_id("a", "", "b")}) == 3


def test_json_array_records_keep_their_starting_line(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(
        '[\n  {"problem": "a",\n   "solution": "b"},\n\n  {"problem": "c", "solution": "d"}\n]\n'
    )
    assert [(line, r["problem"]) for line, r in iter_file_records(path)] == [(2, "a"), (5, "c")]


def test_jsonl_and_parquet_lines(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"problem": "a", "solution": "b"}\n\n{"problem": "c", "solution": "d"}\n')
    assert [line for line, _ in iter_file_records(jsonl)] == [1, 3]
    pq = tmp_path / "d.parquet"
    pl.DataFrame({"problem": ["a", "c"], "solution": ["b", "d"]}).write_parquet(pq)
    assert [(line, r["problem"]) for line, r in iter_file_records(pq)] == [(1, "a"), (2, "c")]


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"problem": "a", "solution": "b"}\n{"problem": oops}\n')
    with pytest.raises(DatasetFormatError) as e:
        list(iter_file_records(path))
    assert str(e.value) == (
        f"{path}:2:13: invalid JSON (Expecting value). Each line of a .jsonl file must be one "
        "JSON object (a pretty-printed JSON array belongs in a .json file)."
    )


def test_unknown_form_lists_keys_and_accepted_forms(tmp_path):
    with pytest.raises(
        DatasetFormatError,
        match=r"x\.json:3: record with keys \['question'\].*Alpaca.*fields\.json",
    ):
        normalise_record({"question": "?"}, "x.json", 3)


def test_chat_without_assistant_turn_is_refused():
    with pytest.raises(DatasetFormatError, match="no assistant turn"):
        normalise_record({"messages": [{"role": "user", "content": "hi"}]}, "m.jsonl", 1)


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(DatasetFormatError, match="no .json"):
        list(read_dataset_folder(tmp_path))


@pytest.mark.parametrize(
    ("name", "count", "form"),
    [
        ("gpteacher_codegen.json", 4535, "instruction_response"),
        ("alpaca_cherry_5pct.json", 3111, "alpaca"),
        ("icliniq_medical.jsonl", 6000, "alpaca"),
    ],
)
def test_shared_pools_read_completely(tmp_path, name, count, form):
    src = SHARED_DATASETS / "train" / name
    if not src.exists():
        pytest.skip(f"{src} absent (the shared datasets exist only on the project's machines)")
    folder = tmp_path / "pool"
    folder.mkdir()
    (folder / name).symlink_to(src)
    samples = list(read_dataset_folder(folder))
    assert len(samples) == count
    assert {s.form for s in samples} == {form}
    # Spot-check the source line of a record against the file itself.
    s = samples[10]
    text = src.read_text().splitlines()
    if name.endswith(".jsonl"):
        assert json.loads(text[s.source_line - 1])["output"] == s.response
    else:
        assert text[s.source_line - 1].strip() == "{"


def _three(first: str) -> str:
    """A pretty-printed JSON array of three records, four lines each plus brackets."""
    records = [{"problem": f"{first}{i}", "solution": "s"} for i in range(3)]
    return json.dumps(records, indent=1) + "\n"


def test_concatenated_json_arrays_are_all_read(tmp_path):
    # `cat a.json b.json > c.json`: two top-level arrays. Each record opens on line 2, 6, 10
    # of its array (json.dumps indent=1 puts each record over 4 lines); b starts on line 15.
    path = tmp_path / "c.json"
    path.write_text(_three("a") + _three("b"))
    got = [(line, r["problem"]) for line, r in iter_file_records(path)]
    assert got == [(2, "a0"), (6, "a1"), (10, "a2"), (16, "b0"), (20, "b1"), (24, "b2")]
    assert len(list(read_dataset_folder(tmp_path))) == 6


def test_concatenated_json_objects_are_all_read(tmp_path):
    path = tmp_path / "objs.json"
    path.write_text('{"problem": "a", "solution": "b"}\n{"problem": "c", "solution": "d"}\n')
    assert [(line, r["problem"]) for line, r in iter_file_records(path)] == [(1, "a"), (2, "c")]


def test_text_after_the_top_level_value_is_an_error_at_its_line(tmp_path):
    path = tmp_path / "tail.json"
    path.write_text('[{"problem": "a", "solution": "b"}]\nhello\n')
    with pytest.raises(DatasetFormatError, match=r"tail\.json:2:1: invalid JSON \(Expecting value"):
        list(iter_file_records(path))


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_utf8_byte_order_mark_is_accepted(tmp_path, suffix):
    path = tmp_path / f"bom{suffix}"
    body = '{"problem": "café", "solution": "b"}\n'
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [(line, r["problem"]) for line, r in iter_file_records(path)] == [(1, "café")]


def test_latin1_file_names_line_byte_and_remedy(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(
        b'{"problem": "a", "solution": "b"}\n{"problem": "caf\xe9", "solution": "b"}\n'
    )
    with pytest.raises(DatasetFormatError) as e:
        list(iter_file_records(path))
    assert str(e.value) == (
        f"{path}:2: not UTF-8 text (byte 0xe9 at column 17). Save the file as UTF-8, "
        "e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`."
    )


def test_jsonl_lines_split_on_newline_only(tmp_path):
    # U+2028 (LINE SEPARATOR) is legal inside a JSON string; str.splitlines() would cut there.
    path = tmp_path / "ls.jsonl"
    path.write_text('{"problem": "a\u2028b", "solution": "c"}\n{"problem": "d", "solution": "e"}\n')
    assert [(line, r["problem"]) for line, r in iter_file_records(path)] == [
        (1, "a\u2028b"),
        (2, "d"),
    ]


def test_fields_json_maps_a_users_own_fields(tmp_path):
    (tmp_path / "fields.json").write_text('{"question": "instruction", "answer": "output"}')
    (tmp_path / "qa.jsonl").write_text('{"question": "2+2?", "answer": "4", "id": 9}\n')
    [s] = list(read_dataset_folder(tmp_path))
    assert (s.form, s.prompt, s.response) == ("alpaca", "2+2?", "4")
    (tmp_path / "fields.json").write_text('["question"]')
    with pytest.raises(DatasetFormatError, match=r"fields\.json: must map each"):
        list(read_dataset_folder(tmp_path))
    (tmp_path / "fields.json").write_text('{"question": "instruction", "answer": "reply"}')
    with pytest.raises(DatasetFormatError) as e:
        list(read_dataset_folder(tmp_path))
    assert str(e.value) == (
        f"{tmp_path / 'fields.json'}: 'answer' -> 'reply': no accepted form has such a field; "
        "map onto one of instruction, input, output, response, problem, solution, prompt, "
        "completion, conversations, messages, text."
    )
    (tmp_path / "fields.json").write_text('{"question": "instruction"}')
    with pytest.raises(
        DatasetFormatError,
        match=r"qa\.jsonl:1: record with keys \['answer', "
        r"'id', 'instruction'\] \(after fields\.json renamed",
    ):
        list(read_dataset_folder(tmp_path))


def test_hugging_face_save_to_disk_folders_are_read(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the test extra installs `datasets`")
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:3]),
            "test": datasets.Dataset.from_list(
                [
                    {
                        "messages": [
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "hello"},
                        ]
                    }
                ]
            ),
        }
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    samples = list(read_dataset_folder(tmp_path))
    assert len(samples) == 5 + 3 + 1
    assert [(s.source_line, s.prompt) for s in samples if "/single/" in s.source_file] == [
        (i + 1, f"q{i}") for i in range(5)
    ]
    assert {s.form for s in samples} == {"alpaca", "openai"}
    assert all(s.source_file.endswith(".arrow") for s in samples)


def test_sharded_parquet_and_mixed_forms_in_one_dataset(tmp_path):
    shards = tmp_path / "data"
    shards.mkdir()
    for k in range(3):
        pl.DataFrame(
            {"prompt": [f"p{k}{i}" for i in range(4)], "completion": ["c"] * 4}
        ).write_parquet(shards / f"train-{k:05d}-of-00003.parquet")
    (tmp_path / "extra.jsonl").write_text(
        '{"text": "free text"}\n{"problem": "P", "solution": "S"}\n'
    )
    samples = list(read_dataset_folder(tmp_path))
    assert len(samples) == 14
    assert Counter(s.form for s in samples) == {"prompt_completion": 12, "text": 1, "magicoder": 1}


def test_shared_multi_turn_sharegpt_dialogues_keep_their_turns(tmp_path):
    src = SHARED_DATASETS / "train" / "fastchat_identity_sharegpt.json"
    if not src.exists():
        pytest.skip(f"{src} absent (the shared datasets exist only on the project's machines)")
    (tmp_path / src.name).symlink_to(src)
    samples = list(read_dataset_folder(tmp_path))
    assert len(samples) == 500
    turns = Counter(
        sum(m["role"] == "assistant" for m in json.loads(s.messages)) if s.messages else 1
        for s in samples
    )
    assert turns == EXPECTED_SHAREGPT_TURNS


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        pytest.param("a.jsonl", b"", "0 bytes", id="zero_bytes_jsonl"),
        pytest.param("a.json", b"", "0 bytes", id="zero_bytes_json"),
        pytest.param("a.parquet", b"", "0 bytes", id="zero_bytes_parquet"),
        pytest.param("a.jsonl", b"\n\n  \r\n\t\n", "only whitespace", id="whitespace_jsonl"),
        pytest.param("a.json", b"   \n", "only whitespace", id="whitespace_json"),
        pytest.param("a.jsonl", b"\xef\xbb\xbf", "only a byte-order mark", id="bom"),
        pytest.param(
            "a.json", b"\xef\xbb\xbf\n \n", "only a byte-order mark and whitespace", id="bom_ws"
        ),
        pytest.param("a.json", b"[]\n", "only an empty JSON array", id="empty_array"),
        pytest.param("a.json", b"[ ]\n[\n]\n", "only empty JSON arrays", id="empty_arrays"),
    ],
)
def test_a_file_without_records_is_refused_by_name(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    assert empty_file_reason(path) == reason
    (tmp_path / "good.jsonl").write_text('{"problem": "a", "solution": "b"}\n')
    with pytest.raises(DatasetFormatError) as e:
        list(read_dataset_folder(tmp_path))
    assert str(e.value) == (
        f"{path}: holds no records ({reason}); remove the file or put the dataset's records in it."
    )


def test_a_parquet_file_without_rows_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.parquet"
    pl.DataFrame(
        {"instruction": [], "output": []}, schema={"instruction": pl.String, "output": pl.String}
    ).write_parquet(path)
    assert empty_file_reason(path) == "no rows"
    with pytest.raises(DatasetFormatError) as e:
        list(read_dataset_folder(tmp_path))
    assert str(e.value) == (
        f"{path}: holds no records (no rows); remove the file or put the dataset's records in it."
    )


@pytest.mark.parametrize(
    "content", ['{"problem": "a", "solution": "b"}', "[{}]", "[\n {}", "x", "[ ]  {}"]
)
def test_a_file_that_may_hold_records_is_not_called_empty(tmp_path, content):
    path = tmp_path / "d.json"
    path.write_text(content)
    assert empty_file_reason(path) is None


def test_records_without_fields_name_their_place(tmp_path):
    # `{}` is a record (the file is not empty), one that matches no form.
    path = tmp_path / "e.jsonl"
    path.write_text('{"problem": "a", "solution": "b"}\n{}\n')
    with pytest.raises(DatasetFormatError) as e:
        list(read_dataset_folder(tmp_path))
    assert str(e.value) == f"{path}:2: record with keys [] matches no accepted form. " + (
        "Use instruction/input/output (Alpaca), instruction/response, problem/solution "
        "(Magicoder), prompt/completion (TRL), conversations (ShareGPT), messages (OpenAI) or "
        "text; or map your fields onto these in fields.json in the dataset folder."
    )
