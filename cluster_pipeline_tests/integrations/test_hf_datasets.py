"""``cluster-pipeline export``: the selection as a ``datasets`` folder, Parquet files and a dataset
card, read back with ``datasets`` equal to the shard manifests it came from.

The fast tests export hand-made manifests over real tables; the slow ones materialize the cheap
chain ``raw_instructions -> shard_manifests`` (and ``sample_lineage``) once for the module, on
the tiny dataset and model, and export through the command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import dagster as dg
import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml

from cluster_pipeline.data.datasets import build_instruction_table, load_samples
from cluster_pipeline.defs.configs import repeatable_config
from cluster_pipeline.integrations import dataset_card
from cluster_pipeline.integrations.hf_datasets import (
    ExportError,
    ExportSource,
    export_selection,
    verify_export,
)
from cluster_pipeline.selection.sharding import ShardManifest, content_sha256, manifests_frame
from cluster_pipeline.storage import atomic
from cluster_pipeline.storage.layout import default_data_dir
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline_tests.helpers import tiny_records, write_jsonl

# One xdist worker runs this module: its module-scoped fixture starts once.
pytestmark = pytest.mark.xdist_group("hf_datasets")

datasets = pytest.importorskip("datasets")


def _card(out: Path) -> tuple[dict, str]:
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def _parquet(out: Path, split: str, cache: Path):
    """The split's Parquet files as a tool reads them: every file of its folder."""
    folder = out / "data" / split
    return datasets.load_dataset(
        "parquet", data_dir=str(folder), split="train", cache_dir=str(cache)
    )


def _source_line(row: dict, folder: Path) -> dict:
    """The record at the row's source file (relative to the dataset's ``folder``) and line,
    read from the file itself."""
    assert not Path(row["source_file"]).is_absolute()
    line = (folder / row["source_file"]).read_text().splitlines()[row["source_line"] - 1]
    return json.loads(line)


def _assert_reads_back(out: Path, manifests: list[ShardManifest], cache: Path) -> dict:
    """Every reader gives each rank's manifest, in order, with its weight; ``train`` is the
    ranks one after the other; the card's header counts the rows. Returns the card's header."""
    on_disk = datasets.load_from_disk(str(out / "dataset_dict"))
    assert list(on_disk) == ["train", *(f"rank_{m.rank}" for m in manifests)]
    by_card = datasets.load_dataset(str(out), cache_dir=str(cache))
    header, _ = _card(out)
    counts = {s["name"]: s["num_examples"] for s in header["dataset_info"]["splits"]}
    for m in manifests:
        split = f"rank_{m.rank}"
        for ds in (on_disk[split], _parquet(out, split, cache), by_card[split]):
            assert ds["sample_id"] == list(m.sample_ids)
            assert ds["position"] == list(range(m.n_samples))
            assert set(ds["rank"]) == {m.rank} and set(ds["weight"]) == {m.weight}
            assert set(ds["manifest_sha256"]) == {m.sha256}
        assert counts[split] == m.n_samples
    whole = [sid for m in manifests for sid in m.sample_ids]
    for ds in (on_disk["train"], _parquet(out, "train", cache), by_card["train"]):
        assert ds["sample_id"] == whole
    assert counts["train"] == len(whole)
    assert on_disk["train"].to_list() == _parquet(out, "train", cache).to_list()
    # Every split the configs name has its own folder of files, and data/ holds nothing else
    # but LLaMA-Factory's dataset_info.json.
    named = {f["split"]: f["path"] for f in header["configs"][0]["data_files"]}
    assert list(named) == list(counts)
    assert named == {split: f"data/{split}/*.parquet" for split in counts}
    assert sorted(p for s in named.values() for p in out.glob(s)) == sorted(
        p for p in (out / "data").rglob("*") if p.is_file() and p.name != "dataset_info.json"
    )
    assert sorted(p.name for p in (out / "data").iterdir()) == sorted(
        [*counts, "dataset_info.json"]
    )
    return header


# --- Hand-made manifests over real tables -----------------------------------------------------


def _hand_made(tmp_path: Path, order: int = 1) -> tuple[ExportSource, list[ShardManifest]]:
    """A 12-sample dataset read from its source file, clusters 0/1 alternating, and two shards:
    each cluster's samples in ``order`` (1 or -1), rank 0's first sample twice (a copy, as
    ``uniform`` makes)."""
    raw_dir = tmp_path / "data" / "raw"
    write_jsonl(raw_dir / "hand" / "samples.jsonl", tiny_records(12))
    frame, _ = build_instruction_table(load_samples("hand", raw_dir), 0.0, None, None, seed=0)
    tables = tmp_path / "data" / "tables"
    raw = write_table(frame, tables / "raw_instructions")
    ids = frame["sample_id"].to_list()
    labels = [i % 2 for i in range(len(ids))]
    clusters = write_table(
        pl.DataFrame({"sample_id": ids, "cluster": labels}), tables / "balanced_clusters"
    )
    shards = []
    for c, weight in ((0, 1.25), (1, 0.75)):
        members = [s for s, label in zip(ids, labels, strict=True) if label == c][::order]
        if c == 0:
            members = [members[0], *members]
        shards.append(ShardManifest("hand", c, 2, "uniform", weight, 3, tuple(members), 10 * c))
    folder = tmp_path / "data" / "shards" / f"set{order}"
    paths = [str(m.write(folder)) for m in shards]
    shard_table = write_table(manifests_frame(shards), tables / "shard_manifests")
    source = ExportSource(
        dataset="hand",
        selector="uniform",
        ratio=1.0,
        selection_seed=0,
        num_clusters=2,
        alpha=1.5,
        cluster_weights=[1.25, 0.75],
        balance="samples",
        token_budget=None,
        pool_size=12,
        selected_samples=12,
        base_model="/models/tiny",
        manifest_paths=paths,
        manifest_sha256=[m.sha256 for m in shards],
        manifest_set_sha256=f"{order:+d}" * 32,
        dropped_for_equal_shards=0,
        tables={
            "raw_instructions": raw,
            "balanced_clusters": clusters,
            "shard_manifests": shard_table,
        },
    )
    return source, shards


