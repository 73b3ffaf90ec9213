"""What every selector shares (docs/design.md, step 3): its inputs, its result, its cost record
and the budgets that make selectors comparable at equal data.

A selector is one module of ``selection/selectors/`` holding a function ``(SelectionInputs,
SelectionParams) -> SelectionResult`` and its :class:`SelectorSpec` (the module's
``SELECTORS``; the registry, ``__init__.py``, finds them): its knobs (a pydantic class, part of
``peripheral_subsets``' run config), the model passes it needs, declared as requests
(``gather(knobs, pool, runner)``, selection/passes.py), its rules (``rules(knobs, facts)``:
the settings it refuses before any pass) and what its record keeps (``details``). The inputs
are per-sample columns of the clustered pool (N rows, in the ``balanced_clusters`` table's
order) plus what its own passes produced (the target set's representations for ``rds``, the
unconditioned losses for ``ifd``, the proxy's loss trajectories for ``s2l``, the projected
gradients of the pool and the target set for ``less``); a spec names the inputs it reads
(``needs``), and a selector whose inputs are missing is refused before it runs.

Budgets. With clusters of sizes n_c (after the capacity step), m = min_c n_c, and token totals
``L_c = sum_{i in c} l_i`` (l_i the sample's tokens, prompt and response):

    per cluster, sample balance:  keep = floor(r * m)                    0 < r <= 1
    per cluster, token balance:   B    = floor(r * min_c L_c) tokens
    global (unclustered):         K * keep samples, or K * B tokens

(``r * m`` and ``r * L`` rounded to 9 decimals before the floor.) The global budget is what a
cluster selector at the same r keeps in all, so ``random_global``, ``rds``, ``ifd``,
``s2l`` and ``less`` are compared with ``peripheral`` at equal data. Under token balance a
global order is cut at the longest prefix whose tokens stay within K * B (at least one
sample; ``s2l`` spreads the K * B tokens over its trajectory clusters instead, ``s2l.py``).

Weights (step 5): ``w_c = n_c K / N`` (sample balance) or ``w_c = K R_c / R`` (token balance,
R_c the cluster's response tokens), for the re-weighted selectors; 1 for the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel

from cluster_pipeline.selection.passes import (
    Gathered,
    PassCost,
    PassRunner,
    Pool,
    SelectionFacts,
)


@dataclass(frozen=True)
class SelectionCost:
    """What a selection cost: its own seconds (scoring and ordering, on the CPU) and the model
    passes its inputs needed.

    Attributes:
        seconds: wall seconds of the selector's function.
        passes: the model passes of the selector's inputs (:class:`PassCost`).
    """

    seconds: float
    passes: tuple[PassCost, ...] = ()

    @property
    def forward_passes(self) -> int:
        """Per-sample forward passes over all the selector's model passes."""
        return sum(p.samples for p in self.passes)

    @property
    def backward_passes(self) -> int:
        """Per-sample backward passes (s2l's proxy training, less's warm-up and gradient
        passes; 0 for the other selectors)."""
        return sum(p.backward for p in self.passes)

    @property
    def peak_rss_mib(self) -> float | None:
        """The largest peak resident memory of one rank over the passes (MiB; None when no
        pass recorded one)."""
        peaks = [p.peak_rss_mib for p in self.passes if p.peak_rss_mib is not None]
        return max(peaks) if peaks else None

    @property
    def peak_cuda_mib(self) -> float | None:
        """The same for CUDA memory (MiB)."""
        peaks = [p.peak_cuda_mib for p in self.passes if p.peak_cuda_mib is not None]
        return max(peaks) if peaks else None

    @property
    def total_seconds(self) -> float:
        """The selector's seconds plus its passes' seconds."""
        return self.seconds + sum(p.seconds for p in self.passes)


