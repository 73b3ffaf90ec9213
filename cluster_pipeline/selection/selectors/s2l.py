"""``s2l``: SmallToLarge (Yang et al. 2024, *SmallToLarge (S2L): Scalable Data Selection for
Fine-tuning Large Language Models by Summarizing Training Trajectories of Small Models*,
NeurIPS 2024, arXiv 2403.07384; the authors' code, ``schedules/s2l.py``).

A proxy model is trained on the whole pool and saved at T checkpoints; each sample's loss at
each checkpoint is its training trajectory

    traj_i = (l_i(1), .., l_i(T))           l_i(t) = (1/|A_i|) sum_{a in A_i} -log P_t(a | ...)

(``SelectionInputs.loss_trajectories``, (N, T) float32, the mean token loss of the response
under checkpoint t). Samples whose trajectories are close have close gradients throughout
training (the paper's Theorem 4.1), so k-means on the trajectories (C clusters, Euclidean;
``S2LKnobs.s2l_clusters``, the paper's 100 by default) groups samples that teach the
same thing, and the subset is drawn evenly across those groups, small groups first
(Algorithm 1):

    sort the clusters C_1 .. C_C by size, ascending; R = the budget
    for k = 1 .. C:   R_k = floor(R / (C - k + 1))                 (what is left, spread evenly)
                      take min(|C_k|, R_k) samples of C_k uniformly at random;  R -= taken

so clusters smaller than their share are kept whole and the rest of the budget is spread
evenly over the larger ones (the floor as in the authors' code, ``n // (len - i)``; the last
cluster takes what is left).

As released (``schedules/s2l.py``), two steps frame Algorithm 1. First the budget is split
over the pool's sources the same way, smallest source first, ``n_per_source = num //
(sources left)``, a source no larger than its share kept whole, and k-means and Algorithm 1 run
within each larger source on its own trajectories (lines 54-79; ``sources`` ranked by
``np.argsort`` of their counts, ties here by name). A sample's source is its record's
``source`` field, as the authors' data has (line 21), else its ``dataset`` field, else the file
it was read from (``defs/pass_runner.record_sources``; a pool of one file without such fields is
one source). Second, within a source, the trajectory clusters of at
most 2 samples are set aside and drawn from only for what the others leave (lines 121-144).
``s2l_sources: false`` and ``s2l_small_clusters: algorithm_1`` give Algorithm 1 alone over the
whole pool (this project's rule before issue 41).

The budget is the unclustered one (``base``: K floor(r m) samples, or K B tokens under token
balance), so ``s2l`` is compared with ``peripheral`` at equal data; weights are 1 and the
subset is dealt into random balanced shards, as for the paper's other baselines.

Token balance: the same algorithm in tokens. Sources and clusters are sorted by their token
totals, ascending; each takes floor(R / (left)) tokens: the longest prefix of its seeded random
order whose tokens stay within it (all of it when it fits), and R falls by the tokens kept (at
least one sample is kept in all). The set-aside clusters are still those of at most 2 samples.

``selection_rank`` is the order of the draw: the kept samples in the order taken (source by
source, cluster by cluster, in the sorted orders), then the remaining samples. The score is
the share of the sample's trajectory cluster that was kept (min(|C_k|, R_k) / |C_k| under
Algorithm 1 and sample balance: every member's chance of being drawn; 1 for a source kept
whole, which is not clustered).

Departures from the paper and the authors' code: the proxy is the base model itself trained
briefly on the pool (``peripheral_subsets.s2l_steps``, T = ``s2l_checkpoints`` checkpoints
evenly spaced), not a separate smaller model trained for 3 epochs; any local causal LM works
the same way. Non-finite losses count as 0, as the authors' code sets them. k-means is faiss's
(k-means++ seeding, one run of up to 20 Lloyd iterations, the authors' ``niter=20``), seeded by
the selection seed, with at most as many clusters as the source has samples (faiss refuses
fewer points than centroids); the draws are a seeded permutation's prefix, not
``np.random.choice`` (the same distribution).

Cost: the proxy's training (``s2l_steps`` optimizer steps over the pool: one forward and one
backward pass per sample visit, counted in the cost record) plus T loss passes of N forwards
(the embedding pass under each checkpoint, cached per sample); the selection itself is k-means
on an (N, T) matrix, O(N T C) per iteration.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
from pydantic import BaseModel, Field

from cluster_pipeline.selection.clustering import kmeans, squared_distances
from cluster_pipeline.selection.passes import (
    BriefTraining,
    ForwardPass,
    Gathered,
    PassRunner,
    Pool,
    SelectionFacts,
    checkpoint_rules,
    knob,
)
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
)
from cluster_pipeline.storage.names import S2L_TRAJECTORIES

# The authors' faiss k-means iterations (schedules/s2l.py, faiss.Kmeans(niter=20)).
S2L_NITER = 20
# Trajectory clusters by default: the paper's (Yang et al. 2024, its MathInstruct runs).
S2L_CLUSTERS = 100
# s2l's own passes: the proxy's training, and its loss pass under each proxy checkpoint.
PASS_S2L_PROXY = "s2l_proxy"
PASS_S2L_LOSS = "s2l_loss"


class S2LKnobs(BaseModel):
    """s2l's knobs: its proxy run and its trajectory clusters."""

    s2l_steps: int = Field(
        default=8,
        ge=1,
        description="s2l only: optimizer steps of the proxy run (the base model trained on the "
        "whole clustered pool, under torchrun with proxy_embeddings' world size, the project's "
        "training batch sizes); a multiple of s2l_checkpoints. Sized for a CPU: the paper "
        "trains its proxy for 3 epochs.",
    )
    s2l_checkpoints: int = Field(
        default=4,
        ge=2,
        description="s2l only: T, the proxy checkpoints (every s2l_steps / T steps) whose "
        "per-sample losses make each sample's loss trajectory; one loss pass over the pool "
        "each.",
    )
    s2l_clusters: int = Field(
        default=S2L_CLUSTERS,
        ge=1,
        description="s2l only: k-means clusters of the loss trajectories (the paper's 100), at "
        "most the pool size; the budget is drawn evenly across them, small ones whole.",
    )
    s2l_sources: bool = Field(
        default=True,
        description="s2l only: split the budget evenly over the pool's sources (a record's "
        "source or dataset field, else its file), smallest first, and cluster within each, as "
        "the authors' code; false = one k-means over the whole pool.",
    )
    s2l_small_clusters: Literal["set_aside", "algorithm_1"] = Field(
        default="set_aside",
        description="s2l only: set_aside = the authors' code, trajectory clusters of at most 2 "
        "samples drawn from only for what the others leave; algorithm_1 = the paper's "
        "Algorithm 1, every cluster in the even split.",
    )
    s2l_learning_rate: float = Field(
        default=1e-4,
        gt=0.0,
        description="s2l only: peak AdamW learning rate of the proxy run (the project's "
        "training default; the paper's 2e-5 moves a short run's losses little).",
    )


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


