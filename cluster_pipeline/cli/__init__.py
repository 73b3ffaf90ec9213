"""The ``cluster-pipeline`` command line: ``datasets``, ``lineage`` and ``compare-config``.
Entry point :func:`cluster_pipeline.cli.main.main` (``[project.scripts]``)."""
