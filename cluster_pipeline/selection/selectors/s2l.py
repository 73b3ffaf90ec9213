"""``s2l``: SmallToLarge (Yang et al. 2024, *SmallToLarge (S2L): Scalable Data Selection for
Fine-tuning Large Language Models by Summarizing Training Trajectories of Small Models*,
NeurIPS 2024, arXiv 2403.07384; the authors' code, ``schedules/s2l.py``).

A proxy model is trained on the whole pool and saved at T checkpoints; each sample's loss at
each checkpoint is its training trajectory

    traj_i = (l_i(1), .., l_i(T))           l_i(t) = (1/|A_i|) sum_{a in A_i} -log P_t(a | ...)

(``SelectionInputs.loss_trajectories``, (N, T) float32, the mean token loss of the response
under checkpoint t). Samples whose trajectories are close have close gradients throughout
training (the paper's Theorem 4.1), so k-means on the trajectories (C clusters, Euclidean;
``SelectionParams.s2l_clusters``, the paper's 100 by default) groups samples that teach the
same thing, and the subset is drawn evenly across those groups, small groups first
(Algorithm 1):

    sort the clusters C_1 .. C_C by size, ascending; R = the budget
    for k = 1 .. C:   R_k = floor(R / (C - k + 1))                 (what is left, spread evenly)
                      take min(|C_k|, R_k) samples of C_k uniformly at random;  R -= taken

so clusters smaller than their share are kept whole and the rest of the budget is spread
evenly over the larger ones (the floor as in the authors' code, ``n // (len - i)``; the last
cluster takes what is left). The budget is the unclustered one (``base``: K floor(r m)
samples, or K B tokens under token balance), so ``s2l`` is compared with ``peripheral`` at
equal data; weights are 1 and the subset is dealt into random balanced shards, as for the
paper's other baselines.

Token balance: the same algorithm in tokens. Clusters are sorted by their token totals,
ascending; R_k = floor(R / (C - k + 1)) tokens; cluster k keeps the longest prefix of its
seeded random order whose tokens stay within R_k (all of it when it fits) and R falls by the
tokens kept (at least one sample is kept in all).

``selection_rank`` is the order of the draw: the kept samples in the order taken (cluster by
cluster, in the sorted order), then each cluster's remaining samples in the same order. The
score is the share of the sample's trajectory cluster that was kept, min(|C_k|, R_k) / |C_k|
under sample balance: every member's chance of being drawn (1 for the clusters kept whole).

Departures from the paper: the proxy is the base model itself trained briefly on the pool
(``peripheral_subsets.s2l_steps``, T = ``s2l_checkpoints`` checkpoints evenly spaced), not a
separate smaller model trained for 3 epochs; any local causal LM works the same way. The
authors' code also sets non-finite losses to 0 (kept here) and sets aside clusters of at most
2 samples, drawing from them only what the others leave; Algorithm 1 as published does not,
and neither does this module. k-means is faiss's (k-means++ seeding, one run of up to 20
Lloyd iterations, the authors' ``niter=20``), seeded by the selection seed.

Cost: the proxy's training (``s2l_steps`` optimizer steps over the pool: one forward and one
backward pass per sample visit, counted in the cost record) plus T loss passes of N forwards
(the embedding pass under each checkpoint, cached per sample); the selection itself is k-means
on an (N, T) matrix, O(N T C) per iteration.
"""

from __future__ import annotations

import numpy as np

from cluster_pipeline.selection.clustering import kmeans, squared_distances
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    global_budget,
)

# The authors' faiss k-means iterations (schedules/s2l.py, faiss.Kmeans(niter=20)).
S2L_NITER = 20


