"""Open the MLflow UI over the data folder's own tracking store (what `make mlflow` runs).

    cluster-pipeline mlflow                           # http://127.0.0.1:5000
    cluster-pipeline mlflow --host 0.0.0.0 --port 5001 [--data-dir DIR] [-- mlflow ui args...]

Runs ``mlflow ui`` on ``sqlite:///<data>/mlflow/mlflow.db`` with artifacts under
``<data>/mlflow/artifacts/``, the store the pipeline tracks into when neither the tracking
resource's ``tracking_uri`` nor ``$MLFLOW_TRACKING_URI`` names another (a team's server has a UI
of its own). It replaces this process (``exec``), so a signal to make reaches ``mlflow ui``
(SIGTERM to it stops its workers too).

A UI for one person on a small machine: one web worker (``mlflow ui`` starts 4) and without
MLflow's job runner (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` unless set: it starts seven
background consumers for GenAI scorers this project does not use). Pass ``-- --workers 4`` or
set the variable to have them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster_pipeline.storage.layout import DataLayout, default_data_dir
from cluster_pipeline.tracking.tracker import Store, local_store

JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``mlflow``'s arguments: host, port, data folder, then ``mlflow ui``'s own."""
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (loopback)")
    parser.add_argument("--port", type=int, default=5000, help="default 5000")
    parser.add_argument("--data-dir", type=Path, default=Path(default_data_dir()))
    parser.add_argument(
        "mlflow_args",
        nargs=argparse.REMAINDER,
        help="`--`, then more arguments of `mlflow ui` (e.g. -- --workers 2)",
    )


def ui_command(store: Store, host: str, port: int, extra: list[str]) -> list[str]:
    """The ``mlflow ui`` command line over ``store`` on ``host:port``, one worker; ``extra``
    arguments come last (a later ``--workers`` wins)."""
    command = [str(Path(sys.executable).parent / "mlflow"), "ui"]
    command += ["--backend-store-uri", store.uri]
    if store.artifact_location:
        command += ["--default-artifact-root", store.artifact_location]
    return [*command, "--host", host, "--port", str(port), "--workers", "1", *extra]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Create the store's folder and replace this process with ``mlflow ui``."""
    layout = DataLayout.at(args.data_dir)
    layout.mlflow_dir.mkdir(parents=True, exist_ok=True)
    store = local_store(layout)
    extra = args.mlflow_args[1:] if args.mlflow_args[:1] == ["--"] else args.mlflow_args
    command = ui_command(store, args.host, args.port, extra)
    print(
        f"cluster-pipeline mlflow: the MLflow UI of {store.uri} on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    os.environ.setdefault(JOB_EXECUTION_ENV, "false")
    os.execv(command[0], command)
