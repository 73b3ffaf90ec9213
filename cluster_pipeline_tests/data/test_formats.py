"""Reading every accepted form, with source lines, and clear errors for bad input."""

import hashlib
import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.data.formats import (
    DatasetFormatError,
    empty_file_reason,
    iter_file_records,
    normalise_record,
    read_dataset_folder,
    sample_id,
)
from cluster_pipeline_tests.data.ids import structural_id
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


def test_multi_turn_records_keep_every_turn_and_hash_them():
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
    # The id hashes the kept turns as they stand (issue 43), not the flattened text, which an
    # earlier version hashed (system, flattened prompt, last answer).
    assert s.sample_id == structural_id(json.loads(s.messages or "null"))
    assert s.sample_id != sample_id("sys", s.prompt, "A2", None, None)
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
        "completion, conversations, messages, text, system, tools."
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


def _sharegpt(*turns: tuple[str, str]) -> dict:
    return {"conversations": [{"from": r, "value": v} for r, v in turns]}


def _openai(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": r, "content": v} for r, v in turns]}


def _trl(prompt: list[tuple[str, str]], completion: list[tuple[str, str]]) -> dict:
    return {
        "prompt": [{"role": r, "content": v} for r, v in prompt],
        "completion": [{"role": r, "content": v} for r, v in completion],
    }


ONE_EXCHANGE = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


@pytest.mark.parametrize(
    ("record", "dropped"),
    [
        pytest.param(_sharegpt(("human", "Q"), ("gpt", "A"), ("human", "more?")), 1, id="sg_user"),
        pytest.param(
            _openai(("user", "Q"), ("assistant", "A"), ("user", "more?")), 1, id="oa_user"
        ),
        pytest.param(_trl([("user", "Q")], [("assistant", "A"), ("user", "thanks")]), 1, id="trl"),
        pytest.param(
            _sharegpt(("human", "Q"), ("gpt", "A"), ("observation", "42")), 1, id="sg_observation"
        ),
        pytest.param(_openai(("user", "Q"), ("assistant", "A"), ("tool", "42")), 1, id="oa_tool"),
        pytest.param(_openai(("user", "Q"), ("assistant", "A"), ("system", "s")), 1, id="system"),
        pytest.param(
            _sharegpt(("human", "Q"), ("gpt", "A"), ("human", "x"), ("observation", "y")),
            2,
            id="two_turns",
        ),
        pytest.param(
            _openai(("user", "Q"), ("assistant", "A"), ("user", "x"), ("tool", "y"), ("user", "z")),
            3,
            id="three_turns",
        ),
    ],
)
def test_turns_after_the_last_answer_are_cut_and_counted(record, dropped):
    s = normalise_record(record, "c.json", 4)
    assert (s.system, s.prompt, s.response) == ("", "Q", "A")
    assert json.loads(s.messages or "null") == ONE_EXCHANGE  # not null: the record had more
    assert s.dropped_turns == {"after_last_assistant": dropped}
    # The id is the single exchange's, as before turns were counted.
    assert s.sample_id == sample_id("", "Q", "A")


def test_a_multi_turn_record_with_a_trailing_turn_keeps_every_answer():
    record = _sharegpt(
        ("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2"), ("human", "?")
    )
    s = normalise_record(record, "c.json", 1)
    assert [m["content"] for m in json.loads(s.messages or "null")] == ["Q1", "A1", "Q2", "A2"]
    assert (s.prompt, s.response) == ("User: Q1\n\nAssistant: A1\n\nUser: Q2", "A2")
    assert s.dropped_turns == {"after_last_assistant": 1}


def test_a_record_that_is_one_exchange_drops_nothing():
    s = normalise_record(_openai(("system", "S"), ("user", "Q"), ("assistant", "A")), "c", 1)
    assert (s.system, s.messages, s.dropped_turns, s.dropped_fields) == ("S", None, {}, {})


@pytest.mark.parametrize(
    ("record", "form", "turn"),
    [
        pytest.param(
            _sharegpt(("gpt", "Hello!"), ("human", "Q"), ("gpt", "A")), "sharegpt", 0, id="sg"
        ),
        pytest.param(
            _openai(("system", "S"), ("assistant", "Hi"), ("user", "Q"), ("assistant", "A")),
            "openai",
            1,
            id="oa_after_system",
        ),
        pytest.param(
            _trl([("assistant", "Hi"), ("user", "Q")], [("assistant", "A")]),
            "prompt_completion_chat",
            0,
            id="trl",
        ),
        pytest.param(
            {"system": "S", **_sharegpt(("gpt", "Hi"), ("human", "Q"), ("gpt", "A"))},
            "sharegpt",
            0,
            id="system_field",
        ),
    ],
)
def test_a_conversation_opening_with_an_answer_is_refused_with_its_place(record, form, turn):
    with pytest.raises(DatasetFormatError) as e:
        normalise_record(record, "chats.jsonl", 12)
    assert str(e.value) == (
        f"chats.jsonl:12: the {form} record opens with an assistant turn (turn {turn}), before "
        "any user turn: there is no question for it to answer, and chat templates render an "
        "answer only after one. Remove the leading assistant turn(s), or put the user turn "
        "first."
    )


def test_fields_no_form_reads_are_counted_by_name():
    record = {
        "id": "x1",
        "source": None,  # null: nothing lost, not counted
        "conversations": [
            {"from": "human", "value": "Q", "weight": 0},
            {"from": "gpt", "value": "A", "weight": 1, "extra": None},
        ],
    }
    s = normalise_record(record, "f.json", 1)
    assert s.dropped_fields == {"id": 1, "conversations[].weight": 2}
    alpaca = normalise_record(
        {"instruction": "I", "output": "O", "answer_model": "gpt-4", "question_id": 3}, "f", 1
    )
    assert alpaca.dropped_fields == {"answer_model": 1, "question_id": 1}
    text = normalise_record({"text": "T", "system": "S", "tools": "[]"}, "f", 1)
    assert text.dropped_fields == {"system": 1, "tools": 1}


def test_dropped_fields_keep_the_users_own_names_after_fields_json(tmp_path):
    (tmp_path / "fields.json").write_text('{"question": "instruction", "answer": "output"}')
    (tmp_path / "qa.jsonl").write_text('{"question": "2+2?", "answer": "4", "id": 9}\n')
    [s] = list(read_dataset_folder(tmp_path))
    assert s.dropped_fields == {"id": 1}
    renamed = normalise_record({"q": "x", "messages": ONE_EXCHANGE}, "f", 1, {"q": "instruction"})
    assert renamed.dropped_fields == {"q": 1}


def test_a_records_own_system_field_is_its_system_message():
    # LLaMA-Factory's ShareGPT and Alpaca files keep the system prompt in a `system` column.
    chat = normalise_record({"system": "S", **_sharegpt(("human", "Q"), ("gpt", "A"))}, "f", 1)
    assert (chat.system, chat.prompt, chat.response, chat.messages) == ("S", "Q", "A", None)
    both = normalise_record(
        {"system": "S1", **_openai(("system", "S2"), ("user", "Q"), ("assistant", "A"))}, "f", 1
    )
    assert both.system == "S1\n\nS2"
    alpaca = normalise_record({"system": "S", "instruction": "I", "output": "O"}, "f", 1)
    assert (alpaca.system, alpaca.sample_id) == ("S", sample_id("S", "I", "O"))


GLAIVE_TOOLS = [
    {
        "name": "calculate_area",
        "description": "Calculate the area of a given shape",
        "parameters": {
            "type": "object",
            "properties": {"shape": {"type": "string"}},
            "required": ["shape"],
        },
    }
]
CALL = '{"name": "calculate_area", "arguments": {"shape": "square"}}'


def _glaive(tools: object) -> dict:
    """A Glaive / LLaMA-Factory tool-calling record (data/glaive_toolcall_en_demo.json)."""
    return {
        "conversations": [
            {"from": "human", "value": "Area of a square of side 7?"},
            {"from": "function_call", "value": CALL},
            {"from": "observation", "value": '{"area": 49}'},
            {"from": "gpt", "value": "It is 49."},
        ],
        "tools": tools,
    }


def test_tool_calling_sharegpt_keeps_its_tools_and_turns():
    s = normalise_record(_glaive(json.dumps(GLAIVE_TOOLS)), "holdout.json", 2)
    wrapped = [{"type": "function", "function": GLAIVE_TOOLS[0]}]
    assert json.loads(s.tools or "null") == wrapped
    assert json.loads(s.messages or "null") == [
        {"role": "user", "content": "Area of a square of side 7?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": '{"area": 49}'},
        {"role": "assistant", "content": "It is 49."},
    ]
    assert s.prompt == f"User: Area of a square of side 7?\n\nAssistant: {CALL}\n\nTool: " + (
        '{"area": 49}'
    )
    assert s.sample_id == structural_id(json.loads(s.messages or "null"), json.dumps(wrapped))
    assert s.sample_id != structural_id(json.loads(s.messages or "null"))
    # A list rather than a string holding one, and already wrapped schemas: the same tools.
    assert normalise_record(_glaive(GLAIVE_TOOLS), "f", 1).tools == s.tools
    assert normalise_record(_glaive(wrapped), "f", 1).tools == s.tools


@pytest.mark.parametrize("empty", ["[]", "", None, []])
def test_an_empty_tool_list_is_no_tools(empty):
    s = normalise_record(_glaive(empty), "f", 1)
    assert s.tools is None and s.dropped_fields == {}


def test_records_that_differ_only_in_their_tools_are_not_duplicates():
    variants = [
        GLAIVE_TOOLS,
        [{**GLAIVE_TOOLS[0], "description": "Area"}],
        [*GLAIVE_TOOLS, {"name": "calculate_discount", "parameters": {}}],
    ]
    samples = [
        normalise_record(_glaive(json.dumps(t)), "h.json", i + 1) for i, t in enumerate(variants)
    ]
    assert len({s.sample_id for s in samples}) == 3


def test_sample_id_without_tools_is_the_old_hash():
    # sha256 over 8-byte little-endian length + UTF-8 of system, prompt, response (computed here).
    h = hashlib.sha256()
    for part in ("S", "Q", "A"):
        h.update(len(part.encode()).to_bytes(8, "little") + part.encode())
    assert sample_id("S", "Q", "A") == sample_id("S", "Q", "A", None) == h.hexdigest()[:16]
    h.update(len(b"[]").to_bytes(8, "little") + b"[]")
    assert sample_id("S", "Q", "A", "[]") == h.hexdigest()[:16]


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        pytest.param(
            "[{name: f}]",
            "h.json:5: field 'tools' holds a string that is not strict JSON (line 1 column 3: "
            "invalid JSON (Expecting property name enclosed in double quotes)). Write the value "
            "as JSON, or as a string holding valid JSON.",
            id="not_json",
        ),
        pytest.param(
            '{"name": "f"}',
            "h.json:5: field 'tools' must be a list of function schemas (JSON objects), got "
            '{"name": "f"}.',
            id="an_object",
        ),
        pytest.param(
            '["f"]',
            "h.json:5: field 'tools' must be a list of function schemas (JSON objects), got "
            '["f"].',
            id="a_list_of_names",
        ),
        pytest.param(
            '[{"description": "no name"}]',
            "h.json:5: tool 0 of 'tools' has neither 'type' nor a 'name'; write it as "
            '{"type": "function", "function": {"name": ..., "parameters": ...}} or as a bare '
            "function schema with a name.",
            id="no_name",
        ),
    ],
)
def test_malformed_tools_are_refused_with_the_records_place(tools, message):
    with pytest.raises(DatasetFormatError) as e:
        normalise_record(_glaive(tools), "h.json", 5)
    assert str(e.value) == message


