"""Print where a dataset's evaluation report is: the ``eval_report.md`` that ``eval_report`` wrote.

    cluster-pipeline report <dataset> [--data-dir DIR]

``make run`` and ``make compare`` end with it. The report lies in the data folder
(``$CLUSTER_PIPELINE_DATA_DIR``, else ``<project>/data``) under ``reports/<dataset>/``, beside
its JSON and figures. Prints ``report: <path>`` (relative to the current folder when it lies
under it); exits with status 2, saying what to run, when there is no report yet.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cluster_pipeline.cli import UserError, make_run
from cluster_pipeline.storage.layout import DataLayout, default_data_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``report`` arguments: the dataset and the data folder."""
    parser.add_argument("dataset", help="the dataset partition, e.g. python_stdlib")
    parser.add_argument("--data-dir", default=default_data_dir())


def report_path(data_dir: str | Path, dataset: str) -> Path:
    """``<data_dir>/reports/<dataset's folder name>/eval_report.md`` (absolute), where
    ``eval_report`` writes the report of ``dataset``."""
    return DataLayout.at(data_dir).reports_dir(dataset) / "eval_report.md"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print ``report: <path>`` of ``args.dataset``'s report.

    Raises:
        UserError: no report there yet (the message says how to make one).
    """
    path = report_path(args.data_dir, args.dataset)
    if not path.is_file():
        from cluster_pipeline.data.datasets import discover_datasets

        found = discover_datasets(DataLayout.at(args.data_dir).raw_dir)
        if args.dataset not in found:  # no `make run` would make one
            raise UserError(
                f"no dataset {args.dataset!r}: no report at {path}, and no folder of its data "
                f"under {DataLayout.at(args.data_dir).raw_dir}. Datasets found: "
                f"{', '.join(found) or 'none'}."
            )
        raise UserError(
            f"no report of dataset {args.dataset!r} at {path} yet: materialize eval_report "
            f"(`{make_run(args.dataset)}`, or the web UI's main_job)"
        )
    shown = os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    print(f"report: {shown}")
