"""The export's ``data/dataset_info.json``, read as LLaMA-Factory reads a dataset: its registry
entry (``DatasetAttr``), the files of the entry's folder (its loader) and its alpaca and sharegpt
converters, transcribed here from LLaMA-Factory's source (hiyouga/LLaMA-Factory, commit
ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30; LLaMA-Factory itself is not a dependency: it pins its
own transformers and torch). What is transcribed keeps LLaMA-Factory's names and logic, less the
branches an SFT dataset never takes (ranking, KTO, media, hub loading).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster_pipeline.data.formats import conversation
from cluster_pipeline.integrations.hf_datasets import export_selection
from cluster_pipeline_tests.integrations.test_hf_datasets import CHAT, TOOLS, _chats

datasets = pytest.importorskip("datasets")


# src/llamafactory/data/parser.py, lines 26-64 (the fields) and 72-90 (``join``).
@dataclass
class DatasetAttr:
    load_from: str
    dataset_name: str
    formatting: str = "alpaca"
    ranking: bool = False
    subset: str | None = None
    split: str = "train"
    folder: str | None = None
    num_samples: int | None = None
    system: str | None = None
    tools: str | None = None
    images: str | None = None
    videos: str | None = None
    audios: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    kto_tag: str | None = None
    prompt: str | None = "instruction"
    query: str | None = "input"
    response: str | None = "output"
    history: str | None = None
    messages: str | None = "conversations"
    role_tag: str | None = "from"
    content_tag: str | None = "value"
    user_tag: str | None = "human"
    assistant_tag: str | None = "gpt"
    observation_tag: str | None = "observation"
    function_tag: str | None = "function_call"
    system_tag: str | None = "system"

    def set_attr(self, key: str, obj: dict[str, Any], default: Any | None = None) -> None:
        setattr(self, key, obj.get(key, default))

    def join(self, attr: dict[str, Any]) -> None:
        self.set_attr("formatting", attr, default="alpaca")
        self.set_attr("ranking", attr, default=False)
        self.set_attr("subset", attr)
        self.set_attr("split", attr, default="train")
        self.set_attr("folder", attr)
        self.set_attr("num_samples", attr)
        if "columns" in attr:
            column_names = ["prompt", "query", "response", "history", "messages", "system", "tools"]
            column_names += ["images", "videos", "audios", "chosen", "rejected", "kto_tag"]
            for column_name in column_names:
                self.set_attr(column_name, attr["columns"])
        if "tags" in attr:
            tag_names = ["role_tag", "content_tag"]
            tag_names += [
                "user_tag",
                "assistant_tag",
                "observation_tag",
                "function_tag",
                "system_tag",
            ]
            for tag in tag_names:
                self.set_attr(tag, attr["tags"])


def get_dataset_attr(name: str, dataset_dir: str) -> DatasetAttr:
    """parser.py ``get_dataset_list``, lines 106-147, for one local entry (``file_name``)."""
    with open(os.path.join(dataset_dir, "dataset_info.json")) as f:
        dataset_info = json.load(f)
    if name not in dataset_info:
        raise ValueError(f"Undefined dataset {name} in dataset_info.json.")
    attr = DatasetAttr("file", dataset_name=dataset_info[name]["file_name"])
    attr.join(dataset_info[name])
    return attr


def load_single_dataset(attr: DatasetAttr, dataset_dir: str, cache_dir: str):
    """src/llamafactory/data/loader.py ``_load_single_dataset``, lines 73-89 and 131-140:
    every file of the entry's folder, one builder by extension, ``split`` of it."""
    data_files = []
    local_path = os.path.join(dataset_dir, attr.dataset_name)
    if os.path.isdir(local_path):
        for file_name in os.listdir(local_path):
            data_files.append(os.path.join(local_path, file_name))
    elif os.path.isfile(local_path):
        data_files.append(local_path)
    else:
        raise ValueError(f"File {local_path} not found.")
    ext2type = {
        "arrow": "arrow",
        "csv": "csv",
        "json": "json",
        "jsonl": "json",
        "parquet": "parquet",
    }
    data_path = ext2type.get(os.path.splitext(data_files[0])[-1][1:])
    assert data_path is not None, "Allowed file types: arrow, csv, json, jsonl, parquet, txt"
    if any(data_path != ext2type.get(os.path.splitext(f)[-1][1:]) for f in data_files):
        raise ValueError("File types should be identical.")
    return datasets.load_dataset(
        path=data_path, data_files=data_files, split=attr.split, cache_dir=cache_dir
    )


# src/llamafactory/data/converter.py, lines 84-131 (AlpacaDatasetConverter.__call__), the
# history/prompt/query/response branches of a normal example.
def convert_alpaca(attr: DatasetAttr, example: dict[str, Any]) -> dict[str, Any]:
    prompt = []
    if attr.history and isinstance(example[attr.history], list):
        for old_prompt, old_response in example[attr.history]:
            prompt.append({"role": "user", "content": old_prompt})
            prompt.append({"role": "assistant", "content": old_response})
    query = []
    if attr.prompt and example[attr.prompt]:
        query.append(example[attr.prompt])
    if attr.query and example[attr.query]:
        query.append(example[attr.query])
    prompt.append({"role": "user", "content": "\n".join(query)})
    if attr.response and isinstance(example[attr.response], str):
        response = [{"role": "assistant", "content": example[attr.response]}]
    else:
        response = []
    return {
        "_prompt": prompt,
        "_response": response,
        "_system": example[attr.system] if attr.system else "",
        "_tools": example[attr.tools] if attr.tools else "",
    }


