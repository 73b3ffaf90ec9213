"""Trace samples from their source line to the checkpoints trained on them.

    cluster-pipeline lineage <dataset> <sample_id> [<sample_id> ...]
    cluster-pipeline lineage <dataset> --selected          # every selected sample
    cluster-pipeline lineage <dataset> --diff OLD NEW       # subset versions compared

Reads the latest version of each stage's Delta table under ``data/tables/`` (or
``--data-dir``); ``--diff`` compares two versions of the ``peripheral_subsets`` table (Delta time
travel) and lists the samples that entered and left the subset. ``--json`` prints JSON lines.
"""

import argparse
import json
from pathlib import Path

import polars as pl
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cluster_pipeline.cli import UserError
from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.storage.lineage import build_lineage, latest_tables, subset_diff
from cluster_pipeline.storage.names import PERIPHERAL_SUBSETS, RAW_INSTRUCTIONS
from cluster_pipeline.training.checkpointing import checkpoints_by_manifest, list_checkpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``lineage`` arguments: the dataset, sample ids or ``--selected``, or ``--diff``."""
    parser.add_argument("dataset")
    parser.add_argument("sample_ids", nargs="*", metavar="sample_id")
    parser.add_argument("--selected", action="store_true", help="every selected sample")
    parser.add_argument(
        "--diff",
        nargs=2,
        type=int,
        metavar=("OLD", "NEW"),
        help="compare two versions of the peripheral_subsets table",
    )
    parser.add_argument("--data-dir", type=Path, default=Path(default_data_dir()))
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")


def _diff(layout: DataLayout, dataset: str, old: int, new: int, as_json: bool) -> None:
    uri = layout.table_uri(PERIPHERAL_SUBSETS, dataset)
    try:
        latest = DeltaTable(uri).version()
    except TableNotFoundError:
        raise UserError(f"no peripheral_subsets table for dataset {dataset!r} at {uri}") from None
    for v in (old, new):
        if not 0 <= v <= latest:
            raise UserError(f"peripheral_subsets of {dataset!r} has versions 0..{latest}, not {v}")
    diff = subset_diff(pl.read_delta(uri, version=old), pl.read_delta(uri, version=new))
    print(
        json.dumps({"dataset": dataset, "old": old, "new": new, **diff})
        if as_json
        else f"v{old} -> v{new}: {len(diff['entered'])} entered, {len(diff['left'])} left\n"
        f"entered: {' '.join(diff['entered'])}\nleft: {' '.join(diff['left'])}"
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print the lineage of samples (or the subset difference of two versions), from the latest
    version of each table."""
    layout = DataLayout.at(args.data_dir)
    if args.diff:
        old, new = args.diff
        _diff(layout, args.dataset, old, new, args.json)
        return
    if not args.sample_ids and not args.selected:
        parser.error("give sample_id(s), --selected or --diff OLD NEW")
    tables = latest_tables(layout, args.dataset)
    if tables.get(RAW_INSTRUCTIONS) is None:
        raise UserError(
            f"dataset {args.dataset!r} has no tables under {layout.root / 'tables'}: it "
            "does not exist or was never materialized. Datasets with tables: "
            f"{', '.join(layout.datasets_with_tables()) or 'none'}"
        )
    checkpoints = checkpoints_by_manifest(list_checkpoints(layout.checkpoints_dir(args.dataset)))
    frame = build_lineage({s: t[1] if t else None for s, t in tables.items()}, checkpoints)
    if args.selected:
        rows = frame.filter(pl.col("selected").fill_null(False))
    else:
        rows = frame.filter(pl.col("sample_id").is_in(args.sample_ids))
        missing = sorted(set(args.sample_ids) - set(rows["sample_id"]))
        if missing:
            raise UserError(f"sample_id(s) not in dataset {args.dataset!r}: {', '.join(missing)}")
    if args.json:
        for row in rows.iter_rows(named=True):
            print(json.dumps(row, default=str))
        return
    # Each stage is read at its latest version; after re-running only some stages, the view
    # mixes versions, so say which.
    versions = ", ".join(f"{s} v{t[0] if t else '-'}" for s, t in tables.items())
    print(f"# latest tables: {versions}\n")
    for row in rows.iter_rows(named=True):
        print("\n".join(f"{k:>18}: {v}" for k, v in row.items()))
        print()
