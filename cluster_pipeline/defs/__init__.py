"""The Dagster layer: partitions, resources, the seven stage assets, checks and jobs.

Loaded by :func:`dagster.load_from_defs_folder` from :mod:`cluster_pipeline.definitions`.
"""