def test_hand_made_manifests_read_back_equal_with_source_lines_and_clusters(tmp_path):
    source, manifests = _hand_made(tmp_path)
    out = tmp_path / "export"
    summary = export_selection(source, out, tmp_path / "data" / "raw")
    assert summary.rows == {"train": 13, "rank_0": 7, "rank_1": 6}
    assert not summary.replaced and summary.license is None
    header = _assert_reads_back(out, manifests, tmp_path / "cache")
    assert "license" not in header
    train = datasets.load_from_disk(str(out / "dataset_dict"))["train"]
    for row in train:
        record = _source_line(row, tmp_path / "data" / "raw" / "hand")
        assert row["response"] == record["output"] and record["instruction"] in row["prompt"]
        assert row["cluster"] == row["rank"]  # clusters alternate, rank c holds cluster c
        # JSON Lines without blank lines: record i (0-based) is on line i + 1.
        assert row["source_index"] == row["source_line"] - 1
    _, body = _card(out)
    assert "The source declares no license" in body
    assert "| rank_0 | `data/rank_0/` | 7 | 0 | 1.2500 |" in body
    assert "| rank_1 | `data/rank_1/` | 6 | 10 | 0.7500 |" in body
    # Sample balance: the weights' formula is the published n_c K / N.
    assert "| cluster weights w_c = n_c K / N | 1.2500, 0.7500 |" in body
    assert "R_c" not in body
    identity = json.loads((out / "export.json").read_text())
    assert identity["splits"] == {"train": 13, "rank_0": 7, "rank_1": 6}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "P"}'}}
        ],
    },
    {"role": "tool", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C."},
]


def _chats(tmp_path: Path) -> tuple[ExportSource, Path]:
    """A dataset of an OpenAI chat with a tool call and schemas, a two-turn chat and two
    Alpaca records, every sample on one rank; a card declaring its language and a license
    file in its folder. Returns the source and the raw folder."""
    raw_dir = tmp_path / "data" / "raw"
    folder = raw_dir / "chats"
    two_turns = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "5"},
    ]
    write_jsonl(
        folder / "chats.jsonl",
        [{"messages": CHAT, "tools": TOOLS}, {"messages": two_turns}, *tiny_records(2)],
    )
    (folder / "README.md").write_text("---\nlanguage:\n- en\n- fr\n---\n# chats\n")
    (folder / "LICENSE").write_text("Do what you like.\n")
    frame, _ = build_instruction_table(load_samples("chats", raw_dir), 0.0, None, None, seed=0)
    tables = tmp_path / "data" / "tables"
    raw = write_table(frame, tables / "raw_instructions")
    ids = frame["sample_id"].to_list()
    clusters = write_table(
        pl.DataFrame({"sample_id": ids, "cluster": [0] * len(ids)}), tables / "balanced_clusters"
    )
    manifest = ShardManifest("chats", 0, 1, "full", 1.0, 0, tuple(ids))
    path = manifest.write(tmp_path / "data" / "shards" / "chats" / "set")
    source = ExportSource(
        dataset="chats",
        selector="full",
        ratio=1.0,
        selection_seed=0,
        num_clusters=1,
        alpha=1.5,
        cluster_weights=[1.0],
        balance="samples",
        token_budget=None,
        pool_size=len(ids),
        selected_samples=len(ids),
        base_model=str(tmp_path / "models" / "tiny"),
        manifest_paths=[str(path)],
        manifest_sha256=[manifest.sha256],
        manifest_set_sha256="c" * 64,
        dropped_for_equal_shards=0,
        tables={"raw_instructions": raw, "balanced_clusters": clusters},
    )
    return source, raw_dir