def test_openai_tools_and_tool_calls_are_kept():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    record = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "assistant", "content": "18 degrees."},
        ],
        "tools": tools,
    }
    s = normalise_record(record, "oa.jsonl", 3)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert [m["content"] for m in json.loads(s.messages or "null")] == [
        "Weather in Paris?",
        call,
        "18 C",
        "18 degrees.",
    ]
    assert json.loads(s.tools or "null") == tools
    assert s.dropped_fields == {"messages[].tool_calls[].id": 1, "messages[].tool_call_id": 1}
    # Text beside the calls is kept before them; several calls are a list; arguments that are
    # not JSON stay text; the legacy function_call and functions read the same way.
    record["messages"][1] = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"type": "function", "function": {"name": "a", "arguments": "{}"}},
            {"type": "function", "function": {"name": "b", "arguments": "x=1"}},
        ],
    }
    two = normalise_record(record, "oa.jsonl", 3)
    assert json.loads(two.messages or "null")[1]["content"] == (
        'Checking.\n\n[{"name": "a", "arguments": {}}, {"name": "b", "arguments": "x=1"}]'
    )
    record["messages"][1] = {
        "role": "assistant",
        "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    legacy = normalise_record(
        {"messages": record["messages"], "functions": [tools[0]["function"]]}, "oa.jsonl", 3
    )
    assert (legacy.messages, legacy.tools) == (s.messages, s.tools)


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        pytest.param(
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]},
            'oa.jsonl:3: turn 1, tool call 0 must be {"type": "function", "function": '
            '{"name": ..., "arguments": ...}}; got {"type": "function", "function": {}}.',
            id="no_name",
        ),
        pytest.param(
            {"role": "assistant", "tool_calls": {"name": "f"}},
            "oa.jsonl:3: turn 1: 'tool_calls' must be a list of calls.",
            id="not_a_list",
        ),
        pytest.param(
            {
                "role": "assistant",
                "tool_calls": [{"type": "function", "function": {"name": "f"}}],
                "function_call": {"name": "f"},
            },
            "oa.jsonl:3: turn 1 has both 'tool_calls' and the legacy 'function_call'; keep one.",
            id="both",
        ),
    ],
)
def test_malformed_tool_calls_are_refused(turn, message):
    record = {"messages": [ONE_EXCHANGE[0], turn, {"role": "assistant", "content": "A"}]}
    with pytest.raises(DatasetFormatError) as e:
        normalise_record(record, "oa.jsonl", 3)
    assert str(e.value) == message


