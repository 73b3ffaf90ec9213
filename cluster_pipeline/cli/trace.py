"""Trace samples from their source line to the checkpoints trained on them.

    cluster-pipeline lineage <dataset> <sample_id> [<sample_id> ...]
    cluster-pipeline lineage <dataset> --selected          # every selected sample
    cluster-pipeline lineage <dataset> --diff OLD [NEW]     # subset versions compared

Reads each stage's Delta table under ``data/tables/`` (or ``--data-dir``) at the version the
latest shard manifests were built from, as the ``sample_lineage`` asset does, and says so in a
header; a stage re-run since (a newer version) is named there with the columns it would change.
``--diff`` compares two versions of the ``peripheral_subsets`` table (Delta time travel) and
lists the samples that entered and left the subset; NEW defaults to the latest version (a first
run has only v0: each re-selection, such as ``make compare``'s, adds one). ``--json`` prints
JSON lines (the header goes to stderr).
"""

import argparse
import json
import sys
from pathlib import Path

import polars as pl
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cluster_pipeline.cli import UserError, make_run
from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.storage.lineage import (
    build_lineage,
    checkpoints_elsewhere,
    read_lineage_tables,
    subset_diff,
)
from cluster_pipeline.storage.names import PERIPHERAL_SUBSETS, RAW_INSTRUCTIONS, SHARD_MANIFESTS
from cluster_pipeline.training.checkpointing import checkpoints_by_manifest, list_checkpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lineage`` arguments: the dataset, sample ids or ``--selected``, or ``--diff``."""
    parser.add_argument("dataset")
    parser.add_argument("sample_ids", nargs="*", metavar="sample_id")
    parser.add_argument("--selected", action="store_true", help="every selected sample")
    parser.add_argument(
        "--diff",
        nargs="+",
        type=int,
        metavar="VERSION",
        help="OLD [NEW]: compare two versions of the peripheral_subsets table (NEW: the latest "
        "by default)",
    )
    parser.add_argument("--data-dir", type=Path, default=Path(default_data_dir()))
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")


def _diff(layout: DataLayout, dataset: str, old: int, new: int | None, as_json: bool) -> None:
    uri = layout.table_uri(PERIPHERAL_SUBSETS, dataset)
    try:
        latest = DeltaTable(uri).version()
    except TableNotFoundError:
        raise UserError(f"no peripheral_subsets table for dataset {dataset!r} at {uri}") from None
    new = latest if new is None else new
    versions = f"peripheral_subsets of {dataset!r} has versions 0..{latest}"
    adds = "each selection (a re-run, make compare's selectors) adds one"
    for v in (old, new):
        if not 0 <= v <= latest:
            raise UserError(f"{versions}, not {v}: {adds}")
    diff = subset_diff(pl.read_delta(uri, version=old), pl.read_delta(uri, version=new))
    if as_json:
        print(json.dumps({"dataset": dataset, "old": old, "new": new, **diff}))
        return
    print(
        f"v{old} -> v{new}: {len(diff['entered'])} entered, {len(diff['left'])} left"
        + (f" (the same version: {versions}; {adds})" if old == new else "")
        + f"\nentered: {' '.join(diff['entered'])}\nleft: {' '.join(diff['left'])}"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print the lineage of samples (or the subset difference of two versions), from each
    table at the version the latest shard manifests were built from.

    Raises:
        UserError: the dataset has no tables, a sample id is not in it, or ``--selected`` where
            nothing was selected yet (each exits with status 2, as every "not found" here).
    """
    layout = DataLayout.at(args.data_dir)
    if args.diff:
        if len(args.diff) > 2:
            parser.error(f"--diff takes OLD and at most NEW, not {len(args.diff)} versions")
        _diff(layout, args.dataset, args.diff[0], (args.diff[1:] or [None])[0], args.json)
        return
    if not args.sample_ids and not args.selected:
        parser.error("give sample_id(s), --selected or --diff OLD [NEW]")
    tables = read_lineage_tables(layout, args.dataset)
    raw = tables.frames[RAW_INSTRUCTIONS]
    if raw is None:
        raise UserError(
            f"dataset {args.dataset!r} has no tables under {layout.root / 'tables'}: it "
            "does not exist or was never materialized. Datasets with tables: "
            f"{', '.join(layout.datasets_with_tables()) or 'none'}"
        )
    if args.selected and tables.frames[PERIPHERAL_SUBSETS] is None:
        raise UserError(
            f"nothing selected yet in dataset {args.dataset!r} (no peripheral_subsets table): "
            f"run selection_job for partition {args.dataset!r} (web UI Jobs -> selection_job, "
            f"or `{make_run(args.dataset)}`)"
        )
    checkpoints = checkpoints_by_manifest(list_checkpoints(layout.checkpoints_dir(args.dataset)))
    frame = build_lineage(tables.frames, checkpoints)
    if args.selected:
        rows = frame.filter(pl.col("selected").fill_null(False))
    else:
        rows = frame.filter(pl.col("sample_id").is_in(args.sample_ids))
        missing = sorted(set(args.sample_ids) - set(rows["sample_id"]))
        if missing:
            raise UserError(_not_found(layout, args.dataset, missing, tables.versions))
    notes = tables.notes()
    shards = tables.frames[SHARD_MANIFESTS]
    shown = set(shards["manifest_sha256"]) if shards is not None else set()
    elsewhere = checkpoints_elsewhere(checkpoints, shown)
    if elsewhere:
        notes.append(
            f"{len(elsewhere)} checkpoint(s) trained on other shard manifests than these, not in "
            f"the checkpoints column: {', '.join(elsewhere)}"
        )
    header = "".join(f"# {line}\n" for line in notes)
    if args.json:
        sys.stderr.write(header)
        for row in rows.iter_rows(named=True):
            print(json.dumps(row, default=str))
        return
    print(header)
    for row in rows.iter_rows(named=True):
        print("\n".join(f"{k:>18}: {v}" for k, v in row.items()))
        print()


def _not_found(layout: DataLayout, dataset: str, missing: list[str], versions: dict) -> str:
    """The message for sample ids not in the raw_instructions version read: those a newer
    version holds are named apart (the chain was not re-run on it yet)."""
    read = versions[RAW_INSTRUCTIONS]
    uri = layout.table_uri(RAW_INSTRUCTIONS, dataset)
    latest = DeltaTable(uri).version()
    newer = (
        set(pl.read_delta(uri, version=latest, columns=["sample_id"])["sample_id"]) & set(missing)
        if latest > read
        else set()
    )
    message = f"sample_id(s) not in dataset {dataset!r}: {', '.join(missing)}"
    if newer:
        message += (
            f" ({', '.join(sorted(newer))} only in raw_instructions v{latest}, newer than the "
            f"v{read} the latest tables were built from: materialize the stages after "
            "raw_instructions again, e.g. selection_job, to trace them)"
        )
    return message
