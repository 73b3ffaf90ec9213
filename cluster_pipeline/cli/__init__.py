"""The ``cluster-pipeline`` command line, for what a person does from a shell without the web UI:
``datasets`` (list and register dataset partitions), ``lineage`` (trace samples), ``run-config``
and ``compare-config`` (the run configs of a size profile or a comparison run). It sits on top:
it may use the Dagster definitions. Entry point :func:`cluster_pipeline.cli.main.main`
(``[project.scripts]``).
"""


class UserError(Exception):
    """An error the user caused (unknown dataset or sample, missing files): the CLI prints its
    message on one line and exits with status 2, without a traceback."""
