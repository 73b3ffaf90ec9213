"""Balanced down-sampling (docs/design.md, step 3) and the re-weighting factors (step 5).

With clusters of sizes n_c (after the capacity step) and m = min_c n_c, every cluster keeps
``floor(r * m)`` samples. The selectors:

- ``peripheral`` (default): the samples farthest from their centroid (most diverse gradients);
- ``core``: the nearest ones;
- ``random``: a seeded random draw within each cluster;
- ``uniform``: every sample of every cluster, each cluster oversampled with replacement up to the
  largest cluster's size, weight 1 (``r`` is not used);
- ``random_global``: the same budget K * floor(r * m), drawn from the whole pool ignoring clusters,
  weight 1;
- ``full``: every sample, weight 1.

The weight of cluster c is ``w_c = n_c * K / N`` (sizes before down-sampling), so that DDP's
gradient average (1/K) sum_c w_c g_c = sum_c (n_c / N) g_c, the stratified estimate of the
full-data gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import polars as pl

Selector = Literal["peripheral", "core", "random", "uniform", "random_global", "full"]
SELECTORS: tuple[str, ...] = get_args(Selector)
# Selectors that keep the clusters: cluster c is trained on rank c with weight w_c.
CLUSTER_SELECTORS = ("peripheral", "core", "random", "uniform")
# Selectors whose ranks' losses are re-weighted by w_c.
REWEIGHTED_SELECTORS = ("peripheral", "core", "random")


@dataclass(frozen=True)
class SelectionResult:
    """Per-sample outcome of a selector over N samples in K clusters.

    Attributes:
        selected: (N,) bool, kept at least once.
        copies: (N,) int64, times the sample is trained on per epoch (0 if not selected; > 1
            only for ``uniform`` oversampling).
        selection_rank: (N,) int64, 0-based position in the selector's order within the sample's
            cluster (global order for ``random_global``/``full``); the first ``per_cluster`` are
            kept.
        weight: (N,) float64, loss weight of the sample's cluster (1 where not re-weighted).
        cluster_weights: (K,) float64, w_c.
        per_cluster: samples kept per cluster, floor(r * m) (or the largest size for
            ``uniform``; the global budget for ``random_global``/``full``).
    """

    selector: str
    selected: np.ndarray
    copies: np.ndarray
    selection_rank: np.ndarray
    weight: np.ndarray
    cluster_weights: np.ndarray
    per_cluster: int

    @property
    def n_selected(self) -> int:
        """Training examples per epoch, counting oversampled copies."""
        return int(self.copies.sum())

    @property
    def data_fraction(self) -> float:
        """Distinct selected samples / N."""
        return float(self.selected.mean()) if self.selected.size else 0.0


def cluster_weights(sizes: np.ndarray) -> np.ndarray:
    """w_c = n_c * K / N for (K,) cluster sizes n_c (docs/design.md, step 5). Sums to K."""
    sizes = np.asarray(sizes, dtype=np.float64)
    return sizes * len(sizes) / sizes.sum()


def per_cluster_budget(sizes: np.ndarray, r: float) -> int:
    """floor(r * m), m = min_c n_c.

    Raises:
        ValueError: r outside (0, 1], or floor(r * m) = 0 (the message gives the sizes).
    """
    if not 0.0 < r <= 1.0:
        raise ValueError(f"selection ratio r must be in (0, 1], got {r}")
    m = int(np.min(sizes))
    keep = math.floor(round(r * m, 9))
    if keep == 0:
        raise ValueError(
            f"floor(r * m) = floor({r} * {m}) = 0: the smallest cluster is too small for r={r}. "
            f"Cluster sizes: {np.asarray(sizes).tolist()}. Raise r, lower K or add data."
        )
    return keep


def _rank_within(labels: np.ndarray, key: np.ndarray, k: int) -> np.ndarray:
    """0-based rank of each sample within its cluster when sorted by ascending key (ties by
    sample index)."""
    order = np.lexsort((np.arange(len(labels)), key, labels))
    ranks = np.empty(len(labels), dtype=np.int64)
    starts = np.searchsorted(labels[order], np.arange(k))
    positions = np.arange(len(labels)) - np.repeat(starts, np.bincount(labels, minlength=k))
    ranks[order] = positions
    return ranks


def select(
    labels: np.ndarray,
    sq_distance: np.ndarray,
    k: int,
    selector: str = "peripheral",
    r: float = 1.0,
    seed: int = 0,
) -> SelectionResult:
    """Apply a selector (module docstring) to N clustered samples.

    Args:
        labels: (N,) int64 cluster per sample, in [0, K).
        sq_distance: (N,) float32 squared distance to the sample's centroid.
        k: number of clusters K.
        selector: one of :data:`SELECTORS`.
        r: selection ratio in (0, 1].
        seed: seed of the random selectors.

    Raises:
        ValueError: unknown selector, r out of range, an empty cluster, or floor(r * m) = 0.
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown selector {selector!r}; choose one of {SELECTORS}")
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    sizes = np.bincount(labels, minlength=k)
    if (sizes == 0).any():
        raise ValueError(f"cluster sizes {sizes.tolist()} include an empty cluster")
    weights = cluster_weights(sizes)
    rng = np.random.default_rng(seed)
    copies = np.zeros(n, dtype=np.int64)

    if selector in REWEIGHTED_SELECTORS:
        keep = per_cluster_budget(sizes, r)
        if selector == "peripheral":
            key = -np.asarray(sq_distance, dtype=np.float64)
        elif selector == "core":
            key = np.asarray(sq_distance, dtype=np.float64)
        else:
            key = rng.permutation(n).astype(np.float64)
        rank = _rank_within(labels, key, k)
        copies[rank < keep] = 1
        return SelectionResult(selector, copies > 0, copies, rank, weights[labels], weights, keep)

    if selector == "uniform":
        largest = int(sizes.max())
        copies[:] = 1
        for c in range(k):
            members = np.flatnonzero(labels == c)
            extra = rng.choice(members, size=largest - len(members), replace=True)
            np.add.at(copies, extra, 1)
        rank = _rank_within(labels, np.zeros(n), k)
        ones = np.ones(k)
        return SelectionResult(selector, copies > 0, copies, rank, ones[labels], ones, largest)

    budget = n if selector == "full" else k * per_cluster_budget(sizes, r)
    order = rng.permutation(n)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    copies[rank < budget] = 1
    ones = np.ones(k)
    return SelectionResult(selector, copies > 0, copies, rank, np.ones(n), ones, budget)


def selection_from_table(
    frame: pl.DataFrame, selector: str, k: int, per_cluster: int
) -> SelectionResult:
    """Rebuild a selector's result from a ``peripheral_subsets`` table (columns cluster,
    selected, copies, selection_rank, weight); weights at full precision from the ``weight``
    column."""
    per_cluster_weight = frame.group_by("cluster").agg(pl.col("weight").first()).sort("cluster")
    weights = np.ones(k)
    weights[per_cluster_weight["cluster"].to_numpy()] = per_cluster_weight["weight"].to_numpy()
    return SelectionResult(
        selector=selector,
        selected=frame["selected"].to_numpy(),
        copies=frame["copies"].to_numpy().astype(np.int64),
        selection_rank=frame["selection_rank"].to_numpy(),
        weight=frame["weight"].to_numpy(),
        cluster_weights=weights,
        per_cluster=per_cluster,
    )


def per_cluster_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """One row per cluster of a ``peripheral_subsets`` table: n_c, samples kept (copies
    counted) and w_c."""
    return (
        frame.group_by("cluster")
        .agg(
            pl.len().alias("n_c"),
            pl.col("copies").sum().alias("kept"),
            pl.col("weight").first().alias("w_c"),
        )
        .sort("cluster")
    )