@dataclass(frozen=True)
class SelectionInputs:
    """What selectors read, for N samples in K clusters (one row each, table order).

    Attributes:
        labels: (N,) int64 cluster per sample, in [0, K).
        k: number of clusters K (the data-parallel ranks).
        sq_distance: (N,) float32 squared distance to the sample's centroid.
        lengths: (N,) int64 tokens per sample (prompt and response, as trained); needed for
            token balance.
        response_tokens: (N,) int64 response tokens per sample T; the weights of token
            balance.
        mean_loss: (N,) float32 mean token cross-entropy of the response given the prompt
            (nats), from the embedding pass (nan where the sample has none).
        unconditioned_loss: (N,) float32 the same mean over the same response tokens without
            the prompt (ifd's pass).
        hidden_mean: (N, d) float32 L2-normalised mean final hidden state over the response.
        targets: (M, d) float32 L2-normalised hidden_mean of the M target samples (rds).
        loss_trajectories: (N, T) float32 mean token loss of the response given the prompt
            (nats) under each of the T checkpoints of s2l's proxy, in step order.
        less_gradients: (N, C, d) float32 L2-normalised projected Adam-preconditioned LoRA
            gradients of the pool under each of the C checkpoints of less's warm-up.
        less_target_gradients: (M, C, d) float32 L2-normalised projected gradients of the M
            target samples under the same checkpoints, with the same projection.
        less_learning_rates: (C,) float64 the warm-up's mean learning rate before each
            checkpoint (eta_i).
        target_tasks: (M,) str the task of each target sample (rds, less: MMLU's topic, a
            folder's file; "" where the target set has none).
        sources: (N,) str each pool sample's source (its file; s2l, balanced_random).
        passes: the model passes the inputs came from, attached to the cost record.
        extra: inputs of a selector's own by name (what its ``gather`` returned under names
            that are not fields here).
    """

    labels: np.ndarray
    k: int
    sq_distance: np.ndarray | None = None
    lengths: np.ndarray | None = None
    response_tokens: np.ndarray | None = None
    mean_loss: np.ndarray | None = None
    unconditioned_loss: np.ndarray | None = None
    hidden_mean: np.ndarray | None = None
    targets: np.ndarray | None = None
    loss_trajectories: np.ndarray | None = None
    less_gradients: np.ndarray | None = None
    less_target_gradients: np.ndarray | None = None
    less_learning_rates: np.ndarray | None = None
    target_tasks: np.ndarray | None = None
    sources: np.ndarray | None = None
    passes: tuple[PassCost, ...] = ()
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """N."""
        return len(self.labels)

    def get(self, name: str) -> np.ndarray | None:
        """The input ``name``: a field, or one of :attr:`extra` (None when not given)."""
        if name in self.extra:
            return self.extra[name]
        return getattr(self, name, None)


@dataclass(frozen=True)
class SelectionParams:
    """The knobs every selector takes: ratio r in (0, 1], seed of the random ones, and balance
    (``"samples"``: the published rule; ``"tokens"``: budgets in tokens); and the selector's
    own knobs (its spec's ``knobs`` class, or a mapping of knob values, those of other
    selectors ignored; None: its defaults)."""

    r: float = 1.0
    seed: int = 0
    balance: str = "samples"
    knobs: BaseModel | Mapping[str, Any] | None = None


class NoKnobs(BaseModel):
    """The knobs of a selector without knobs of its own."""


def no_passes(knobs: BaseModel, pool: Pool, runner: PassRunner) -> Gathered:
    """The ``gather`` of a selector that reads the clustering alone: nothing to run."""
    return Gathered()


def no_rules(knobs: BaseModel, facts: SelectionFacts) -> list[str]:
    """The ``rules`` of a selector whose knobs need no rule beyond their bounds."""
    return []