def test_rows_carry_the_conversation_as_messages_and_the_tools_as_schemas(tmp_path):
    from cluster_pipeline.integrations.hf_trainer import ClusterShards

    source, raw_dir = _chats(tmp_path)
    out = tmp_path / "export"
    export_selection(source, out, raw_dir)
    for ds in (
        datasets.load_from_disk(str(out / "dataset_dict"))["train"],
        datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))["train"],
    ):
        assert ds.features["messages"] == datasets.List(
            {"role": datasets.Value("string"), "content": datasets.Value("string")}
        )
        rows = {r["form"]: r for r in ds.to_list()}
        chat = next(r for r in ds.to_list() if r["tools"] is not None)
        # The whole conversation, as the source wrote it: its roles, and every turn's text but
        # the tool call's (trained as the call's JSON).
        assert [m["role"] for m in chat["messages"]] == [m["role"] for m in CHAT]
        for got, wrote in zip(chat["messages"], CHAT, strict=True):
            if not wrote.get("tool_calls"):
                assert got["content"] == wrote["content"]
        # The call as the reader trains it: {"name", "arguments"} (arguments parsed).
        call = json.loads(chat["messages"][2]["content"])
        assert call == {"name": "weather", "arguments": {"city": "P"}}
        assert chat["system"] == "Be brief." and chat["response"] == "It is 18 C."
        # The schemas as a list of objects, and as the same JSON text.
        assert chat["tools"] == TOOLS and json.loads(chat["tools_json"]) == TOOLS
        # One exchange: system (none here), user, assistant.
        alpaca = rows["alpaca"]
        assert alpaca["messages"] == [
            {"role": "user", "content": alpaca["prompt"]},
            {"role": "assistant", "content": alpaca["response"]},
        ]
        assert alpaca["tools"] is None and alpaca["tools_json"] is None
        # The source file relative to the dataset's folder.
        assert {r["source_file"] for r in ds.to_list()} == {"chats.jsonl"}
    # What trains reads the same text back: every row's text hashes to its sample_id (the
    # tools' JSON byte for byte), and the conversation renders as the product renders it.
    shards = ClusterShards.from_export(out)
    assert shards.rows is not None
    stored = pl.read_delta(source.tables["raw_instructions"].uri)
    assert sorted(shards.rows.rows()) == sorted(stored.select(shards.rows.columns).rows())


def test_nothing_of_this_machine_is_in_the_card_or_the_info(tmp_path):
    source, raw_dir = _chats(tmp_path)
    out = tmp_path / "export"
    export_selection(source, out, raw_dir)
    card = (out / "README.md").read_text()
    splits = datasets.load_from_disk(str(out / "dataset_dict"))
    published = [
        card,
        *(f"{s.info.description} {s.info.citation} {s.info.license}" for s in splits.values()),
    ]
    machine = [str(tmp_path), str(tmp_path.resolve()), str(Path.home()), "/tmp/", str(raw_dir)]
    for text in published:
        for path in machine:
            assert path not in text, path
    # The license's declaration and the manifest files, named from the data folder.
    assert "as declared by the license file data/raw/chats/LICENSE." in card
    assert "`data/shards/chats/set/rank_0.json`" in card
    # ds.info says what it is, with the method's citation and the license.
    info = splits["train"].info
    assert info.description.startswith("The samples of dataset 'chats' selected with CluSTER")
    assert "author = {Kim and others}" in info.citation
    assert info.license == "other (chats-license)"
    # The source's card gave the language; the Hub's header keys are all there.
    header, _ = _card(out)
    assert header["language"] == ["en", "fr"]
    assert header["task_categories"] == ["text-generation"]
    assert header["size_categories"] == ["n<1K"]


def test_an_earlier_format_is_replaced_but_not_read(tmp_path):
    from cluster_pipeline.integrations.hf_trainer import ClusterShards

    source, raw_dir = _chats(tmp_path)
    out = tmp_path / "export"
    export_selection(source, out, raw_dir)
    identity = json.loads((out / "export.json").read_text())
    (out / "export.json").write_text(json.dumps({**identity, "format": 2}))
    with pytest.raises(ExportError) as e:
        ClusterShards.from_export(out)
    assert str(e.value) == (
        f"{out / 'export.json'} is format 2, written by an earlier cluster-pipeline (messages "
        "as JSON text, every split's Parquet files in one folder), which this one does not "
        f"read; export it again: `cluster-pipeline export chats --out {out} --overwrite`"
    )
    assert export_selection(source, out, raw_dir).replaced  # the same manifests
    assert ClusterShards.from_export(out).world_size == 1


def test_an_existing_export_is_replaced_only_when_it_is_the_same_or_overwrite_is_given(tmp_path):
    a, _ = _hand_made(tmp_path / "a", order=1)
    b, manifests_b = _hand_made(tmp_path / "b", order=-1)
    raw_a = tmp_path / "a" / "data" / "raw"
    out = tmp_path / "export"
    export_selection(a, out, raw_a)
    assert export_selection(a, out, raw_a).replaced  # the same manifests: written again
    with pytest.raises(ExportError) as e:
        export_selection(b, out, raw_a)
    assert str(e.value) == (
        f"{out} holds another export (dataset 'hand', manifest set {'+1' * 6}), not dataset "
        f"'hand' manifest set {'-1' * 6}; pass --overwrite to replace it, or --out another folder"
    )
    assert json.loads((out / "export.json").read_text())["manifest_set_sha256"] == "+1" * 32
    assert export_selection(b, out, raw_a, overwrite=True).replaced
    _assert_reads_back(out, manifests_b, tmp_path / "cache")
    assert not list(tmp_path.glob(".export.*"))

    with pytest.raises(ExportError, match="is a file; choose a folder with --out"):
        export_selection(a, out / "README.md", raw_a)


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every path under ``folder``: a file's bytes, a symlink's target, a folder as ``dir``."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            out[rel] = f"-> {os.readlink(p)}"
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = p.read_bytes()
    return out


NOT_OURS = (
    "; --out {out} is not empty, and what it holds ({held}) is not this command's to replace, "
    "with or without --overwrite: move those out of {out}, or choose a new or empty folder with "
    "--out"
)


