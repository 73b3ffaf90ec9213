"""The method's formulas, each in one place (docs/design.md, steps 1-4): the gradient-proxy
embedding (``embedding``), balanced k-means and the capacity step (``clustering``), the
selector registry with one module per selector and the re-weighting factors (``selectors/``),
and the allocation into per-rank shard manifests (``sharding``). Plain numpy/torch/polars, no
Dagster; imports ``storage`` and ``data``.
"""
