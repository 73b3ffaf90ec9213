"""The record forms and file readers as registries: every module of the packages holds its
class, forms are tried in the order docs/design.md documents, and a record with the fields of
two forms is read as the one tried first."""

import re
from pathlib import Path

import pytest

from cluster_pipeline.data import forms, readers
from cluster_pipeline.data.formats import (
    FIELD_NAMES,
    FORMS,
    SUPPORTED_SUFFIXES,
    normalise_record,
)

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _modules(package) -> set[str]:
    folder = Path(package.__file__).parent
    return {p.stem for p in folder.glob("*.py")} - {"__init__", "base", "chat"}


def test_every_module_holds_one_registered_class():
    assert sorted(type(f).__module__.rsplit(".", 1)[1] for f in forms.REGISTRY) == sorted(
        _modules(forms)
    )
    assert sorted(type(r).__module__.rsplit(".", 1)[1] for r in readers.REGISTRY.values()) == (
        sorted(_modules(readers))
    )


def test_forms_are_tried_in_the_order_the_design_documents():
    text = DESIGN.read_text()
    table = text[text.index("tried in this order:") :].split("\n\n")[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    assert documented == [f.name for f in forms.REGISTRY]
    assert sorted(documented) == sorted(FORMS)


def test_the_listed_orders_are_those_users_have_always_seen():
    assert FORMS == (
        "alpaca",
        "instruction_response",
        "magicoder",
        "prompt_completion",
        "sharegpt",
        "openai",
        "prompt_completion_chat",
        "text",
    )
    assert FIELD_NAMES[-2:] == ("system", "tools")
    assert set(FIELD_NAMES) == {n for f in forms.REGISTRY for n in f.fields} | {"system", "tools"}
    assert SUPPORTED_SUFFIXES == (".json", ".jsonl", ".parquet", ".arrow")


CHAT = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
SHAREGPT = [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]
ALPACA = {"instruction": "I", "output": "O"}


@pytest.mark.parametrize(
    ("record", "form", "dropped"),
    [
        (
            {"messages": CHAT, "conversations": SHAREGPT, "text": "t"},
            "openai",
            {"conversations", "text"},
        ),
        ({"conversations": SHAREGPT, **ALPACA}, "sharegpt", {"instruction", "output"}),
        (
            {"prompt": CHAT[:1], "completion": CHAT[1:], **ALPACA},
            "prompt_completion_chat",
            {"instruction", "output"},
        ),
        (
            {"prompt": "P", "completion": "C", **ALPACA},
            "prompt_completion",
            {"instruction", "output"},
        ),
        ({**ALPACA, "response": "R"}, "alpaca", {"response"}),
        (
            {"instruction": "I", "response": "R", "problem": "P", "solution": "S"},
            "instruction_response",
            {"problem", "solution"},
        ),
        ({"problem": "P", "solution": "S", "text": "t"}, "magicoder", {"text"}),
    ],
)
def test_a_record_with_two_forms_fields_is_read_as_the_one_tried_first(record, form, dropped):
    sample = normalise_record(record, "f.jsonl", 1)
    assert sample.form == form
    assert sample.dropped_fields == dict.fromkeys(dropped, 1)