@pytest.mark.parametrize(
    "identity, why",
    [
        (
            '{"exporter": "my-other-tool"}',
            'has no "exporter": "cluster-pipeline export", so it is not an export',
        ),
        ("{}", 'has no "exporter": "cluster-pipeline export", so it is not an export'),
        ("[1, 2]", 'has no "exporter": "cluster-pipeline export", so it is not an export'),
        ('{"exporter": ', "is not valid JSON (Expecting value: line 1 column 14)"),
        # An export of an older cluster-pipeline (no marker, no file list) is not ours either.
        (
            '{"dataset": "hand", "manifest_set_sha256": "x", "manifest_sha256": []}',
            'has no "exporter": "cluster-pipeline export", so it is not an export',
        ),
        (
            '{"exporter": "cluster-pipeline export", "format": 1}',
            "is format 1, not 3 (the one this cluster-pipeline writes and reads)",
        ),
    ],
)
def test_a_folder_whose_export_json_is_not_ours_is_never_touched(tmp_path, identity, why):
    a, _ = _hand_made(tmp_path / "a")
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "export.json").write_text(identity)
    (proj / "src" / "main.py").write_text("x\n")
    (proj / "NOTES.md").write_text("n\n")
    before = _snapshot(proj)
    for overwrite in (False, True):
        with pytest.raises(ExportError) as e:
            export_selection(a, proj, tmp_path / "a" / "data" / "raw", overwrite=overwrite)
        held = "NOTES.md, export.json, src/"
        assert str(e.value) == f"{proj / 'export.json'} {why}" + NOT_OURS.format(
            out=proj, held=held
        )
        assert _snapshot(proj) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "proj"]  # no temp folder left


def test_a_folder_without_export_json_is_never_touched(tmp_path):
    a, _ = _hand_made(tmp_path / "a")
    notes = tmp_path / "notes"
    (notes / "empty").mkdir(parents=True)
    (notes / "todo.txt").write_text("mine")
    before = _snapshot(notes)
    with pytest.raises(ExportError) as e:
        export_selection(a, notes, tmp_path / "a" / "data" / "raw", overwrite=True)
    assert str(e.value) == f"{notes} holds no export.json, so it is not an export" + (
        NOT_OURS.format(out=notes, held="empty/, todo.txt")
    )
    assert _snapshot(notes) == before


def _besides(out: Path, outside: Path) -> list[str]:
    """Put a user's things in an export folder; return what the refusal names."""
    (out / "MY_NOTES.txt").write_text("n\n")
    (out / "mywork" / "deep").mkdir(parents=True)
    (out / "mywork" / "deep" / "train.py").write_text("x\n")
    (out / "link").symlink_to(outside)
    (out / "data" / "mine.parquet").write_bytes(b"PAR1")
    (out / "dataset_dict" / "rank_0" / "cache-0a1b.arrow").write_bytes(b"arrow")
    (out / "scratch").mkdir()
    with (out / "README.md").open("a") as f:  # a file the export wrote, edited since
        f.write("my note\n")
    return [
        "MY_NOTES.txt",
        "README.md",
        "data/mine.parquet",
        "dataset_dict/rank_0/cache-0a1b.arrow",
        "link",
        "mywork/",
        "scratch/",
    ]


def test_files_beside_an_export_are_never_deleted_and_make_it_refuse(tmp_path):
    a, _ = _hand_made(tmp_path / "a", order=1)
    b, _ = _hand_made(tmp_path / "b", order=-1)
    raw = tmp_path / "a" / "data" / "raw"
    # The default folder, data/exports/<name>, is a folder like any other.
    out = tmp_path / "data" / "exports" / "hand"
    export_selection(a, out, raw)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    named = [p for p in _besides(out, outside) if p != "README.md"]  # README.md: the export's
    before = _snapshot(out)
    for source, overwrite in ((a, False), (a, True), (b, True)):
        with pytest.raises(ExportError) as e:
            export_selection(source, out, raw, overwrite=overwrite)
        assert str(e.value) == (
            f"--out {out} holds an export, and besides it 6 path(s) the export did not write: "
            f"{', '.join(named[:5])} and 1 more. Nothing but the export's own files is "
            f"replaced, with or without --overwrite: move those out of {out} (or delete them), "
            "or choose another folder with --out"
        )
        assert _snapshot(out) == before and outside.read_text() == "keep"
    assert sorted(p.name for p in out.parent.iterdir()) == ["hand"]


def test_an_export_whose_own_files_changed_is_replaced_only_with_overwrite(tmp_path):
    a, _ = _hand_made(tmp_path / "a", order=1)
    raw = tmp_path / "a" / "data" / "raw"
    out = tmp_path / "export"
    export_selection(a, out, raw)
    pristine = _snapshot(out)
    with (out / "README.md").open("a") as f:
        f.write("my note\n")
    parquet = out / "data" / "rank_0" / "rank_0-00000-of-00001.parquet"
    pq.write_table(pq.read_table(parquet).slice(1), parquet)
    edited = _snapshot(out)
    with pytest.raises(ExportError) as e:
        export_selection(a, out, raw)
    assert str(e.value) == (
        f"--out {out} holds an export, 2 of whose own files changed since it wrote them: "
        "README.md, data/rank_0/rank_0-00000-of-00001.parquet. Pass --overwrite to replace them "
        "with a fresh export (nothing else in the folder is touched), or copy them elsewhere "
        "first"
    )
    assert _snapshot(out) == edited
    export_selection(a, out, raw, overwrite=True)
    assert _snapshot(out).keys() == pristine.keys()
    verify_export(out)  # every listed file as the fresh export wrote it


