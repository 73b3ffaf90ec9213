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

**Balance by tokens** (``balance="tokens"``, this project's default; ``"samples"`` is the
published rule above). Clusters in gradient space differ in sequence length, so equal sample
counts leave the ranks unequal work and, under DDP's lockstep, the lighter ranks idle. With
token lengths l_i, the budget is measured in tokens: ``B = floor(r * min_c L_c)`` with
``L_c = sum_{i in c} l_i``, and every cluster keeps its selector's order up to B tokens (the
longest prefix within B, at least one sample). Every rank then carries B tokens, less than one
sample short. The weights change with the objective they estimate (docs/design.md, step 5): the
trained loss is the mean cross-entropy over response tokens, so the full-data objective is
``L = sum_c (R_c / R) Lbar_c`` with R_c the response tokens of cluster c (after the capacity
step, before down-sampling) and Lbar_c the cluster's token-mean loss; rank c's step estimates
Lbar_c by its own token mean, whatever its sample count, so ``w_c = K R_c / R``.
``random_global`` draws K * B tokens from the whole pool, ``uniform`` oversamples every cluster
to the largest cluster's tokens, ``full`` keeps all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import polars as pl

Selector = Literal["peripheral", "core", "random", "uniform", "random_global", "full"]
Balance = Literal["tokens", "samples"]
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
            ``uniform``; the global budget for ``random_global``/``full``); under token balance
            the largest number of samples a cluster kept.
        balance: ``"samples"`` or ``"tokens"``.
        token_budget: tokens kept per cluster under token balance (K times it for
            ``random_global``), None under sample balance.
    """

    selector: str
    selected: np.ndarray
    copies: np.ndarray
    selection_rank: np.ndarray
    weight: np.ndarray
    cluster_weights: np.ndarray
    per_cluster: int
    balance: str = "samples"
    token_budget: int | None = None

    @property
    def n_selected(self) -> int:
        """Training examples per epoch, counting oversampled copies."""
        return int(self.copies.sum())

    @property
    def data_fraction(self) -> float:
        """Distinct selected samples / N."""
        return float(self.selected.mean()) if self.selected.size else 0.0


def cluster_weights(sizes: np.ndarray) -> np.ndarray:
    """w_c = n_c * K / N for (K,) cluster sizes n_c (docs/design.md, step 5). Sums to K.
    Given the clusters' response-token totals R_c instead, the same formula is w_c = K R_c / R,
    the weights of token balance."""
    sizes = np.asarray(sizes, dtype=np.float64)
    return sizes * len(sizes) / sizes.sum()


def token_budget(cluster_tokens: np.ndarray, r: float) -> int:
    """B = floor(r * min_c L_c) tokens per cluster, L_c the clusters' token totals (K,).

    Raises:
        ValueError: r outside (0, 1], or B = 0.
    """
    if not 0.0 < r <= 1.0:
        raise ValueError(f"selection ratio r must be in (0, 1], got {r}")
    budget = math.floor(round(r * int(np.min(cluster_tokens)), 9))
    if budget == 0:
        raise ValueError(
            f"floor(r * min_c L_c) = 0 tokens: cluster token totals "
            f"{np.asarray(cluster_tokens).tolist()}. Raise r, lower K or add data."
        )
    return budget


def _prefix_within(labels: np.ndarray, rank: np.ndarray, lengths: np.ndarray, k: int, budget):
    """(N,) bool: per cluster, the samples in ``rank`` order whose running token total stays
    within ``budget`` (at least the first one)."""
    order = np.lexsort((rank, labels))
    running = np.empty(len(labels), dtype=np.int64)
    sorted_labels = labels[order]
    cum = np.cumsum(lengths[order])
    starts = np.searchsorted(sorted_labels, np.arange(k))
    before = np.concatenate([[0], cum])[starts]
    running[order] = cum - np.repeat(before, np.bincount(labels, minlength=k))
    return (running <= budget) | (rank == 0)


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
    balance: str = "samples",
    lengths: np.ndarray | None = None,
    response_tokens: np.ndarray | None = None,
) -> SelectionResult:
    """Apply a selector (module docstring) to N clustered samples.

    Args:
        labels: (N,) int64 cluster per sample, in [0, K).
        sq_distance: (N,) float32 squared distance to the sample's centroid.
        k: number of clusters K.
        selector: one of :data:`SELECTORS`.
        r: selection ratio in (0, 1].
        seed: seed of the random selectors.
        balance: ``"samples"`` (the published rule) or ``"tokens"`` (module docstring).
        lengths: (N,) int64 tokens per sample (prompt and response, as trained); needed for
            token balance.
        response_tokens: (N,) int64 response tokens per sample; the weights of token balance.

    Raises:
        ValueError: unknown selector or balance, r out of range, an empty cluster, a zero
            budget, or token balance without lengths.
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown selector {selector!r}; choose one of {SELECTORS}")
    if balance not in ("samples", "tokens"):
        raise ValueError(f"unknown balance {balance!r}; choose tokens or samples")
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    sizes = np.bincount(labels, minlength=k)
    if (sizes == 0).any():
        raise ValueError(f"cluster sizes {sizes.tolist()} include an empty cluster")
    if balance == "tokens":
        if lengths is None or response_tokens is None:
            raise ValueError("token balance needs the samples' lengths and response tokens")
        return _select_by_tokens(
            labels,
            sq_distance,
            k,
            selector,
            r,
            seed,
            np.asarray(lengths, dtype=np.int64),
            np.asarray(response_tokens, dtype=np.int64),
        )
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