# converter.py, lines 134-227 (SharegptDatasetConverter.__call__), a normal example.
def convert_sharegpt(attr: DatasetAttr, example: dict[str, Any]) -> dict[str, Any]:
    tag_mapping = {
        attr.user_tag: "user",
        attr.assistant_tag: "assistant",
        attr.observation_tag: "observation",
        attr.function_tag: "function",
        attr.system_tag: "system",
    }
    odd_tags = (attr.user_tag, attr.observation_tag)
    even_tags = (attr.assistant_tag, attr.function_tag)
    accept_tags = (odd_tags, even_tags)
    # (LLaMA-Factory's lines as written: messages is set for sharegpt; pyright sees str | None)
    messages = example[attr.messages]  # pyright: ignore[reportArgumentType]
    if attr.system_tag and len(messages) != 0 and messages[0][attr.role_tag] == attr.system_tag:
        system = messages[0][attr.content_tag]
        messages = messages[1:]
    else:
        system = example[attr.system] if attr.system else ""
    aligned_messages = []
    broken_data = False
    for turn_idx, message in enumerate(messages):
        if message[attr.role_tag] not in accept_tags[turn_idx % 2]:
            broken_data = True
            break
        aligned_messages.append(
            {"role": tag_mapping[message[attr.role_tag]], "content": message[attr.content_tag]}
        )
    if len(aligned_messages) % 2 != 0:
        broken_data = True
    if broken_data:
        prompt, response = [], []
    else:
        prompt = aligned_messages[:-1]
        response = aligned_messages[-1:]
    return {
        "_prompt": prompt,
        "_response": response,
        "_system": system,
        "_tools": example[attr.tools] if attr.tools else "",
    }


CONVERTERS = {"alpaca": convert_alpaca, "sharegpt": convert_sharegpt}


@pytest.fixture
def exported(tmp_path) -> tuple[Path, list[dict]]:
    """The chats dataset (a tool call, two turns, two Alpaca records) exported; returns the
    export's ``data/`` folder (LLaMA-Factory's ``dataset_dir``) and the train split's rows."""
    source, raw_dir = _chats(tmp_path)
    out = tmp_path / "export"
    export_selection(source, out, raw_dir)
    train = datasets.load_from_disk(str(out / "dataset_dict"))["train"].to_list()
    return out / "data", train


def test_the_sharegpt_entry_reads_every_conversation_once_with_its_system_and_tools(
    exported, tmp_path
):
    dataset_dir, train = exported
    attr = get_dataset_attr("chats", str(dataset_dir))
    assert (attr.formatting, attr.messages, attr.tools) == ("sharegpt", "messages", "tools_json")
    rows = load_single_dataset(attr, str(dataset_dir), str(tmp_path / "cache")).to_list()
    # The folder holds the train split's files alone: each sample once, not once per split.
    assert len(rows) == len(train) == 4
    by_id = {r["sample_id"]: r for r in train}
    for row in rows:
        mine = by_id[row["sample_id"]]
        lf = convert_sharegpt(attr, row)
        # Every turn of the conversation as the product renders it, the system message as
        # LLaMA-Factory's system; its observation is our tool turn.
        turns = mine["messages"]
        if mine["form"] == "alpaca":
            assert turns == conversation("", mine["prompt"], mine["response"], None)
        expected = [
            {"role": {"tool": "observation"}.get(m["role"], m["role"]), "content": m["content"]}
            for m in turns
            if m["role"] != "system"
        ]
        assert lf["_prompt"] + lf["_response"] == expected
        assert lf["_response"] == [{"role": "assistant", "content": mine["response"]}]
        assert lf["_system"] == (mine["system"] or "")
        assert lf["_tools"] == mine["tools_json"]
    chat = next(r for r in rows if r["tools_json"] is not None)
    lf = convert_sharegpt(attr, chat)
    assert lf["_system"] == "Be brief." and json.loads(lf["_tools"]) == TOOLS
    assert [m["role"] for m in lf["_prompt"]] == ["user", "assistant", "observation"]
    assert len(lf["_prompt"]) == len(CHAT) - 2  # less the system message and the response


def test_the_alpaca_entry_reads_prompt_response_and_system(exported, tmp_path):
    dataset_dir, train = exported
    attr = get_dataset_attr("chats_alpaca", str(dataset_dir))
    assert (attr.prompt, attr.query, attr.response, attr.system) == (
        "prompt",
        None,
        "response",
        "system",
    )
    rows = load_single_dataset(attr, str(dataset_dir), str(tmp_path / "cache")).to_list()
    assert sorted(r["sample_id"] for r in rows) == sorted(r["sample_id"] for r in train)
    for row in rows:
        lf = convert_alpaca(attr, row)
        # One exchange: the prompt (earlier turns of a conversation inside it), the response.
        assert lf["_prompt"] == [{"role": "user", "content": row["prompt"]}]
        assert lf["_response"] == [{"role": "assistant", "content": row["response"]}]
        assert lf["_system"] == row["system"]
        assert lf["_tools"] == row["tools_json"]