def test_a_nan_read_as_text_is_refused():
    with pytest.raises(DatasetFormatError) as e:
        normalise_record({"instruction": "I", "input": float("nan"), "output": "O"}, "p.parquet", 4)
    assert str(e.value) == (
        "p.parquet:4: field 'input' is the number nan, not text (a missing value written as "
        "NaN?). Write a string, or null for none."
    )


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


# Values of the wrong JSON type: named by the field (never the form), in JSON's words, with
# what to do. Every non-text kind: boolean, array, object; numbers are read as text.
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            True,
            "x.jsonl:3: field 'output' is the JSON boolean true, not text. "
            'Write it as a string ("true") if that is the text, or fix the record.',
        ),
        (
            False,
            "x.jsonl:3: field 'output' is the JSON boolean false, not text. "
            'Write it as a string ("false") if that is the text, or fix the record.',
        ),
        (
            [1, 2],
            "x.jsonl:3: field 'output' must be a string, got a JSON array. "
            "Fix the record or remove it from the file.",
        ),
        (
            {"a": 1},
            "x.jsonl:3: field 'output' must be a string, got a JSON object. "
            "Fix the record or remove it from the file.",
        ),
    ],
)
def test_answers_of_the_wrong_type_name_the_field(value, message):
    with pytest.raises(DatasetFormatError) as e:
        normalise_record({"instruction": "q", "output": value}, "x.jsonl", 3)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"instruction": True, "output": "a"}, "instruction"),
        ({"instruction": "q", "input": [1], "output": "a"}, "input"),
        ({"instruction": "q", "response": {"a": 1}}, "response"),
        ({"prompt": "q", "completion": False}, "completion"),
        ({"problem": "q", "solution": [2]}, "solution"),
    ],
)
def test_every_text_field_of_every_form_is_named(record, field):
    with pytest.raises(DatasetFormatError, match=f"^x.jsonl:3: field '{field}' "):
        normalise_record(record, "x.jsonl", 3)