def test_replacing_an_export_deletes_only_the_files_it_listed(tmp_path, monkeypatch):
    a, _ = _hand_made(tmp_path / "a", order=1)
    b, manifests_b = _hand_made(tmp_path / "b", order=-1)
    raw = tmp_path / "a" / "data" / "raw"
    out = tmp_path / "export"
    export_selection(a, out, raw)
    listed = json.loads((out / "export.json").read_text())["files"]
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert sorted([*listed, "export.json"]) == on_disk
    for rel, sha in listed.items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == sha
    # A file that appears in the earlier export after the last check (a race) is left, in the
    # folder the earlier export was swapped out to, and the summary says where.
    swap = atomic.swap_in

    def late_file(tmp: Path, dest: Path) -> None:
        (dest / "late.txt").write_text("late")
        swap(tmp, dest)

    monkeypatch.setattr(atomic, "swap_in", late_file)
    summary = export_selection(b, out, raw, overwrite=True)
    assert summary.replaced and summary.left_behind is not None
    assert _snapshot(summary.left_behind) == {"late.txt": b"late"}
    assert summary.left_behind.parent == tmp_path and summary.left_behind.name.startswith(
        ".export.tmp-"
    )
    _assert_reads_back(out, manifests_b, tmp_path / "cache")
    monkeypatch.setattr(atomic, "swap_in", swap)
    # Without renameat2's exchange (another file system): two renames, the same outcome.
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    again = export_selection(a, out, raw, overwrite=True)
    assert again.replaced and again.left_behind is None
    _assert_reads_back(out, _hand_made(tmp_path / "c", order=1)[1], tmp_path / "cache")
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden == [summary.left_behind]


