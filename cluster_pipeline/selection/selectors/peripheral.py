"""The cluster selectors (docs/design.md, steps 3 and 3b; CluSTER, Kim et al.):
every cluster keeps the same budget of its own samples, cluster c trains on rank c.

With clusters of sizes n_c (after the capacity step) and m = min_c n_c, every cluster keeps
``floor(r * m)`` samples, in the selector's order:

- ``peripheral`` (default): the samples farthest from their centroid, largest ``sq_distance``
  first (most diverse gradients; the paper's choice);
- ``core``: the nearest ones, smallest ``sq_distance`` first;
- ``random``: a seeded random order within each cluster;
- ``uniform``: every sample of every cluster, each cluster oversampled with replacement up to
  the largest cluster's size, weight 1 (``r`` is not used).

The weight of cluster c is ``w_c = n_c * K / N`` (sizes before down-sampling), so that DDP's
gradient average (1/K) sum_c w_c g_c = sum_c (n_c / N) g_c, the stratified estimate of the
full-data gradient (step 5); ``uniform`` has weight 1 (its oversampling already balances).

**Balance by tokens** (``balance="tokens"``, this project's default; ``"samples"`` is the
published rule above). With token lengths l_i, the budget is ``B = floor(r * min_c L_c)``
tokens, ``L_c = sum_{i in c} l_i``, and every cluster keeps its selector's order up to B tokens
(the longest prefix within B, at least one sample). The weights are ``w_c = K R_c / R``, R_c the
response tokens of cluster c (after the capacity step, before down-sampling): the trained loss
is a token mean, so the full-data objective is ``sum_c (R_c / R) Lbar_c``. ``uniform``
oversamples every cluster to the largest cluster's tokens.
"""

from __future__ import annotations

import numpy as np

from cluster_pipeline.selection.passes import PASS_EMBEDDING
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    cluster_tokens,
    keep_first_in_clusters,
    rank_within,
)


def _order_key(name: str, inputs: SelectionInputs, rng: np.random.Generator) -> np.ndarray:
    """(N,) float64 ascending sort key of a selector's order within each cluster."""
    if name == "peripheral":
        return -np.asarray(inputs.sq_distance, dtype=np.float64)
    if name == "core":
        return np.asarray(inputs.sq_distance, dtype=np.float64)
    return rng.permutation(inputs.n).astype(np.float64)


def _score(name: str, inputs: SelectionInputs) -> np.ndarray:
    """(N,) float64: sq_distance for peripheral and core, nan for the random orders."""
    if name in ("peripheral", "core"):
        return np.asarray(inputs.sq_distance, dtype=np.float64)
    return np.full(inputs.n, np.nan)


def _budgeted(name: str, inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """``peripheral``, ``core`` and ``random``: each cluster's first ``keep`` samples (or B
    tokens) in the selector's order, weight w_c."""
    labels = np.asarray(inputs.labels, dtype=np.int64)
    rng = np.random.default_rng(params.seed)
    rank = rank_within(labels, _order_key(name, inputs, rng), inputs.k)
    return keep_first_in_clusters(name, inputs, params, rank, _score(name, inputs))


def peripheral(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Per cluster, the ``keep`` samples (or B tokens) of largest ``sq_distance``."""
    return _budgeted("peripheral", inputs, params)


def core(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Per cluster, the ``keep`` samples (or B tokens) of smallest ``sq_distance``."""
    return _budgeted("core", inputs, params)


def random_within(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """``random``: per cluster, ``keep`` samples (or B tokens) in a seeded random order."""
    return _budgeted("random", inputs, params)


def uniform(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Every sample, plus ``max_c n_c - n_c`` seeded draws with replacement within cluster c
    (under token balance: draws while cluster c stays within the largest cluster's tokens);
    weight 1, r unused."""
    labels = np.asarray(inputs.labels, dtype=np.int64)
    n, k = inputs.n, inputs.k
    rng = np.random.default_rng(params.seed)
    copies = np.ones(n, dtype=np.int64)
    ones = np.ones(k)
    rank = rank_within(labels, np.zeros(n), k)
    score = np.full(n, np.nan)
    if params.balance == "tokens":
        lengths = np.asarray(inputs.lengths, dtype=np.int64)
        totals = cluster_tokens(inputs)
        largest = int(totals.max())
        for c in range(k):
            members = np.flatnonzero(labels == c)
            total = int(totals[c])
            while True:
                draw = int(rng.choice(members))
                if total + lengths[draw] > largest:
                    break
                copies[draw] += 1
                total += int(lengths[draw])
        kept = int(np.bincount(labels, weights=copies, minlength=k).max())
        return SelectionResult(
            "uniform",
            copies > 0,
            copies,
            rank,
            ones[labels],
            ones,
            kept,
            "tokens",
            largest,
            score=score,
        )
    sizes = np.bincount(labels, minlength=k)
    largest = int(sizes.max())
    for c in range(k):
        members = np.flatnonzero(labels == c)
        extra = rng.choice(members, size=largest - len(members), replace=True)
        np.add.at(copies, extra, 1)
    return SelectionResult(
        "uniform", copies > 0, copies, rank, ones[labels], ones, largest, score=score
    )


_CLUSTERING = ("sq_distance",)

SELECTORS = (
    SelectorSpec(
        "peripheral",
        "farthest from the centroid in every cluster (CluSTER)",
        peripheral,
        order=0,
        needs=_CLUSTERING,
        passes=(PASS_EMBEDDING,),
        clustered=True,
        reweighted=True,
        source="Kim et al., CluSTER",
    ),
    SelectorSpec(
        "core",
        "nearest to the centroid",
        core,
        order=1,
        needs=_CLUSTERING,
        passes=(PASS_EMBEDDING,),
        clustered=True,
        reweighted=True,
        source="Kim et al., CluSTER, ablation",
    ),
    SelectorSpec(
        "random",
        "random within each cluster",
        random_within,
        order=2,
        needs=_CLUSTERING,
        passes=(PASS_EMBEDDING,),
        clustered=True,
        reweighted=True,
        source="Kim et al., CluSTER, ablation",
    ),
    SelectorSpec(
        "uniform",
        "oversample every cluster to the largest, weight 1",
        uniform,
        order=3,
        passes=(PASS_EMBEDDING,),
        clustered=True,
        source="this project",
        # r is unused: it oversamples every cluster to the largest, so no r keeps nothing.
        budgeted=False,
    ),
)
