"""A sample's identity is what it trains, by structure (issue 43: three conversations that
differed only in where a system turn sat became "2 duplicates" and were dropped).

The kind, "two records that train differently": turn order, a role swap, a system turn moved,
two leading system turns against one, tool schemas, tool calls (name, arguments), turn names,
and text that spells another conversation's turns. Each stays distinct. The other kind, "two
records that train the same": the same record in two files, one conversation in two forms
(ShareGPT, OpenAI), an Alpaca record and the same one exchange as a chat, a record's
``system`` field and a leading system turn, a trailing unanswered turn (not kept), a tool
call's ``id`` (not kept). Each is one sample, counted as a duplicate.

And what an existing table or cache sees: a plain exchange keeps the id it always had (the
embedding cache's rows stay valid); a conversation kept as turns gets a new id, so a re-read
embeds those samples again, and only those.
"""

import json
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.data.datasets import build_instruction_table
from cluster_pipeline.data.formats import normalise_record, read_dataset_folder
from cluster_pipeline.storage.embedding_cache import CACHE_TABLE, CHUNK_SCHEMA, pending_ids
from cluster_pipeline_tests.data.ids import plain_id, structural_id


def _oa(*turns) -> dict:
    """An OpenAI ``messages`` record from (role, content) or (role, content, name) turns."""
    out = []
    for t in turns:
        turn = {"role": t[0], "content": t[1]}
        if len(t) > 2:
            turn["name"] = t[2]
        out.append(turn)
    return {"messages": out}


def _id(record: dict) -> str:
    return normalise_record(record, "f.jsonl", 1).sample_id


def _table(records: list[dict]) -> tuple[pl.DataFrame, int]:
    samples = [normalise_record(r, "f.jsonl", i + 1) for i, r in enumerate(records)]
    frame, stats = build_instruction_table(samples, 0.0, None, None, seed=0)
    return frame, stats.duplicates


def _call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def _tools(*names: str) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "parameters": {}}} for n in names]