def test_out_may_be_a_symlink_to_a_folder(tmp_path):
    a, manifests = _hand_made(tmp_path / "a", order=1)
    b, manifests_b = _hand_made(tmp_path / "b", order=-1)
    raw = tmp_path / "a" / "data" / "raw"
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    summary = export_selection(a, link, raw)
    assert summary.out == target and link.is_symlink() and link.resolve() == target
    _assert_reads_back(link, manifests, tmp_path / "cache")
    assert export_selection(b, link, raw, overwrite=True).replaced
    assert link.is_symlink() and link.resolve() == target
    _assert_reads_back(target, manifests_b, tmp_path / "cache")
    (target / "mine.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"besides it 1 path\(s\) .*: mine\.txt\. Nothing"):
        export_selection(a, link, raw, overwrite=True)
    assert (target / "mine.txt").read_text() == "mine"


def test_an_out_that_cannot_be_created_names_out(tmp_path):
    a, _ = _hand_made(tmp_path / "a")
    raw = tmp_path / "a" / "data" / "raw"
    with pytest.raises(ExportError) as e:
        export_selection(a, Path("/proc/nope"), raw)
    assert str(e.value) == (
        "--out /proc/nope cannot be created: its parent folder /proc cannot be written (No such "
        "file or directory); choose a folder you can write with --out"
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError) as e:
        export_selection(a, tmp_path / "file" / "sub" / "out", raw)
    assert str(e.value) == (
        f"--out {tmp_path / 'file' / 'sub' / 'out'} cannot be created: its parent folder "
        f"{tmp_path / 'file' / 'sub'} cannot be created (Not a directory); choose a folder you "
        "can write with --out"
    )


def test_a_failed_export_leaves_the_earlier_one_intact(tmp_path, monkeypatch):
    a, manifests_a = _hand_made(tmp_path / "a", order=1)
    b, _ = _hand_made(tmp_path / "b", order=-1)
    out = tmp_path / "export"
    export_selection(a, out, tmp_path / "a" / "data" / "raw")
    before = _snapshot(out)

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # The card is written after the splits: the failure strikes a half-written export; then
    # the swap itself fails, with and without renameat2's exchange.
    for target, name in (
        (dataset_card, "build_card"),
        (atomic, "exchange"),
        (Path, "rename"),
    ):
        with monkeypatch.context() as m:
            if name == "rename":
                m.setattr(atomic, "exchange", lambda a, b: False)
                real = Path.rename

                def rename(self, dest, real=real):
                    if Path(dest) == out and self.name.startswith(".export.tmp-"):
                        raise OSError(28, "No space left on device")
                    return real(self, dest)

                m.setattr(Path, "rename", rename)
            else:
                m.setattr(target, name, fail)
            with pytest.raises(ExportError) as e:
                export_selection(b, out, tmp_path / "b" / "data" / "raw", overwrite=True)
        assert str(e.value).startswith(
            f"writing the export to --out {out} failed ([Errno 28] No space left on device"
        )
        assert str(e.value).endswith(
            "; the folder is as it was. Free space or fix the cause, then export again, or "
            "choose another --out"
        )
        assert _snapshot(out) == before, name
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    _assert_reads_back(out, manifests_a, tmp_path / "cache")


def test_manifests_gone_or_edited_and_tables_out_of_step_are_refused(tmp_path):
    source, _ = _hand_made(tmp_path)
    raw_dir = tmp_path / "data" / "raw"
    rank_1 = Path(source.manifest_paths[1])
    saved = rank_1.read_text()
    edited = json.loads(saved)
    edited["sample_ids"] = edited["sample_ids"][::-1]
    rank_1.write_text(json.dumps(edited))
    with pytest.raises(ExportError) as e:
        export_selection(source, tmp_path / "x", raw_dir)
    reordered = content_sha256(edited["sample_ids"], edited["weight"])
    assert str(e.value) == (
        f"{rank_1}: content hash mismatch (stored sha256 {edited['sha256'][:12]}, content "
        f"{reordered[:12]}); the manifest was modified after shard_manifests wrote it; "
        "materialize shard_manifests again"
    )
    rank_1.unlink()
    with pytest.raises(ExportError) as e:
        export_selection(source, tmp_path / "x", raw_dir)
    assert str(e.value) == (
        f"the shard manifest of rank 1 of dataset 'hand', {rank_1}, is gone; materialize "
        "shard_manifests again"
    )
    rank_1.write_text(saved)
    raw = source.tables["raw_instructions"]
    fewer = write_table(raw.read().slice(1), raw.uri)
    first = raw.read()["sample_id"][0]
    stale = ExportSource(
        **{**source.__dict__, "tables": {**source.tables, "raw_instructions": fewer}}
    )
    with pytest.raises(ExportError) as e:
        export_selection(stale, tmp_path / "x", raw_dir)
    assert str(e.value) == (
        f"1 sample(s) of the shard manifests (e.g. {first!r}) are not in raw_instructions "
        f"{raw.uri} v1; materialize the selection chain again"
    )
    assert not (tmp_path / "x").exists()


# --- The cheap chain, materialized once, exported from the command line -----------------------

CARD = "---\nlicense: cc-by-4.0\npretty_name: tiny\n---\n# tiny\n\nArithmetic and reversed words.\n"


@pytest.fixture(scope="module")
def selected(tmp_path_factory, tiny_model_dir, tiny_embedding_cache) -> Path:
    """A project folder (``data/``, a Dagster instance in ``home/``) where ``raw_instructions ->
    shard_manifests`` and ``sample_lineage`` ran on the 60-sample dataset ``tiny``, whose folder
    has a card declaring its license."""
    from cluster_pipeline.defs.assets.sample_lineage import sample_lineage
    from cluster_pipeline.defs.partitions import DATASETS
    from cluster_pipeline_tests.helpers import (
        materialize_partition,
        pipeline_assets,
        resources,
        seed_embeddings,
    )

    root = tmp_path_factory.mktemp("selected")
    data = root / "data"
    write_jsonl(data / "raw" / "tiny" / "samples.jsonl", tiny_records(60))
    seed_embeddings(tiny_embedding_cache, data)
    (data / "raw" / "tiny" / "README.md").write_text(CARD)
    (root / "home").mkdir()
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        instance.add_dynamic_partitions(DATASETS, ["tiny"])
        chain = [*pipeline_assets()[:5], sample_lineage]
        assert materialize_partition(chain, instance, resources(data, tiny_model_dir)).success
    return root


def _export(root: Path, *args: str, home: Path | None = None, monkeypatch, capsys) -> str:
    """``cluster-pipeline export ... --data-dir <root>/data``: its output (stdout, or stderr
    when it exits with status 2)."""
    from cluster_pipeline.cli.main import main

    monkeypatch.setenv("DAGSTER_HOME", str(home or root / "home"))
    try:
        main(["export", *args, "--data-dir", str(root / "data")])
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err
    return capsys.readouterr().out


def _records(root: Path) -> dict[str, dict]:
    from cluster_pipeline_tests.helpers import meta

    stages = ["raw_instructions", "peripheral_subsets", "balanced_clusters", "proxy_embeddings"]
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        return {s: meta(instance, s) for s in [*stages, "shard_manifests", "sample_lineage"]}


@pytest.mark.slow
def test_the_export_reads_back_equal_to_the_shard_manifests(
    selected, tiny_model_dir, monkeypatch, capsys, tmp_path
):
    records = _records(selected)
    shards = records["shard_manifests"]
    manifests = [ShardManifest.read(Path(p)) for p in shards["manifest_paths"]]
    printed = _export(selected, "tiny", monkeypatch=monkeypatch, capsys=capsys)
    out = selected / "data" / "exports" / "tiny"
    sizes = [m.n_samples for m in manifests]
    assert printed == (
        f"exported to {out}: train {sum(sizes)}, rank_0 {sizes[0]}, rank_1 {sizes[1]} rows; "
        f"manifest set {shards['manifest_set_sha256'][:12]}; license: cc-by-4.0\n"
    )
    # The manifests as the Delta table holds them, at the version the record names.
    table = pl.read_delta(str(shards["table_uri"]), version=int(shards["table_version"]))
    for m in manifests:
        rows = table.filter(pl.col("rank") == m.rank).sort("position")
        assert rows["sample_id"].to_list() == list(m.sample_ids)
        assert set(rows["weight"]) == {m.weight}
    header = _assert_reads_back(out, manifests, tmp_path / "cache")
    assert header["license"] == "cc-by-4.0"

    # Source file and line equal raw_instructions', and the line holds the sample.
    raw_meta = records["raw_instructions"]
    raw = pl.read_delta(str(raw_meta["table_uri"]), version=int(raw_meta["table_version"]))
    by_id = {r["sample_id"]: r for r in raw.iter_rows(named=True)}
    train = datasets.load_from_disk(str(out / "dataset_dict"))["train"].to_list()
    folder = selected / "data" / "raw" / "tiny"
    for row in train:
        stored = by_id[row["sample_id"]]
        for column in ("source_line", "prompt", "response"):
            assert row[column] == stored[column]
        # The source file relative to the dataset's folder (stored: the path read).
        assert folder / row["source_file"] == Path(stored["source_file"])
        assert _source_line(row, folder)["output"] == row["response"]
        assert row["messages"] == [
            {"role": "user", "content": stored["prompt"]},
            {"role": "assistant", "content": stored["response"]},
        ]
    # The card and the license file are not samples.
    assert raw_meta["records_read"] == 60 and raw_meta["files_not_read"] == []

    _, body = _card(out)
    subsets, clusters = records["peripheral_subsets"], records["balanced_clusters"]
    weights = ", ".join(f"{w:.4f}" for w in subsets["cluster_weights"])
    # The product's default balance is by tokens: the label gives that formula, not n_c K / N.
    assert subsets["balance"] == "tokens"
    from cluster_pipeline.storage.provenance import file_sha256, rows_sha256

    # The content hash of a table version, computed here from the version's rows.
    shard_rows = pl.read_delta(str(shards["table_uri"]), version=int(shards["table_version"]))
    shards_sha = rows_sha256(shard_rows, shard_rows.columns)
    weights_sha = {
        p.name: file_sha256(p) for p in tiny_model_dir.iterdir() if p.suffix == ".safetensors"
    }
    (weights_file, weights_hash), *_ = weights_sha.items()
    embed, raw_config = records["proxy_embeddings"], raw_meta["config"]
    for line in (
        f"| selector | `{subsets['selector']}` |",
        f"| ratio r | {subsets['ratio']:g} |",
        f"| K (clusters = data-parallel ranks) | {clusters['num_clusters']} |",
        f"| cluster weights w_c = K R_c / R (R_c: the cluster's response tokens) | {weights} |",
        # The base model: a local folder, named by its weights' hashes, not its path.
        f"`{tiny_model_dir.name}` (a local folder): `{weights_file}` sha256 `{weights_hash}`",
        f"| raw_instructions | {raw_meta['table_version']} | `",
        f"| shard_manifests | {shards['table_version']} | `{shards_sha}` |",
        f"| sample_lineage | {records['sample_lineage']['table_version']} | - |",
        *(f"| {m.weight:.4f} | `{m.sha256}` |" for m in manifests),
        "`cc-by-4.0`, as declared by the front matter of data/raw/tiny/README.md.",
        # The source file by its hash, and the pool's draw with its settings.
        f"| `samples.jsonl` | `{file_sha256(folder / 'samples.jsonl')}` |",
        f"`heldout_fraction: {raw_config['heldout_fraction']}`",
        f"60 records read, 0 duplicates dropped; a held-out split of "
        f"{raw_meta['heldout_samples']} samples",
        # Every stage's settings as its config recorded them, what it did, the code.
        f"| `max_length` | `{embed['config']['max_length']}` |",
        f"| `truncation` | `{embed['config']['truncation']}` |",
        "| samples cut by truncation (by where) | "
        + (f"`{json.dumps(embed['truncated'])}` |" if embed["truncated"] else "none |"),
        f"| `restarts` | `{clusters['config']['restarts']}` |",
        f"| `niter` | `{clusters['config']['niter']}` |",
        f"| k-means inertia (best restart) | `{clusters['kmeans_inertia']}` |",
        f"git commit {raw_meta['code']['git_commit']}",
    ):
        assert line in body, line
    # The run config of the five stages, as each recorded its config.
    config = yaml.safe_load(body.split("```yaml\n", 1)[1].split("```", 1)[0])
    stages = ["raw_instructions", "proxy_embeddings", "balanced_clusters"]
    stages += ["peripheral_subsets", "shard_manifests"]
    # (peripheral_subsets with the knobs its selector reads: the run checks refuse others.)
    assert config == {
        "ops": {s: {"config": repeatable_config(s, records[s]["config"])} for s in stages}
    }
    assert config["ops"]["peripheral_subsets"]["config"] == {
        k: records["peripheral_subsets"]["config"][k]
        for k in ("balance", "ratio", "seed", "selector")
    }
    # Nothing of this machine in what is published.
    infos = datasets.load_from_disk(str(out / "dataset_dict"))
    published = [(out / "README.md").read_text()]
    published += [f"{d.info.description}{d.info.citation}{d.info.license}" for d in infos.values()]
    for text in published:
        for path in (str(selected), str(tmp_path), str(tiny_model_dir), str(Path.home())):
            assert path not in text

    # The source changes under the export (two records first: every line moves down two) and
    # raw_instructions runs again; the export still reads the version the manifests came from.
    from cluster_pipeline.defs.assets.raw_instructions import raw_instructions
    from cluster_pipeline.defs.resources import StorageResource
    from cluster_pipeline_tests.helpers import materialize_partition

    more = tiny_records(62)
    write_jsonl(selected / "data" / "raw" / "tiny" / "samples.jsonl", more[60:] + more[:60])
    res = {"storage": StorageResource(data_dir=str(selected / "data"))}
    with dg.DagsterInstance.from_config(str(selected / "home")) as instance:
        assert materialize_partition([raw_instructions], instance, res).success
    again = selected / "again"
    _export(selected, "tiny", "--out", str(again), monkeypatch=monkeypatch, capsys=capsys)
    assert datasets.load_from_disk(str(again / "dataset_dict"))["train"].to_list() == train
    assert "| raw_instructions | 0 | `" in _card(again)[1]
    assert int(_records(selected)["raw_instructions"]["table_version"]) == 1


@pytest.mark.slow
def test_export_errors_name_what_to_do(selected, monkeypatch, capsys, tmp_path):
    def export(*args: str, home: Path | None = None) -> str:
        return _export(selected, *args, home=home, monkeypatch=monkeypatch, capsys=capsys)

    home = selected / "home"
    first = (
        "cluster-pipeline export: error: dataset {name!r} has no shard manifests to export: {why}. "
        "Materialize selection_job (raw_instructions -> shard_manifests) for partition {name!r} "
        "first: web UI Jobs -> selection_job, or `make run DATASET={name}` (main_job runs it "
        "too)\n"
    )
    error = "cluster-pipeline export: error: "
    nodata = selected / "nowhere" / "data"
    nowhere = _export(nodata.parent, "tiny", home=home, monkeypatch=monkeypatch, capsys=capsys)
    assert nowhere == (
        f"{error}--data-dir {nodata} is not a folder: give the data folder the pipeline wrote "
        f"(default {default_data_dir()}, or $CLUSTER_PIPELINE_DATA_DIR)\n"
    )
    assert export("nosuch") == (
        f"{error}dataset 'nosuch' is not registered in the Dagster instance at {home} "
        "(registered: tiny); check the name (`cluster-pipeline datasets` lists the datasets "
        "found, `cluster-pipeline datasets sync` registers them)\n"
    )
    assert export("") == (
        f"{error}the dataset name is empty; give a dataset registered in the Dagster instance at "
        f"{home} (registered: tiny)\n"
    )
    (selected / "data" / "raw" / "newset").mkdir()
    assert export("newset") == (
        f"{error}dataset 'newset' is not registered in the Dagster instance at {home} "
        f"(registered: tiny); its folder {selected / 'data' / 'raw' / 'newset'} exists: "
        "`cluster-pipeline datasets sync` registers it, then materialize selection_job for it\n"
    )
    (selected / "data" / "raw" / "newset").rmdir()
    table = selected / "data" / "tables" / "shard_manifests" / "tiny"
    other = tmp_path / "other_home"
    other.mkdir()
    assert export("tiny", home=other) == (
        f"{error}dataset 'tiny' is not registered in the Dagster instance at {other} (none is "
        f"registered); its table {table} exists: set DAGSTER_HOME to the Dagster instance that "
        "made it\n"
    )
    assert export("tiny", home=tmp_path / "gone") == first.format(
        name="tiny", why=f"there is no Dagster instance at {tmp_path / 'gone'}"
    )
    assert export("", home=tmp_path / "gone") == (
        f"{error}the dataset name is empty, and there is no Dagster instance at "
        f"{tmp_path / 'gone'}, so no dataset is registered: `cluster-pipeline datasets sync` "
        "registers the datasets under data/raw/\n"
    )
    assert export("tiny", "--out", "/proc/nope") == (
        f"{error}--out /proc/nope cannot be created: its parent folder /proc cannot be written "
        "(No such file or directory); choose a folder you can write with --out\n"
    )

    # The default folder, data/exports/tiny, exported twice: the user's files there stay and
    # make the second export refuse.
    default = selected / "data" / "exports" / "tiny"
    shutil.rmtree(default, ignore_errors=True)  # an earlier test's export
    assert export("tiny").startswith(f"exported to {default}: ")
    (default / "MY_NOTES.txt").write_text("n\n")
    (default / "mywork").mkdir()
    (default / "mywork" / "train.py").write_text("x\n")
    for flags in ((), ("--overwrite",)):
        assert export("tiny", *flags) == (
            f"{error}--out {default} holds an export, and besides it 2 path(s) the export did "
            f"not write: MY_NOTES.txt, mywork/. Nothing but the export's own files is replaced, "
            f"with or without --overwrite: move those out of {default} (or delete them), or "
            "choose another folder with --out\n"
        )
    assert (default / "mywork" / "train.py").read_text() == "x\n"
    (default / "MY_NOTES.txt").unlink()
    shutil.rmtree(default / "mywork")
    assert export("tiny").startswith(f"replaced the export in {default}: ")

    out = tmp_path / "export"
    assert export("tiny", "--out", str(out)).startswith(f"exported to {out}: ")
    assert export("tiny", "--out", str(out)).startswith(f"replaced the export in {out}: ")
    identity = json.loads((out / "export.json").read_text())
    mine = identity["manifest_set_sha256"]
    (out / "export.json").write_text(json.dumps({**identity, "manifest_set_sha256": "0" * 64}))
    assert export("tiny", "--out", str(out)) == (
        f"cluster-pipeline export: error: {out} holds another export (dataset 'tiny', manifest "
        f"set 000000000000), not dataset 'tiny' manifest set {mine[:12]}; pass --overwrite to "
        "replace it, or --out another folder\n"
    )
    assert export("tiny", "--out", str(out), "--overwrite").startswith(
        f"replaced the export in {out}: "
    )
    assert json.loads((out / "export.json").read_text())["manifest_set_sha256"] == mine
