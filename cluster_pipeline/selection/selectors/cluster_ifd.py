"""``cluster_ifd``: k-means, then the highest instruction-following difficulty within each
cluster (arXiv 2504.12687: k-means clusters of the pool, the samples of highest IFD kept in
each; there on Magicoder's OSS-Instruct data).

IFD is ``ifd``'s (selection/selectors/ifd.py, Li et al. 2024), with its knobs and its two
passes (the same requests, so one cached pass serves both selectors): the conditioned mean loss
s(A | Q) and the unconditioned s(A) over the same answer tokens,

    IFD(Q, A) = s(A | Q) / s(A)          nan where a loss is not finite, s(A) <= 0, or the
                                         sample was truncated (unless ifd_truncated)

Within each cluster the samples are ordered as ``ifd`` orders the pool: those with IFD <= 1 by
IFD, highest first; then those with IFD > 1, highest first; then those without an IFD (ties
to the lower index). Every cluster keeps the first of its order
under the product's balanced rule (selection/selectors/base.py; docs/design.md, step 3):
``floor(r * m)`` samples (m = min_c n_c), or, under token balance, its longest prefix within
``B = floor(r * min_c L_c)`` tokens (at least one sample); cluster c trains on rank c with
weight ``w_c = n_c K / N`` (``K R_c / R`` under token balance), as for ``peripheral``. The
score is IFD.

Departures from the paper: the clusters are the pipeline's (``balanced_clusters``: k-means over
the gradient-proxy embeddings with K = the training ranks and the capacity step), not a
clustering of its own; a cluster with fewer samples of IFD <= 1 than its budget fills it with
the rest of its order (the paper's discard of IFD > 1 would leave the clusters unequal, and
unequal clusters unequal ranks); and IFD is scored with the base model, as ``ifd`` does.

Cost: ``ifd``'s two passes (shared with it); no backward pass. Its clusters come from the
embedding pass (N forwards, shared with the cluster selectors).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from cluster_pipeline.selection.passes import PASS_EMBEDDING
from cluster_pipeline.selection.selectors import ifd
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    keep_first_in_clusters,
    rank_within,
)


def ifd_order(score: np.ndarray) -> np.ndarray:
    """(N,) int64 each sample's place in ``ifd``'s order of the pool: IFD <= 1 by IFD highest
    first, then IFD > 1 highest first, then no IFD (nan); ties to the lower index."""
    score = np.asarray(score, dtype=np.float64)
    finite = np.isfinite(score)
    group = np.where(finite & (score <= 1.0), 0, np.where(finite, 1, 2))
    index = np.arange(len(score))
    order = np.lexsort((index, -np.where(finite, score, 0.0), group))
    place = np.empty(len(score), dtype=np.int64)
    place[order] = index
    return place


def cluster_ifd(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Per cluster, the first ``keep`` samples (or B tokens) of :func:`ifd_order`; weight w_c;
    score = IFD (module docstring)."""
    score = ifd.scores_of(inputs)
    labels = np.asarray(inputs.labels, dtype=np.int64)
    rank = rank_within(labels, ifd_order(score).astype(np.float64), inputs.k)
    result = keep_first_in_clusters("cluster_ifd", inputs, params, rank, score)
    return replace(result, notes=filled_clusters(labels, inputs.k, result.selected, score))


def filled_clusters(
    labels: np.ndarray, k: int, selected: np.ndarray, score: np.ndarray
) -> tuple[str, ...]:
    """The warning when a cluster kept samples with IFD > 1 or without an IFD (its samples
    with IFD <= 1 fewer than its budget; the paper discards them); () when none did.

    Args:
        labels: (N,) int64 cluster per sample, in [0, K).
        k: K.
        selected: (N,) bool kept.
        score: (N,) float64 IFD (nan where not computed).
    """
    filled = selected & ~(score <= 1)  # nan compares False: no IFD counts as filled
    if not filled.any():
        return ()
    per_cluster = np.bincount(labels[filled], minlength=k).tolist()
    kept = np.bincount(labels[selected], minlength=k).tolist()
    return (
        f"cluster_ifd: {int(filled.sum())} of the {int(selected.sum())} kept samples have "
        f"IFD > 1 or none (per cluster {per_cluster} of {kept}): those clusters have fewer "
        "samples with IFD <= 1 than their budget and are filled from the rest of their order, "
        "to keep the ranks equal; arXiv 2504.12687 discards IFD > 1",
    )


SELECTORS = (
    SelectorSpec(
        "cluster_ifd",
        "k-means then the highest instruction-following difficulty (ifd's IFD) within each "
        "cluster, the clusters' budgets and weights as peripheral's",
        cluster_ifd,
        order=60,
        needs=("mean_loss", "unconditioned_loss"),
        passes=(PASS_EMBEDDING, ifd.PASS_CONDITIONED, ifd.PASS_UNCONDITIONED),
        clustered=True,
        reweighted=True,
        source="arXiv 2504.12687 (k-means + per-cluster IFD); IFD: Li et al. 2024 (Cherry LLM)",
        knobs=ifd.IfdKnobs,
        gather=ifd.gather,
    ),
)
