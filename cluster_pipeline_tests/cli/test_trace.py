"""``cluster-pipeline lineage``: every table read at the version the latest shard manifests were
built from, whatever was re-run since; a newer version is named, never joined (trial defects 4
and 11). Tables are written by hand, as the stages write them (``write_table`` with the input
versions each stage records); the stages themselves record them in test_lineage_versions.py."""

import json
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.cli.main import main
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.lineage import build_lineage, read_lineage_tables
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)
from cluster_pipeline.storage.tables import TableRef, table_inputs, write_table

IDS = ["a", "b", "c", "d"]


def _raw(ids: list[str]) -> pl.DataFrame:
    # One one-line JSON array: every record on line 1, told apart by source_index.
    return pl.DataFrame(
        {
            "sample_id": ids,
            "split": ["train"] * len(ids),
            "source_file": ["d.json"] * len(ids),
            "source_line": [1] * len(ids),
            "source_index": list(range(len(ids))),
        }
    )


def _clusters(labels: list[int]) -> pl.DataFrame:
    return pl.DataFrame({"sample_id": IDS, "cluster": labels, "sq_distance": [0.1, 0.2, 0.3, 0.4]})


def _subsets(selected: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "sample_id": IDS,
            "selection_rank": [0, 1, 0, 1],
            "selected": [s in selected for s in IDS],
            "copies": [int(s in selected) for s in IDS],
            "weight": [1.0] * 4,
        }
    )


def _shards(ids: list[str], hashes: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "rank": [0, 1],
            "position": [0, 0],
            "sample_id": ids,
            "weight": [1.0, 1.0],
            "manifest_sha256": hashes,
        }
    )


class Chain:
    """A dataset's tables written stage by stage, each recording the versions it read."""

    def __init__(self, data: Path, dataset: str, pin: bool = True):
        self.layout, self.dataset, self.pin = DataLayout.at(data), dataset, pin
        self.refs: dict[str, TableRef] = {}

    def write(self, stage: str, frame: pl.DataFrame, upstream: list[str]) -> TableRef:
        inputs = {s: self.refs[s] for s in upstream} if self.pin else None
        ref = write_table(frame, self.layout.table_uri(stage, self.dataset), inputs=inputs)
        self.refs[stage] = ref
        return ref

    def build(self) -> None:
        embeddings = pl.DataFrame(
            {
                "sample_id": IDS,
                "n_response_tokens": [5, 6, 7, 8],
                "mean_loss": [1.0, 2.0, 3.0, 4.0],
                "skip_reason": [None] * 4,
            },
            schema_overrides={"skip_reason": pl.String},
        )
        self.write(RAW_INSTRUCTIONS, _raw(IDS), [])
        self.write(PROXY_EMBEDDINGS, embeddings, [RAW_INSTRUCTIONS])
        self.write(BALANCED_CLUSTERS, _clusters([0, 0, 1, 1]), [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS])
        chain = [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS, BALANCED_CLUSTERS]
        self.write(PERIPHERAL_SUBSETS, _subsets(["a", "c"]), chain)
        self.write(SHARD_MANIFESTS, _shards(["a", "c"], ["h0", "h1"]), [*chain, PERIPHERAL_SUBSETS])


def _checkpoint(data: Path, dataset: str, name: str, hashes: list[str]) -> str:
    """A finished checkpoint as the catalogue reads it: a folder whose training_info.json names
    the manifests it was trained on (the weights play no part in the lineage)."""
    folder = DataLayout.at(data).checkpoints_dir(dataset) / name
    folder.mkdir(parents=True)
    info = {"manifests": [{"sha256": h, "path": f"rank_{i}.json"} for i, h in enumerate(hashes)]}
    (folder / "training_info.json").write_text(json.dumps(info))
    return str(folder)