@dataclass(frozen=True)
class SelectionResult:
    """Per-sample outcome of a selector over N samples in K clusters.

    Attributes:
        selector: the selector's name.
        selected: (N,) bool, kept at least once.
        copies: (N,) int64, times the sample is trained on per epoch (0 if not selected; > 1
            only for ``uniform`` oversampling).
        selection_rank: (N,) int64, 0-based position in the selector's order within the sample's
            cluster (the global order for the unclustered selectors); the first ``per_cluster``
            are kept.
        weight: (N,) float64, loss weight of the sample's cluster (1 where not re-weighted).
        cluster_weights: (K,) float64, w_c.
        per_cluster: samples kept per cluster, floor(r * m) (or the largest size for
            ``uniform``); for the unclustered selectors the samples kept in all; under token
            balance the largest number of samples a cluster kept (all kept, unclustered).
        balance: ``"samples"`` or ``"tokens"``.
        token_budget: tokens kept per cluster under token balance (K times it for the
            unclustered selectors), None under sample balance.
        score: (N,) float64, what the selector orders by (sq_distance for ``peripheral`` and
            ``core``, IFD for ``ifd``, the best cosine to a target for ``rds``, the kept share
            of the sample's trajectory cluster for ``s2l``, the weighted gradient influence on
            its best target for ``less``), nan where it has none (random orders, samples
            ``ifd`` cannot score); None when not recorded.
        cost: what the selection cost (:class:`SelectionCost`), None when not recorded.
        notes: lines for the run's log (warnings) where the selection gives less than the knobs
            asked: a budget the selector could not fill, and why (e.g. ifd's samples with
            IFD <= 1 fewer than its budget).
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
    score: np.ndarray | None = None
    cost: SelectionCost | None = None
    notes: tuple[str, ...] = ()

    @property
    def n_selected(self) -> int:
        """Training examples per epoch, counting oversampled copies."""
        return int(self.copies.sum())

    @property
    def data_fraction(self) -> float:
        """Distinct selected samples / N."""
        return float(self.selected.mean()) if self.selected.size else 0.0


@dataclass(frozen=True)
class SelectorSpec:
    """One registered selector.

    Attributes:
        name: its name in run configs (``peripheral_subsets.selector``).
        summary: one line for the UI's description of ``selector``.
        run: the selector: ``(inputs, params) -> SelectionResult`` (cost added by the
            registry's :func:`~cluster_pipeline.selection.selectors.run_selector`).
        order: where the UI lists it, ascending (the lowest is the default selector).
        needs: the :class:`SelectionInputs` fields (or ``extra`` names) it reads beyond labels
            and K.
        passes: the model passes those inputs come from (``PASS_*``; ``"embedding"`` for the
            pool pass's columns).
        clustered: its subset keeps the clusters (cluster c trains on rank c); otherwise the
            subset is dealt into random balanced shards (selection/sharding.py).
        reweighted: rank c's loss is weighted by w_c (step 5).
        source: where its rule comes from (the paper).
        knobs: its knobs, a pydantic class whose fields join ``peripheral_subsets``' run
            config (each field once, whoever declares it; :class:`NoKnobs`: none).
        gather: ``(knobs, pool, runner) -> Gathered``: its inputs beyond the clustering, from
            the pool pass's table and its own passes (selection/passes.py).
        rules: ``(knobs, facts) -> problems``: what it refuses before any pass, one line each
            (``peripheral_subsets.<knob> = <value>: <rule>``).
        details: what its record keeps: metadata key -> the value recorded when it did not run
            (every selection's record holds every selector's keys).
        budgeted: it keeps a budget set by r (the run checks refuse an r that keeps nothing).
    """

    name: str
    summary: str
    run: Callable[[SelectionInputs, SelectionParams], SelectionResult]
    order: int = 100
    needs: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()
    clustered: bool = False
    reweighted: bool = False
    source: str = field(default="")
    knobs: type[BaseModel] = NoKnobs
    gather: Callable[[Any, Pool, PassRunner], Gathered] = no_passes
    rules: Callable[[Any, SelectionFacts], list[str]] = no_rules
    details: Mapping[str, Any] = field(default_factory=dict)
    budgeted: bool = True


def groups_of(values: np.ndarray | None, at_least: int = 1) -> np.ndarray | None:
    """(n,) int64 each value's group, groups numbered in the order their first member appears
    (a pool's sources, a target set's tasks); None when ``values`` is None or holds fewer than
    ``at_least`` distinct values."""
    if values is None:
        return None
    names = np.asarray(values).astype(str)
    _, first, inverse = np.unique(names, return_index=True, return_inverse=True)
    if len(first) < at_least:
        return None
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


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


def cluster_tokens(inputs: SelectionInputs) -> np.ndarray:
    """(K,) int64 L_c, the clusters' token totals.

    Raises:
        ValueError: no lengths, or a sample of non-positive length.
    """
    if inputs.lengths is None:
        raise ValueError("token balance needs the samples' lengths")
    lengths = np.asarray(inputs.lengths, dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError("every sample needs a positive token length")
    labels = np.asarray(inputs.labels, dtype=np.int64)
    return np.bincount(labels, weights=lengths, minlength=inputs.k).astype(np.int64)


def global_budget(inputs: SelectionInputs, params: SelectionParams) -> int:
    """The unclustered selectors' budget: K * floor(r * m) samples (sample balance) or
    K * floor(r * min_c L_c) tokens (token balance); module docstring.

    Raises:
        ValueError: as :func:`per_cluster_budget` / :func:`token_budget`.
    """
    if params.balance == "tokens":
        return inputs.k * token_budget(cluster_tokens(inputs), params.r)
    sizes = np.bincount(np.asarray(inputs.labels, dtype=np.int64), minlength=inputs.k)
    return inputs.k * per_cluster_budget(sizes, params.r)


def rank_within(labels: np.ndarray, key: np.ndarray, k: int) -> np.ndarray:
    """0-based rank of each sample within its cluster when sorted by ascending key (ties by
    sample index). (N,) int64."""
    order = np.lexsort((np.arange(len(labels)), key, labels))
    ranks = np.empty(len(labels), dtype=np.int64)
    starts = np.searchsorted(labels[order], np.arange(k))
    positions = np.arange(len(labels)) - np.repeat(starts, np.bincount(labels, minlength=k))
    ranks[order] = positions
    return ranks


def prefix_within(labels: np.ndarray, rank: np.ndarray, lengths: np.ndarray, k: int, budget):
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


def global_selection(
    name: str,
    order: np.ndarray,
    inputs: SelectionInputs,
    params: SelectionParams,
    budget: int,
    score: np.ndarray,
) -> SelectionResult:
    """The result of an unclustered selector from its global ``order``: the first ``budget``
    samples of ``order`` (sample balance), or its longest prefix within ``budget`` tokens, at
    least one sample (token balance). Weight 1 everywhere.

    Args:
        name: the selector.
        order: (S,) int64 indices of the samples the selector may keep, best first (S <= N;
            the others are never kept and are ranked after them, in index order).
        inputs: the pool (N samples, K clusters; lengths under token balance).
        params: r, seed and balance.
        budget: samples or tokens (:func:`global_budget`).
        score: (N,) float64 the selector's score.

    Raises:
        ValueError: an empty ``order``.
    """
    n, k = inputs.n, inputs.k
    order = np.asarray(order, dtype=np.int64)
    if len(order) == 0:
        raise ValueError(f"{name}: no sample can be selected")
    rank = np.empty(n, dtype=np.int64)
    rest = np.setdiff1d(np.arange(n), order)
    rank[order] = np.arange(len(order))
    rank[rest] = len(order) + np.arange(len(rest))
    copies = np.zeros(n, dtype=np.int64)
    ones = np.ones(k)
    if params.balance == "tokens":
        lengths = np.asarray(inputs.lengths, dtype=np.int64)
        copies[order[np.cumsum(lengths[order]) <= budget]] = 1
        copies[order[0]] = 1
        return SelectionResult(
            name,
            copies > 0,
            copies,
            rank,
            np.ones(n),
            ones,
            int(copies.sum()),
            "tokens",
            budget,
            score=score,
        )
    copies[order[:budget]] = 1
    return SelectionResult(
        name, copies > 0, copies, rank, np.ones(n), ones, int(copies.sum()), score=score
    )


def keep_first_in_clusters(
    name: str,
    inputs: SelectionInputs,
    params: SelectionParams,
    rank: np.ndarray,
    score: np.ndarray | None,
) -> SelectionResult:
    """The balanced rule of the clustered selectors (docs/design.md, step 3): each cluster keeps
    its first samples in ``rank`` (a sample's 0-based place in its cluster), ``floor(r m)`` of
    them (m the smallest cluster's size) with weight w_c = n_c K / N, or under token balance
    its longest prefix within B = floor(r min_c L_c) tokens with w_c = K R_c / R."""
    labels = np.asarray(inputs.labels, dtype=np.int64)
    k = inputs.k
    copies = np.zeros(inputs.n, dtype=np.int64)
    if params.balance == "tokens":
        lengths = np.asarray(inputs.lengths, dtype=np.int64)
        budget = token_budget(cluster_tokens(inputs), params.r)
        copies[prefix_within(labels, rank, lengths, k, budget)] = 1
        response = np.asarray(inputs.response_tokens, dtype=np.int64)
        weights = cluster_weights(np.bincount(labels, weights=response, minlength=k))
        kept = int(np.bincount(labels[copies > 0], minlength=k).max())
        return SelectionResult(
            name, copies > 0, copies, rank, weights[labels], weights, kept, "tokens", budget,
            score=score,
        )  # fmt: skip
    sizes = np.bincount(labels, minlength=k)
    weights = cluster_weights(sizes)
    keep = per_cluster_budget(sizes, params.r)
    copies[rank < keep] = 1
    return SelectionResult(
        name, copies > 0, copies, rank, weights[labels], weights, keep, score=score
    )