def test_numbers_stay_text():
    assert normalise_record({"instruction": "q", "output": 4}, "x.jsonl", 1).response == "4"
    assert normalise_record({"instruction": "q", "output": 1.5}, "x.jsonl", 1).response == "1.5"


@pytest.mark.parametrize(
    ("record", "kind"),
    [(None, "null"), (1, "number"), ("text", "string"), ([1], "array"), (True, "boolean")],
)
def test_a_value_that_is_not_an_object_is_named_in_json_terms(record, kind):
    with pytest.raises(DatasetFormatError) as e:
        normalise_record(record, "x.jsonl", 2)
    assert str(e.value) == (
        f"x.jsonl:2: expected a JSON object per sample, got a JSON {kind}. Write each sample as "
        'an object (e.g. {"instruction": ..., "output": ...}), or remove the value from the file.'
    )


def test_files_the_reader_does_not_read_are_listed(tmp_path):
    from cluster_pipeline.data.formats import ignored_files

    (tmp_path / "good.jsonl").write_text('{"instruction": "q", "output": "a"}\n')
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.csv").write_text("a,b\n")
    (tmp_path / "eval.json").write_text('{"benchmarks": []}')
    (tmp_path / "fields.json").write_text("{}")
    (tmp_path / ".hidden").write_text("x")
    # The folder's card and license file document it (data/datasets.source_license); a card
    # deeper down is a file like any other.
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n")
    (tmp_path / "LICENSE").write_text("MIT License")
    (tmp_path / "sub" / "README.md").write_text("notes")
    assert [p.relative_to(tmp_path).as_posix() for p in ignored_files(tmp_path)] == [
        "notes.txt",
        "sub/README.md",
        "sub/extra.csv",
    ]