def _lineage(data: Path, capsys, *args: str) -> tuple[int, list[dict], str]:
    """(exit status, JSON rows printed, stderr) of ``cluster-pipeline lineage ... --json``."""
    try:
        main(["lineage", *args, "--data-dir", str(data), "--json"])
        status = 0
    except SystemExit as e:
        status = int(e.code or 0)
    out = capsys.readouterr()
    return status, [json.loads(line) for line in out.out.splitlines()], out.err


PINNED = (
    "# tables: raw_instructions v0, proxy_embeddings v0, balanced_clusters v0, "
    "peripheral_subsets v{s}, shard_manifests v{m}: the versions shard_manifests v{m} was "
    "built from\n"
)


def test_each_stage_rerun_after_the_manifests_is_named_and_not_joined(tmp_path, capsys):
    data = tmp_path / "data"
    chain = Chain(data, "ds")
    chain.build()
    assert table_inputs(chain.refs[SHARD_MANIFESTS].uri, 0) == {
        RAW_INSTRUCTIONS: 0,
        PROXY_EMBEDDINGS: 0,
        BALANCED_CLUSTERS: 0,
        PERIPHERAL_SUBSETS: 0,
    }
    trained = _checkpoint(data, "ds", "ckpt_v0", ["h0", "h1"])
    status, rows, err = _lineage(data, capsys, "ds", "--selected")
    assert status == 0 and err == PINNED.format(s=0, m=0)
    assert [(r["sample_id"], r["selected"], r["rank"], r["checkpoints"]) for r in rows] == [
        ("a", True, 0, [trained]),
        ("c", True, 1, [trained]),
    ]

    # peripheral_subsets re-run (b and d selected now), shard_manifests not: the rows stay v0's.
    chain.write(
        PERIPHERAL_SUBSETS,
        _subsets(["b", "d"]),
        [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS, BALANCED_CLUSTERS],
    )
    status, rows, err = _lineage(data, capsys, "ds", "--selected")
    assert [(r["sample_id"], r["selected"], r["rank"]) for r in rows] == [
        ("a", True, 0),
        ("c", True, 1),
    ]
    assert err == PINNED.format(s=0, m=0) + (
        "# peripheral_subsets v1 is newer than the v0 shard_manifests v0 was built from: "
        "selection_rank, selected, copies, weight below are from v0; materialize the stages "
        "after peripheral_subsets again (selection_job runs them) to trace v1\n"
    )
    # No row contradicts itself: selected exactly where a shard holds the sample.
    frame = build_lineage(read_lineage_tables(DataLayout.at(data), "ds").frames, {})
    assert frame.filter(pl.col("selected") != pl.col("rank").is_not_null()).height == 0

    # shard_manifests re-run from subsets v1: the checkpoint was trained on the older set.
    chain.write(
        SHARD_MANIFESTS,
        _shards(["b", "d"], ["h2", "h3"]),
        [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS, BALANCED_CLUSTERS, PERIPHERAL_SUBSETS],
    )
    status, rows, err = _lineage(data, capsys, "ds", "--selected")
    assert [(r["sample_id"], r["rank"], r["checkpoints"]) for r in rows] == [
        ("b", 0, None),
        ("d", 1, None),
    ]
    assert err == PINNED.format(s=1, m=1) + (
        "# 1 checkpoint(s) trained on other shard manifests than these, not in the checkpoints "
        f"column: {trained}\n"
    )

    # balanced_clusters re-run (labels swapped): cluster below is still v0's.
    chain.write(BALANCED_CLUSTERS, _clusters([1, 1, 0, 0]), [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS])
    status, rows, err = _lineage(data, capsys, "ds", "b")
    assert status == 0 and rows[0]["cluster"] == 0 and rows[0]["sq_distance"] == 0.2
    assert (
        "# balanced_clusters v1 is newer than the v0 shard_manifests v1 was built from: "
        "cluster, sq_distance below are from v0; materialize the stages after "
        "balanced_clusters again (selection_job runs them) to trace v1\n"
    ) in err

    # raw_instructions re-run with a new sample: the rows are v0's; the new id is named apart.
    chain.write(RAW_INSTRUCTIONS, _raw([*IDS, "e"]), [])
    status, rows, err = _lineage(data, capsys, "ds", "e")
    assert status == 2 and rows == []
    assert err == (
        "cluster-pipeline lineage: error: sample_id(s) not in dataset 'ds': e (e only in "
        "raw_instructions v1, newer than the v0 the latest tables were built from: materialize "
        "the stages after raw_instructions again, e.g. selection_job, to trace them)\n"
    )
    status, rows, err = _lineage(data, capsys, "ds", "d")
    assert status == 0 and (rows[0]["source_line"], rows[0]["source_index"]) == (1, 3)
    assert err.startswith(PINNED.format(s=1, m=1))
    assert (
        "# raw_instructions v1 is newer than the v0 shard_manifests v1 was built from: the "
        "rows (which samples), split, source_file, source_line, source_index below are from v0"
    ) in err


