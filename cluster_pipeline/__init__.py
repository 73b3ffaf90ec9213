"""CluSTER: clustering-based balanced sampling and allocation for data-parallel fine-tuning.

The method lives in :mod:`cluster_pipeline.core` (plain numpy/polars/torch), the torchrun entry
points in :mod:`cluster_pipeline.training`, and the Dagster layer in :mod:`cluster_pipeline.defs`.
"""

__version__ = "0.1.0"