# A system turn in each place of a two-exchange conversation: four samples, not one.
SYSTEM_MOVED = [
    _oa(("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A")),
    _oa(("user", "Q1"), ("system", "S"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A")),
    _oa(("user", "Q1"), ("assistant", "A1"), ("system", "S"), ("user", "Q2"), ("assistant", "A")),
    _oa(("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("system", "S"), ("assistant", "A")),
]

DISTINCT = {
    "turn_order": [
        _oa(("user", "Q1"), ("assistant", "R"), ("user", "Q2"), ("assistant", "A")),
        _oa(("user", "Q2"), ("assistant", "R"), ("user", "Q1"), ("assistant", "A")),
    ],
    "role_swap": [
        _oa(("user", "X"), ("assistant", "Y"), ("user", "Z"), ("assistant", "A")),
        _oa(("user", "Y"), ("assistant", "X"), ("user", "Z"), ("assistant", "A")),
    ],
    "system_moved": SYSTEM_MOVED,
    "two_system_turns": [
        _oa(("system", "S1"), ("system", "S2"), ("user", "Q"), ("assistant", "A")),
        _oa(("system", "S1\n\nS2"), ("user", "Q"), ("assistant", "A")),
    ],
    "tool_schemas": [
        {**_oa(("user", "Q"), ("assistant", "A")), "tools": _tools("f")},
        {**_oa(("user", "Q"), ("assistant", "A")), "tools": _tools("g")},
        {**_oa(("user", "Q"), ("assistant", "A")), "tools": _tools("f", "g")},
        _oa(("user", "Q"), ("assistant", "A")),
    ],
    "tool_calls": [
        {"messages": [{"role": "user", "content": "Q"}, _call("f", {"x": 1})]},
        {"messages": [{"role": "user", "content": "Q"}, _call("f", {"x": 2})]},
        {"messages": [{"role": "user", "content": "Q"}, _call("g", {"x": 1})]},
    ],
    "names": [
        _oa(("user", "Q", "alice"), ("assistant", "A")),
        _oa(("user", "Q", "bob"), ("assistant", "A")),
        _oa(("user", "Q"), ("assistant", "A")),
        _oa(("user", "Q"), ("assistant", "A", "helper")),
    ],
    "tool_turn_names": [
        _oa(("user", "Q"), ("assistant", "call"), ("tool", "42", "weather"), ("assistant", "A")),
        _oa(("user", "Q"), ("assistant", "call"), ("tool", "42", "clock"), ("assistant", "A")),
    ],
    # One user turn that spells a conversation, and that conversation.
    "spelled_turns": [
        _oa(("user", "User: a\n\nAssistant: b\n\nUser: c"), ("assistant", "A")),
        _oa(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "A")),
    ],
}


@pytest.mark.parametrize("case", list(DISTINCT))
def test_records_that_train_differently_stay_distinct(case):
    records = DISTINCT[case]
    ids = [_id(r) for r in records]
    assert len(set(ids)) == len(records), ids
    frame, duplicates = _table(records)
    assert (frame.height, duplicates) == (len(records), 0)


def test_the_system_column_is_the_leading_system_turn_only():
    samples = [normalise_record(r, "f", 1) for r in SYSTEM_MOVED]
    assert [s.system for s in samples] == ["S", "", "", ""]
    # Every one keeps its turns as they stand, and they are what the id hashes.
    for record, s in zip(SYSTEM_MOVED, samples, strict=True):
        assert json.loads(s.messages or "null") == record["messages"]
        assert s.sample_id == structural_id(record["messages"])
    assert [s.prompt for s in samples] == [
        "User: Q1\n\nAssistant: A1\n\nUser: Q2",
        "User: Q1\n\nSystem: S\n\nAssistant: A1\n\nUser: Q2",
        "User: Q1\n\nAssistant: A1\n\nSystem: S\n\nUser: Q2",
        "User: Q1\n\nAssistant: A1\n\nUser: Q2\n\nSystem: S",
    ]
    # Before issue 43 all four read as one sample: every system turn in the system column and
    # the same flattened prompt (the old id, computed by hand, of what the reader gave then).
    # Now each has an id of its own, none of them that old one.
    old = plain_id("S", "User: Q1\n\nAssistant: A1\n\nUser: Q2", "A")
    ids = [s.sample_id for s in samples]
    assert len(set(ids)) == len(SYSTEM_MOVED) and old not in ids
    # One exchange with its system turn after the question: kept as it stands, too.
    late = normalise_record(_oa(("user", "Q"), ("system", "S"), ("assistant", "A")), "f", 1)
    assert (late.system, late.prompt, late.response) == ("", "User: Q\n\nSystem: S", "A")
    assert json.loads(late.messages or "null") == [
        {"role": "user", "content": "Q"},
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": "A"},
    ]
    early = normalise_record(_oa(("system", "S"), ("user", "Q"), ("assistant", "A")), "f", 1)
    assert (early.system, early.prompt, early.messages) == ("S", "Q", None)
    assert early.sample_id != late.sample_id


def test_names_are_kept_in_the_turns_and_not_counted_as_dropped():
    s = normalise_record(_oa(("user", "Q", "alice"), ("assistant", "A")), "f", 1)
    assert json.loads(s.messages or "null") == [
        {"role": "user", "content": "Q", "name": "alice"},
        {"role": "assistant", "content": "A"},
    ]
    assert s.dropped_fields == {}
    assert (s.system, s.prompt, s.response) == ("", "Q", "A")


def test_a_name_that_is_not_text_is_refused():
    record = {
        "messages": [
            {"role": "user", "content": "Q", "name": 7},
            {"role": "assistant", "content": "A"},
        ]
    }
    with pytest.raises(ValueError) as e:
        normalise_record(record, "f.jsonl", 3)
    assert str(e.value) == (
        "f.jsonl:3: turn 0 has a 'name' that is not a string (number); give the speaker's or "
        "the function's name as text, or leave it out."
    )


CONVERSATION = [("user", "Q1"), ("assistant", "A1"), ("user", "Q2"), ("assistant", "A2")]
SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}

SAME = {
    "two_forms": [
        _oa(*CONVERSATION),
        {"conversations": [{"from": SHAREGPT_ROLES[r], "value": v} for r, v in CONVERSATION]},
    ],
    "alpaca_and_chat": [
        {"instruction": "Q", "input": "", "output": "A"},
        _oa(("user", "Q"), ("assistant", "A")),
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
    ],
    "system_field_and_turn": [
        {"system": "S", **_oa(("user", "Q"), ("assistant", "A"))},
        _oa(("system", "S"), ("user", "Q"), ("assistant", "A")),
    ],
    "trailing_turn": [
        _oa(*CONVERSATION),
        _oa(*CONVERSATION, ("user", "and then?")),
    ],
    "trailing_turn_one_exchange": [
        _oa(("user", "Q"), ("assistant", "A")),
        _oa(("user", "Q"), ("assistant", "A"), ("user", "thanks")),
    ],
    "tool_call_ids": [
        {
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    **_call("f", {"x": 1}),
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": {"x": 1}},
                        }
                    ],
                },
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Q"},
                {
                    **_call("f", {"x": 1}),
                    "tool_calls": [
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "f", "arguments": {"x": 1}},
                        }
                    ],
                },
            ]
        },
    ],
}