def test_tables_that_recorded_no_inputs_are_read_at_their_latest_and_say_so(tmp_path, capsys):
    data = tmp_path / "data"
    Chain(data, "old", pin=False).build()
    status, rows, err = _lineage(data, capsys, "old", "--selected")
    assert status == 0 and [r["sample_id"] for r in rows] == ["a", "c"]
    assert err == (
        "# tables: raw_instructions v0, proxy_embeddings v0, balanced_clusters v0, "
        "peripheral_subsets v0, shard_manifests v0, each its latest: shard_manifests v0 "
        "recorded no input versions (an older pipeline wrote it), so these may not be the "
        "versions it was built from; materialize shard_manifests again to pin them\n"
    )


def test_selected_where_nothing_was_selected_is_an_error_like_the_other_not_found(tmp_path, capsys):
    data = tmp_path / "data"
    write_table(_raw(IDS), DataLayout.at(data).table_uri(RAW_INSTRUCTIONS, "fresh"))
    status, rows, err = _lineage(data, capsys, "fresh", "--selected")
    assert (status, rows) == (2, [])
    assert err == (
        "cluster-pipeline lineage: error: nothing selected yet in dataset 'fresh' (no "
        "peripheral_subsets table): run selection_job for partition 'fresh' (web UI Jobs -> "
        "selection_job, or `make run DATASET=fresh`)\n"
    )
    # A sample of it is traced as far as it went (raw_instructions only).
    status, rows, err = _lineage(data, capsys, "fresh", "b")
    assert status == 0 and (rows[0]["source_index"], rows[0]["cluster"]) == (1, None)
    assert err == "# tables: raw_instructions v0; no stage after it materialized yet\n"
    status, rows, err = _lineage(data, capsys, "nosuch", "--selected")
    assert status == 2 and "dataset 'nosuch' has no tables under" in err


@pytest.mark.parametrize("gone", ["version", "files"])
def test_a_pinned_version_that_is_gone_is_named(tmp_path, capsys, gone):
    data = tmp_path / "data"
    chain = Chain(data, "ds")
    chain.build()
    uri = Path(chain.refs[PERIPHERAL_SUBSETS].uri)
    if gone == "files":
        for f in uri.glob("*.parquet"):
            f.unlink()
        expected = f"peripheral_subsets table {uri} v0 lists data files that are gone"
    else:
        # A version past the table's last (the table was deleted and written anew).
        chain.refs[PERIPHERAL_SUBSETS] = TableRef(str(uri), 5)
        chain.write(
            SHARD_MANIFESTS,
            _shards(["a", "c"], ["h0", "h1"]),
            [RAW_INSTRUCTIONS, PROXY_EMBEDDINGS, BALANCED_CLUSTERS, PERIPHERAL_SUBSETS],
        )
        expected = (
            f"peripheral_subsets table {uri} has no version 5, which shard_manifests v1 was "
            "built from (the table was deleted or rewritten); re-materialize the selection "
            "chain for 'ds'"
        )
    status, _, err = _lineage(data, capsys, "ds", "a")
    assert status == 2 and expected in err and "Traceback" not in err
