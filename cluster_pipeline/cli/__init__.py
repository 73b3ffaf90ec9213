"""The ``cluster-pipeline`` command line: ``datasets``, ``lineage``, ``run-config`` and
``compare-config``.
Entry point :func:`cluster_pipeline.cli.main.main` (``[project.scripts]``)."""


class UserError(Exception):
    """An error the user caused (unknown dataset or sample, missing files): the CLI prints its
    message on one line and exits with status 2, without a traceback."""