def _select_by_tokens(
    labels: np.ndarray,
    sq_distance: np.ndarray,
    k: int,
    selector: str,
    r: float,
    seed: int,
    lengths: np.ndarray,
    response_tokens: np.ndarray,
) -> SelectionResult:
    """:func:`select` under token balance: the same orders, budgets in tokens."""
    n = len(labels)
    if (lengths < 1).any():
        raise ValueError("every sample needs a positive token length")
    cluster_tokens = np.bincount(labels, weights=lengths, minlength=k).astype(np.int64)
    rng = np.random.default_rng(seed)
    copies = np.zeros(n, dtype=np.int64)
    if selector in REWEIGHTED_SELECTORS:
        budget = token_budget(cluster_tokens, r)
        if selector == "peripheral":
            key = -np.asarray(sq_distance, dtype=np.float64)
        elif selector == "core":
            key = np.asarray(sq_distance, dtype=np.float64)
        else:
            key = rng.permutation(n).astype(np.float64)
        rank = _rank_within(labels, key, k)
        copies[_prefix_within(labels, rank, lengths, k, budget)] = 1
        weights = cluster_weights(np.bincount(labels, weights=response_tokens, minlength=k))
        kept = int(np.bincount(labels[copies > 0], minlength=k).max())
        return SelectionResult(
            selector, copies > 0, copies, rank, weights[labels], weights, kept, "tokens", budget
        )
    ones = np.ones(k)
    if selector == "uniform":
        largest = int(cluster_tokens.max())
        copies[:] = 1
        for c in range(k):
            members = np.flatnonzero(labels == c)
            total = int(cluster_tokens[c])
            while True:
                draw = int(rng.choice(members))
                if total + lengths[draw] > largest:
                    break
                copies[draw] += 1
                total += int(lengths[draw])
        rank = _rank_within(labels, np.zeros(n), k)
        kept = int(np.bincount(labels, weights=copies, minlength=k).max())
        return SelectionResult(
            selector, copies > 0, copies, rank, ones[labels], ones, kept, "tokens", largest
        )
    order = rng.permutation(n)
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    if selector == "full":
        copies[:] = 1
        budget = int(lengths.sum())
    else:
        budget = k * token_budget(cluster_tokens, r)
        copies[order[np.cumsum(lengths[order]) <= budget]] = 1
        copies[order[0]] = 1
    return SelectionResult(
        selector, copies > 0, copies, rank, np.ones(n), ones, int(copies.sum()), "tokens", budget
    )


def selection_from_table(
    frame: pl.DataFrame,
    selector: str,
    k: int,
    per_cluster: int,
    balance: str = "samples",
    token_budget: int | None = None,
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
        balance=balance,
        token_budget=token_budget,
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