def _renamed(tmp_path, fields: dict, record: dict):
    """The one sample of a folder holding ``record`` (line 2 of a JSONL file) and
    ``fields.json``."""
    (tmp_path / "fields.json").write_text(json.dumps(fields))
    (tmp_path / "d.jsonl").write_text("\n" + json.dumps(record) + "\n")
    [s] = list(read_dataset_folder(tmp_path))
    return s


def test_a_rename_onto_a_field_the_record_has_is_refused(tmp_path):
    # The trial's case: fields.json {"q": "instruction"} over records that also hold
    # "instruction"; before, every prompt became "dup" and q was lost without a count.
    where = f"{tmp_path / 'd.jsonl'}:2"
    with pytest.raises(DatasetFormatError) as e:
        _renamed(tmp_path, {"q": "instruction"}, {"q": "Q", "instruction": "dup", "output": "O"})
    assert str(e.value) == (
        f"{where}: fields.json renames 'q' -> 'instruction', but the record has both 'q' and "
        "'instruction', so one would be lost. Remove one of them from the records, or change "
        "fields.json so that each lands on a field of its own (or drop the rename where the "
        "records already have the field)."
    )
    # The other key order names them in the record's order.
    with pytest.raises(DatasetFormatError) as e:
        _renamed(tmp_path, {"q": "instruction"}, {"instruction": "dup", "q": "Q", "output": "O"})
    assert "renames 'q' -> 'instruction', but the record has both 'instruction' and 'q'" in str(
        e.value
    )


def test_two_fields_renamed_onto_one_are_refused_only_where_a_record_has_both(tmp_path):
    fields = {"q": "instruction", "question": "instruction"}
    with pytest.raises(DatasetFormatError) as e:
        _renamed(tmp_path, fields, {"q": "A", "question": "B", "output": "O"})
    assert str(e.value).startswith(
        f"{tmp_path / 'd.jsonl'}:2: fields.json renames 'q' -> 'instruction' and 'question' -> "
        "'instruction', but the record has both 'q' and 'question', so one would be lost."
    )
    # Files of one folder may name the field differently: each record has one of them.
    (tmp_path / "d.jsonl").write_text(
        '{"q": "A", "output": "O"}\n{"question": "B", "output": "P"}\n'
    )
    assert [(s.prompt, s.response) for s in read_dataset_folder(tmp_path)] == [
        ("A", "O"),
        ("B", "P"),
    ]


def test_a_field_renamed_to_itself_changes_nothing(tmp_path):
    record = {"instruction": "I", "output": "O", "id": 1}
    s = _renamed(tmp_path, {"instruction": "instruction"}, record)
    plain = normalise_record(record, str(tmp_path / "d.jsonl"), 2, source_index=0)
    assert s == plain
    assert (s.prompt, s.response, s.dropped_fields) == ("I", "O", {"id": 1})


def test_renames_apply_at_once_not_along_a_chain(tmp_path):
    # a -> b, b -> c: a lands on b and b on c (not a on c), and nothing is lost.
    s = _renamed(
        tmp_path,
        {"q": "instruction", "instruction": "input"},
        {"q": "Q", "instruction": "I", "output": "O"},
    )
    assert (s.form, s.prompt, s.response, s.dropped_fields) == ("alpaca", "Q\n\nI", "O", {})
    # A chain that ends on a field the record has is a collision like any other.
    with pytest.raises(DatasetFormatError, match="renames 'instruction' -> 'input', but the"):
        _renamed(
            tmp_path,
            {"q": "instruction", "instruction": "input"},
            {"q": "Q", "instruction": "I", "input": "X", "output": "O"},
        )


def test_records_sharing_a_line_are_told_apart_by_their_index(tmp_path):
    one_line = tmp_path / "a.json"
    one_line.write_text(json.dumps([{"problem": p, "solution": "s"} for p in "xyz"]))
    (tmp_path / "b.jsonl").write_text(
        '{"problem": "u", "solution": "s"}\n\n{"problem": "v", "solution": "s"}\n'
    )
    got = [
        (Path(s.source_file).name, s.source_line, s.source_index, s.prompt)
        for s in read_dataset_folder(tmp_path)
    ]
    assert got == [
        ("a.json", 1, 0, "x"),
        ("a.json", 1, 1, "y"),
        ("a.json", 1, 2, "z"),
        ("b.jsonl", 1, 0, "u"),
        ("b.jsonl", 3, 1, "v"),
    ]
    # json.load(file)[source_index] is the record.
    assert json.loads(one_line.read_text())[got[1][2]]["problem"] == "y"
