"""The ``cluster-pipeline`` command line, for what a person does from a shell without the web UI:
registering and listing dataset partitions, tracing samples through their lineage, exporting the
selected subset as a Hugging Face ``datasets`` dataset, printing the run configs of a size profile
or a comparison run, and starting the Dagster and MLflow web UIs. It sits on top: it may use the
Dagster definitions. Entry point :func:`cluster_pipeline.cli.main.main` (``[project.scripts]``);
its modules are listed in docs/design.md, "Code layout".
"""

import os
import shlex
from pathlib import Path

from cluster_pipeline.storage.layout import PROJECT_ROOT


class UserError(Exception):
    """An error the user caused (unknown dataset or sample, missing files): the CLI prints its
    message on one line and exits with status 2, without a traceback."""


def make_run(dataset: str) -> str:
    """``make run DATASET=<dataset>`` as one shell command line that runs as printed, whatever
    the name: the ``DATASET=...`` word quoted for the shell (``shlex``) and a ``$`` in it doubled
    for make (which would expand it), e.g. ``make run 'DATASET=my data'``."""
    return shlex.join(["make", "run", "DATASET=" + dataset.replace("$", "$$")])


def instance_home() -> Path:
    """The Dagster instance folder, as ``make`` prepares it: ``$DAGSTER_HOME``, else
    ``<project>/.dagster_home``."""
    return Path(os.environ.get("DAGSTER_HOME") or PROJECT_ROOT / ".dagster_home").absolute()
