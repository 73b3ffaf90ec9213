"""The ``cluster-pipeline`` command line, for what a person does from a shell without the web UI:
``datasets`` (list and register dataset partitions), ``lineage`` (trace samples), ``export``
(the selected subset as a Hugging Face ``datasets`` dataset), ``run-config`` and
``compare-config`` (the run configs of a size profile or a comparison run), ``dev`` and
``mlflow`` (the Dagster and MLflow web UIs). It sits on top: it may use the Dagster definitions.
Entry point :func:`cluster_pipeline.cli.main.main` (``[project.scripts]``).
"""

import os
from pathlib import Path

from cluster_pipeline.storage.layout import PROJECT_ROOT


class UserError(Exception):
    """An error the user caused (unknown dataset or sample, missing files): the CLI prints its
    message on one line and exits with status 2, without a traceback."""


def instance_home() -> Path:
    """The Dagster instance folder, as ``make`` prepares it: ``$DAGSTER_HOME``, else
    ``<project>/.dagster_home``."""
    return Path(os.environ.get("DAGSTER_HOME") or PROJECT_ROOT / ".dagster_home").absolute()