# The authors' set-aside rule: trajectory clusters of at most this many samples are drawn
# from only for what the others leave (schedules/s2l.py:126).
SMALL_CLUSTER = 2


def _take(members: np.ndarray, quota: int, weights: np.ndarray | None) -> tuple[int, int]:
    """How many of ``members`` (in their drawn order) fit ``quota`` samples or tokens, and what
    they spend."""
    if weights is None:
        take = min(len(members), quota)
        return take, take
    running = np.cumsum(weights[members])
    take = int(np.searchsorted(running, quota, side="right"))
    return take, int(running[take - 1]) if take else 0


def balanced_sampling(
    labels: np.ndarray,
    budget: int,
    seed: int | np.random.Generator,
    lengths: np.ndarray | None = None,
    set_aside: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 (module docstring): the samples drawn evenly across clusters, small first;
    with ``set_aside``, the authors' rule (``schedules/s2l.py:121-144``): clusters of at most 2
    samples wait, and are drawn from, in one seeded order, only for what the others leave.

    Args:
        labels: (N,) int64 trajectory cluster per sample (empty cluster ids are ignored).
        budget: samples to draw, or tokens when ``lengths`` is given.
        seed: seeds the draw within each cluster (or the generator to draw with).
        lengths: (N,) int64 tokens per sample: the budget and the clusters' sizes are in tokens.
        set_aside: the authors' rule for clusters of at most 2 samples.

    Returns:
        ((N,) int64 the draw order: the kept samples in the order taken, then the rest;
        (N,) bool kept, none when the budget holds no sample).
    """
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    weights = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    size = np.bincount(labels, weights=weights)
    count = np.bincount(labels)
    present = np.flatnonzero(count > 0)
    small = present[count[present] <= SMALL_CLUSTER] if set_aside else present[:0]
    big = np.setdiff1d(present, small)
    # Ascending by size (samples or tokens), ties by cluster id.
    ordered = big[np.lexsort((big, size[big]))]
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    taken: list[np.ndarray] = []
    rest: list[np.ndarray] = []
    remaining = int(budget)
    for i, c in enumerate(ordered):
        members = np.flatnonzero(labels == c)
        members = members[rng.permutation(len(members))]
        take, spent = _take(members, remaining // (len(ordered) - i), weights)
        taken.append(members[:take])
        rest.append(members[take:])
        remaining -= spent
    if len(small):
        members = np.flatnonzero(np.isin(labels, small))
        members = members[rng.permutation(len(members))]
        take, spent = _take(members, max(remaining, 0), weights)
        taken.append(members[:take])
        rest.append(members[take:])
    kept = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    left = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    # Nothing kept when the budget holds no sample (a source's share of 0, as the authors'
    # ``np.random.choice(indices, 0)``): keeping one here would overspend the budget once per
    # such source; ``source_split`` keeps one sample in all.
    selected = np.zeros(n, dtype=bool)
    selected[kept] = True
    return np.concatenate([kept, left]).astype(np.int64), selected


def source_split(
    trajectories: np.ndarray,
    sources: np.ndarray | None,
    budget: int,
    clusters: int,
    seed: int,
    lengths: np.ndarray | None = None,
    set_aside: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The authors' selection (``schedules/s2l.py:54-79``, module docstring): the budget split
    evenly over the sources, smallest first; a source no larger than its share kept whole, the
    others k-means-clustered on their trajectories and drawn from by :func:`balanced_sampling`.

    Args:
        trajectories: (N, T) float32 loss trajectories.
        sources: (N,) str each sample's source; None: one source.
        budget: samples, or tokens when ``lengths`` is given.
        clusters: trajectory clusters per source (at most its samples).
        seed: seeds the k-means and the draws.
        lengths: (N,) int64 tokens per sample (token balance).
        set_aside: the authors' rule for clusters of at most 2 samples.

    Returns:
        ((N,) int64 the draw order; (N,) bool kept; (N,) int64 each sample's trajectory
        cluster, numbered across sources; -1 in a source kept whole).
    """
    n = len(trajectories)
    names = np.zeros(n, dtype=str) if sources is None else np.asarray(sources).astype(str)
    unique, source = np.unique(names, return_inverse=True)
    source = source.reshape(-1)
    weights = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    size = np.bincount(source, weights=weights, minlength=len(unique))
    ordered = np.argsort(size, kind="stable")  # ascending; ties by name (np.unique's order)
    rng = np.random.default_rng(seed)
    groups = np.full(n, -1, dtype=np.int64)
    taken: list[np.ndarray] = []
    rest: list[np.ndarray] = []
    remaining, offset = int(budget), 0
    for i, s in enumerate(ordered):
        members = np.flatnonzero(source == s)
        quota = remaining // (len(ordered) - i)
        if size[s] <= quota:
            taken.append(members)
            remaining -= int(size[s])
            continue
        local = trajectory_clusters(trajectories[members], min(clusters, len(members)), seed)
        groups[members] = local + offset
        offset += int(local.max()) + 1
        sub_lengths = None if weights is None else weights[members]
        order, kept = balanced_sampling(local, quota, rng, sub_lengths, set_aside)
        taken.append(members[order[: int(kept.sum())]])
        rest.append(members[order[int(kept.sum()) :]])
        remaining -= quota if weights is None else int(weights[members[kept]].sum())
    kept_all = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    left = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
    if len(kept_all) == 0:
        kept_all, left = left[:1], left[1:]
    selected = np.zeros(n, dtype=bool)
    selected[kept_all] = True
    return np.concatenate([kept_all, left]).astype(np.int64), selected, groups


def s2l(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The authors' source split, k-means on the loss trajectories within each source, then
    Algorithm 1 (with their small-cluster rule) up to the global budget (module docstring);
    score = the kept share of the sample's trajectory cluster.

    Raises:
        ValueError: trajectories not (N, T) for the pool's N, sources not one per sample, or a
            cluster count out of range.
    """
    trajectories = inputs.loss_trajectories
    assert trajectories is not None  # run_selector checks the needs
    n = inputs.n
    if trajectories.ndim != 2 or len(trajectories) != n:
        raise ValueError(
            f"s2l: loss trajectories of shape {trajectories.shape} for a pool of {n} samples"
        )
    knobs = params.knobs
    assert isinstance(knobs, S2LKnobs)  # run_selector gives a selector its own knobs
    sources = inputs.sources if knobs.s2l_sources else None
    if sources is not None and len(sources) != n:
        raise ValueError(f"s2l: {len(sources)} sources for a pool of {n} samples")
    if not 1 <= knobs.s2l_clusters <= n:
        raise ValueError(
            f"s2l: cannot make {knobs.s2l_clusters} trajectory clusters from {n} samples; set "
            "peripheral_subsets.s2l_clusters between 1 and the pool size"
        )
    budget = global_budget(inputs, params)
    by_tokens = params.balance == "tokens"
    lengths = np.asarray(inputs.lengths, dtype=np.int64) if by_tokens else None
    set_aside = knobs.s2l_small_clusters == "set_aside"
    order, selected, groups = source_split(
        trajectories, sources, budget, knobs.s2l_clusters, params.seed, lengths, set_aside
    )
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    score = np.ones(n, dtype=np.float64)
    clustered = groups >= 0
    if clustered.any():
        g = groups[clustered]
        share = np.bincount(g, weights=selected[clustered]) / np.maximum(np.bincount(g), 1)
        score[clustered] = share[g]
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
        score=score,
    )


def unclustered_sources(sources: np.ndarray | None, n: int, clusters: int) -> str | None:
    """The line naming the sources with no more samples than ``clusters``: k-means makes each of
    their samples a trajectory cluster of its own (``source_split`` asks for at most as many
    clusters as a source has samples), so wherever such a source is drawn from, the draw is
    uniformly random. The authors' ``faiss.Kmeans(d, n_components)`` stops on a source with
    fewer samples than clusters (``schedules/s2l.py:113-114``); this project goes on and says so.

    Args:
        sources: (N,) str each sample's source; None: the pool is one source.
        n: the pool's samples N.
        clusters: ``s2l_clusters``.

    Returns:
        None when every source has more samples; else the line, naming the first five such
        sources (name order, with their sizes) and how many more, and the ``s2l_clusters`` that
        would cluster the largest of them (none when each has one sample).
    """
    if sources is None:
        if n > clusters:
            return None
        return (
            f"s2l: the pool has {n} samples, no more than s2l_clusters ({clusters}): each is a "
            "trajectory cluster of its own, so the draw is uniformly random (the authors' faiss "
            "k-means stops on fewer samples than clusters); peripheral_subsets.s2l_clusters "
            f"below {n} gives trajectory clusters"
        )
    names, sizes = np.unique(np.asarray(sources).astype(str), return_counts=True)
    few = sizes <= clusters
    if not few.any():
        return None
    pairs = list(zip(names[few].tolist(), sizes[few].tolist(), strict=True))
    listing = ", ".join(f"{name!r} ({size})" for name, size in pairs[:5])
    if len(pairs) > 5:
        listing += f" and {len(pairs) - 5} more"
    largest = max(size for _, size in pairs)
    advice = (
        f"; peripheral_subsets.s2l_clusters below {largest} gives trajectory clusters in the "
        "largest of them"
        if largest >= 2
        else ""
    )
    return (
        f"s2l: {len(pairs)} of the {len(names)} sources {'has' if len(pairs) == 1 else 'have'} "
        f"no more samples than s2l_clusters "
        f"({clusters}): {listing}; each of their samples is a trajectory cluster of its own, so "
        "their shares are drawn uniformly at random (the authors' faiss k-means stops on fewer "
        f"samples than clusters){advice}"
    )


def gather(knobs: S2LKnobs, pool: Pool, runner: PassRunner) -> Gathered:
    """s2l's passes: the proxy run over the whole pool (reused when finished, resumed when
    killed), then one loss pass per checkpoint, cached per sample under the checkpoint's own
    key; each sample's ``mean_loss`` under checkpoint t is entry t of its trajectory. The
    trajectories are written as the ``s2l_trajectories`` table."""
    proxy = runner.train(
        BriefTraining(
            PASS_S2L_PROXY,
            "s2l proxy",
            knobs.s2l_steps,
            knobs.s2l_checkpoints,
            knobs.s2l_learning_rate,
        )
    )
    columns, costs = [], [proxy.cost]
    for ckpt in proxy.checkpoints:
        label = f"s2l loss pass, proxy step {ckpt.step}"
        out = runner.forward(ForwardPass(PASS_S2L_LOSS, model=ckpt.path, label=label))
        columns.append(out.values["mean_loss"])
        costs.append(out.cost)
    trajectories = np.stack(columns, axis=1).astype(np.float32)
    sources = runner.pool_sources() if knobs.s2l_sources else None
    runner.write_table(
        S2L_TRAJECTORIES,
        pl.DataFrame(
            {"sample_id": list(pool.sample_ids), "loss_trajectory": trajectories.tolist()},
            schema={"sample_id": pl.String, "loss_trajectory": pl.List(pl.Float32)},
        ),
    )
    inputs = {"loss_trajectories": trajectories}
    if sources is not None:
        inputs["sources"] = sources
        runner.log(f"s2l: {len(set(sources.tolist()))} source(s) in the pool")
    line = unclustered_sources(sources, pool.n, knobs.s2l_clusters)
    if line:
        runner.log(line)
    return Gathered(
        inputs=inputs,
        passes=tuple(costs),
        details={
            "s2l_proxy_checkpoints": [c.path for c in proxy.checkpoints],
            "s2l_checkpoint_steps": [c.step for c in proxy.checkpoints],
        },
    )


def rules(knobs: S2LKnobs, facts: SelectionFacts) -> list[str]:
    """A step count that the checkpoints divide (a checkpoint every s2l_steps /
    s2l_checkpoints steps), and at most N trajectory clusters where N is known."""
    problems = checkpoint_rules(
        "s2l_steps", knobs.s2l_steps, "s2l_checkpoints", knobs.s2l_checkpoints, "proxy"
    )
    if facts.pool_size is not None and knobs.s2l_clusters > facts.pool_size:
        problems.append(
            f"{knob('s2l_clusters', knobs.s2l_clusters)}: more trajectory clusters than the "
            f"{facts.pool_size} {facts.pool_is}; lower it"
        )
    return problems


SELECTORS = (
    SelectorSpec(
        "s2l",
        "SmallToLarge: k-means on each sample's loss trajectory over the checkpoints of a "
        "proxy trained briefly on the pool (peripheral_subsets.s2l_steps, s2l_checkpoints), "
        "then the same budget drawn evenly across the trajectory clusters, small ones whole",
        s2l,
        order=40,
        needs=("loss_trajectories",),
        passes=(PASS_S2L_PROXY, PASS_S2L_LOSS),
        source="Yang et al. 2024, SmallToLarge (S2L), NeurIPS 2024",
        knobs=S2LKnobs,
        gather=gather,
        rules=rules,
        # The proxy's checkpoints whose losses are the trajectories, and their steps (less
        # records its warm-up's under the same keys).
        details={"s2l_proxy_checkpoints": [], "s2l_checkpoint_steps": []},
    ),
)