def trajectory_clusters(trajectories: np.ndarray, clusters: int, seed: int) -> np.ndarray:
    """k-means on the loss trajectories: each sample's nearest centroid (Euclidean).

    Args:
        trajectories: (N, T) float32 mean token loss of each sample at each checkpoint (nats);
            non-finite entries count as 0, as in the authors' code.
        clusters: C, the number of trajectory clusters (1 <= C <= N).
        seed: seeds faiss's k-means++.

    Returns:
        (N,) int64 cluster per sample, in [0, C).

    Raises:
        ValueError: C < 1, or more clusters than samples.
    """
    x = np.asarray(trajectories, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"s2l: loss trajectories must be (N, T), got shape {x.shape}")
    n = len(x)
    if clusters < 1 or clusters > n:
        raise ValueError(
            f"s2l: cannot make {clusters} trajectory clusters from {n} samples; set "
            "peripheral_subsets.s2l_clusters between 1 and the pool size"
        )
    x = np.where(np.isfinite(x), x, 0.0).astype(np.float32)
    fit = kmeans(x, clusters, seed, niter=S2L_NITER, restarts=1)
    return squared_distances(x, fit.centroids).argmin(axis=1).astype(np.int64)


def balanced_sampling(
    labels: np.ndarray,
    budget: int,
    seed: int,
    lengths: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 (module docstring): the samples drawn evenly across clusters, small first.

    Args:
        labels: (N,) int64 trajectory cluster per sample (empty cluster ids are ignored).
        budget: samples to draw, or tokens when ``lengths`` is given.
        seed: seeds the draw within each cluster.
        lengths: (N,) int64 tokens per sample: the budget and the clusters' sizes are in tokens.

    Returns:
        ((N,) int64 the draw order: the kept samples in the order taken, then the rest;
        (N,) bool kept).
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    weights = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    size = np.bincount(labels, weights=weights)
    present = np.flatnonzero(np.bincount(labels) > 0)
    # Ascending by size (samples or tokens), ties by cluster id.
    ordered = present[np.lexsort((present, size[present]))]
    rng = np.random.default_rng(seed)
    taken: list[np.ndarray] = []
    rest: list[np.ndarray] = []
    remaining = int(budget)
    for i, c in enumerate(ordered):
        members = np.flatnonzero(labels == c)
        members = members[rng.permutation(len(members))]
        quota = remaining // (len(ordered) - i)
        if weights is None:
            take = min(len(members), quota)
            spent = take
        else:
            running = np.cumsum(weights[members])
            take = int(np.searchsorted(running, quota, side="right"))
            spent = int(running[take - 1]) if take else 0
        taken.append(members[:take])
        rest.append(members[take:])
        remaining -= spent
    kept = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    left = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    if len(kept) == 0:  # a token budget below every first sample: keep one, as elsewhere
        kept, left = left[:1], left[1:]
    selected = np.zeros(n, dtype=bool)
    selected[kept] = True
    return np.concatenate([kept, left]).astype(np.int64), selected


def s2l(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """k-means on the loss trajectories, then Algorithm 1 up to the global budget (module
    docstring); score = the kept share of the sample's trajectory cluster.

    Raises:
        ValueError: trajectories not (N, T) for the pool's N, or a cluster count out of range.
    """
    trajectories = inputs.loss_trajectories
    assert trajectories is not None  # run_selector checks the needs
    n = inputs.n
    if trajectories.ndim != 2 or len(trajectories) != n:
        raise ValueError(
            f"s2l: loss trajectories of shape {trajectories.shape} for a pool of {n} samples"
        )
    groups = trajectory_clusters(trajectories, params.s2l_clusters, params.seed)
    budget = global_budget(inputs, params)
    by_tokens = params.balance == "tokens"
    lengths = np.asarray(inputs.lengths, dtype=np.int64) if by_tokens else None
    order, selected = balanced_sampling(groups, budget, params.seed, lengths)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    share = np.bincount(groups, weights=selected) / np.maximum(np.bincount(groups), 1)
    copies = selected.astype(np.int64)
    return SelectionResult(
        "s2l",
        selected,
        copies,
        rank,
        np.ones(n),
        np.ones(inputs.k),
        int(copies.sum()),
        "tokens" if by_tokens else "samples",
        budget if by_tokens else None,
        score=share[groups].astype(np.float64),
    )