@pytest.mark.parametrize("case", list(SAME))
def test_records_that_train_the_same_are_duplicates(case):
    records = SAME[case]
    assert len({_id(r) for r in records}) == 1
    frame, duplicates = _table(records)
    assert (frame.height, duplicates) == (1, len(records) - 1)


def test_the_same_record_in_two_files_is_one_sample(tmp_path):
    record = json.dumps(SYSTEM_MOVED[1])
    (tmp_path / "a.jsonl").write_text(record + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(SYSTEM_MOVED[2]) + "\n" + record + "\n")
    samples = list(read_dataset_folder(tmp_path))
    frame, stats = build_instruction_table(samples, 0.0, None, None, seed=0)
    assert (len(samples), frame.height, stats.duplicates) == (3, 2, 1)
    # The first source is kept.
    first = frame.filter(pl.col("sample_id") == samples[0].sample_id)
    assert (Path(first["source_file"][0]).name, first["source_line"][0]) == ("a.jsonl", 1)


PLAIN = [
    ({"instruction": "I", "input": "", "output": "O"}, ("", "I", "O", None)),
    # Alpaca's prompt: the instruction, a blank line, the input.
    ({"instruction": "I", "input": "X", "output": "O", "system": "S"}, ("S", "I\n\nX", "O", None)),
    (_oa(("system", "S"), ("user", "Q"), ("assistant", "A")), ("S", "Q", "A", None)),
    # The tools column: the schemas as JSON, json.dumps' default separators.
    (
        {**_oa(("user", "Q"), ("assistant", "A")), "tools": _tools("f")},
        ("", "Q", "A", '[{"type": "function", "function": {"name": "f", "parameters": {}}}]'),
    ),
    ({"text": "free text"}, ("", "", "free text", None)),
]


@pytest.mark.parametrize(("record", "parts"), PLAIN)
def test_a_plain_exchange_keeps_the_id_it_always_had(record, parts):
    s = normalise_record(record, "f", 1)
    assert s.messages is None
    assert (s.system, s.prompt, s.response, s.tools) == parts
    assert s.sample_id == plain_id(*parts)


def test_a_reread_embeds_again_only_the_samples_whose_id_changed(tmp_path):
    """The embedding cache of a pool read before issue 43 (rows under the ids of then, the
    plain formula for every sample) serves every plain sample after the change; the
    conversations kept as turns are pending (embedded again under their new ids)."""
    records = [
        {"instruction": "I1", "output": "O1"},
        _oa(("system", "S"), ("user", "Q"), ("assistant", "A")),
        _oa(*CONVERSATION),
        SYSTEM_MOVED[1],
    ]
    samples = [normalise_record(r, "f", i + 1) for i, r in enumerate(records)]
    old_ids = [plain_id(s.system, s.prompt, s.response, s.tools) for s in samples]
    cache = tmp_path / "cache"
    rows = {
        "sample_id": old_ids,
        "n_tokens": [10] * 4,
        "n_response_tokens": [3] * 4,
        "truncated": [False] * 4,
        "truncation": [None] * 4,
        "skip_reason": [None] * 4,
        "mean_loss": [1.0] * 4,
        "embedding": [[0.1, 0.2]] * 4,
        "hidden_mean": [[0.3, 0.4]] * 4,
    }
    pl.DataFrame(rows, schema=CHUNK_SCHEMA).write_delta(str(cache / CACHE_TABLE))
    new_ids = [s.sample_id for s in samples]
    assert new_ids[:2] == old_ids[:2]  # plain: unchanged
    assert new_ids[2] != old_ids[2] and new_ids[3] != old_ids[3]
    assert pending_ids(cache, new_ids) == new_ids[2:]
