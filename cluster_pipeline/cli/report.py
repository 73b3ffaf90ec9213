"""Print where a dataset's evaluation report is: the ``eval_report.md`` that ``eval_report`` wrote.

    cluster-pipeline report <dataset> [--data-dir DIR]
    cluster-pipeline report <dataset> --failed

``make run`` and ``make compare`` end with it. The report lies in the data folder
(``$CLUSTER_PIPELINE_DATA_DIR``, else ``<project>/data``) under ``reports/<dataset>/``, beside
its JSON and figures. Prints ``report: <path>`` (relative to the current folder when it lies
under it); exits with status 2, saying what to run, when there is no report yet.

``--failed`` is what ``make run`` prints when its run failed: the dataset's latest run in the
Dagster instance `make` uses ($DAGSTER_HOME, else .dagster_home), the step that failed and why,
as the last lines of the output (Dagster's own log puts the cause among stack frames and the
lines of the steps it then skipped), and exits with status 1.
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
    parser.add_argument(
        "--failed",
        action="store_true",
        help="say which step of the dataset's latest run failed and why (make run's last lines)",
    )


def report_path(data_dir: str | Path, dataset: str) -> Path:
    """``<data_dir>/reports/<dataset's folder name>/eval_report.md`` (absolute), where
    ``eval_report`` writes the report of ``dataset``."""
    return DataLayout.at(data_dir).reports_dir(dataset) / "eval_report.md"


def failure_lines(instance, dataset: str) -> list[str]:
    """Why the latest run of partition ``dataset`` in ``instance`` failed: ``run <id> failed
    at step <step>:`` and each failed step's own message (a ``dagster.Failure``'s description,
    else its error's, the innermost cause's where it has one); [] when the latest run did not
    fail or there is none."""
    import dagster as dg
    from dagster._core.events import DagsterEventType

    runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": dataset}), limit=1)
    if not runs or runs[0].status != dg.DagsterRunStatus.FAILURE:
        return []
    run = runs[0]
    out = []
    for record in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_FAILURE):
        event = record.dagster_event
        if event is None or event.step_failure_data is None:
            continue
        data = event.step_failure_data
        if data.user_failure_data is not None and data.user_failure_data.description:
            why = data.user_failure_data.description
        else:
            error = data.error
            while error is not None and error.cause is not None:
                error = error.cause
            why = error.message.strip() if error is not None else "(no message)"
        out.append(f"run {run.run_id[:8]} of dataset {dataset!r} failed at step {event.step_key}:")
        out.append(f"  {why}")
    return out or [f"run {run.run_id[:8]} of dataset {dataset!r} failed before any step ran"]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Print ``report: <path>`` of ``args.dataset``'s report; with ``--failed``, why its
    latest run failed (:func:`failure_lines`), exiting with status 1.

    Raises:
        UserError: no report there yet (the message says how to make one).
    """
    if getattr(args, "failed", False):  # a Namespace made by hand has no --failed
        import sys

        import dagster as dg

        from cluster_pipeline.cli import instance_home

        os.environ["DAGSTER_HOME"] = str(instance_home())
        with dg.DagsterInstance.get() as instance:
            lines = failure_lines(instance, args.dataset)
        print("\n".join(lines or [f"the latest run of dataset {args.dataset!r} did not fail"]))
        sys.exit(1)
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
