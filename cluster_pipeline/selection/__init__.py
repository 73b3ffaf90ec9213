"""The method's formulas, each in one place (docs/design.md, steps 1-4): the gradient-proxy
embedding, balanced k-means and the capacity step, the selector registry with one module per
selector and the re-weighting factors, and the allocation into per-rank shard manifests. Plain
numpy/torch/polars, no Dagster; imports ``storage`` and ``data``. Its modules are listed in
docs/design.md, "Code layout".
"""
