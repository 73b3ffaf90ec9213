"""Trace samples from the shell, from their source line to the checkpoints trained on them.

    python -m cluster_pipeline.lineage <dataset> <sample_id> [<sample_id> ...]
    python -m cluster_pipeline.lineage <dataset> --selected          # every selected sample
    python -m cluster_pipeline.lineage <dataset> --diff OLD NEW       # subset versions compared

Reads the latest version of each stage's Delta table under ``data/tables/`` (or
``--data-dir``); ``--diff`` compares two versions of the ``peripheral_subsets`` table (Delta time
travel) and lists the samples that entered and left the subset. ``--json`` prints JSON lines.
"""

import argparse
import json
import signal
import sys
from pathlib import Path

import polars as pl
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cluster_pipeline.core.lineage import build_lineage, checkpoints_by_manifest, subset_diff
from cluster_pipeline.defs.resources import default_data_dir

STAGES = ("raw_instructions", "proxy_embeddings", "balanced_clusters", "peripheral_subsets",
          "shard_manifests")


def _uri(data_dir: Path, asset: str, dataset: str) -> str:
    return str(data_dir / "tables" / asset / dataset)


def _latest(data_dir: Path, asset: str, dataset: str) -> pl.DataFrame | None:
    try:
        return pl.read_delta(_uri(data_dir, asset, dataset))
    except (TableNotFoundError, FileNotFoundError, OSError):
        return None


def _version(data_dir: Path, asset: str, dataset: str) -> str:
    try:
        return str(DeltaTable(_uri(data_dir, asset, dataset)).version())
    except (TableNotFoundError, OSError):
        return "-"


def lineage_frame(data_dir: Path, dataset: str) -> pl.DataFrame:
    """The lineage table built from the latest version of every stage's table.

    Raises:
        SystemExit: the dataset's ``raw_instructions`` table does not exist.
    """
    tables = {s: _latest(data_dir, s, dataset) for s in STAGES}
    if tables["raw_instructions"] is None:
        known = sorted(p.name for p in (data_dir / "tables" / "raw_instructions").glob("*"))
        sys.exit(f"dataset {dataset!r} has no tables under {data_dir / 'tables'}: it does not "
                 f"exist or was never materialized. Datasets with tables: "
                 f"{', '.join(known) or 'none'}")
    return build_lineage(*(tables[s] for s in STAGES),
                         checkpoints_by_manifest(data_dir / "checkpoints" / dataset))


def main(argv: list[str] | None = None) -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the listing quietly
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("sample_ids", nargs="*", metavar="sample_id")
    parser.add_argument("--selected", action="store_true", help="every selected sample")
    parser.add_argument("--diff", nargs=2, type=int, metavar=("OLD", "NEW"),
                        help="compare two versions of the peripheral_subsets table")
    parser.add_argument("--data-dir", type=Path, default=Path(default_data_dir()))
    parser.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    args = parser.parse_args(argv)

    if args.diff:
        uri = _uri(args.data_dir, "peripheral_subsets", args.dataset)
        try:
            latest = DeltaTable(uri).version()
        except TableNotFoundError:
            sys.exit(f"no peripheral_subsets table for dataset {args.dataset!r} at {uri}")
        for v in args.diff:
            if not 0 <= v <= latest:
                sys.exit(f"peripheral_subsets of {args.dataset!r} has versions 0..{latest}, not {v}")
        old, new = (pl.read_delta(uri, version=v) for v in args.diff)
        diff = subset_diff(old, new)
        print(json.dumps({"dataset": args.dataset, "old": args.diff[0], "new": args.diff[1],
                          **diff}) if args.json else
              f"v{args.diff[0]} -> v{args.diff[1]}: {len(diff['entered'])} entered, "
              f"{len(diff['left'])} left\nentered: {' '.join(diff['entered'])}\n"
              f"left: {' '.join(diff['left'])}")
        return
    if not args.sample_ids and not args.selected:
        parser.error("give sample_id(s), --selected or --diff OLD NEW")
    frame = lineage_frame(args.data_dir, args.dataset)
    if args.selected:
        rows = frame.filter(pl.col("selected").fill_null(False))
    else:
        rows = frame.filter(pl.col("sample_id").is_in(args.sample_ids))
        missing = sorted(set(args.sample_ids) - set(rows["sample_id"]))
        if missing:
            sys.exit(f"sample_id(s) not in dataset {args.dataset!r}: {', '.join(missing)}")
    if args.json:
        for row in rows.iter_rows(named=True):
            print(json.dumps(row, default=str))
        return
    # Each stage is read at its latest version; after re-running only some stages, the view
    # mixes versions, so say which.
    versions = ", ".join(f"{s} v{_version(args.data_dir, s, args.dataset)}" for s in STAGES)
    print(f"# latest tables: {versions}\n")
    for row in rows.iter_rows(named=True):
        print("\n".join(f"{k:>18}: {v}" for k, v in row.items()))
        print()


if __name__ == "__main__":
    main()
