"""CluSTER: clustering-based balanced sampling and allocation for data-parallel fine-tuning.

Domain folders, imports pointing one way: :mod:`~cluster_pipeline.storage` and
:mod:`~cluster_pipeline.launch`, then :mod:`~cluster_pipeline.data`, :mod:`~cluster_pipeline.models`
and :mod:`~cluster_pipeline.selection` (the method's math), :mod:`~cluster_pipeline.training` and
:mod:`~cluster_pipeline.evaluation`, the torchrun entry points in :mod:`~cluster_pipeline.recipes`,
and the Dagster layer in :mod:`~cluster_pipeline.defs` (docs/design.md, "Layout").
"""

__version__ = "0.1.0"
