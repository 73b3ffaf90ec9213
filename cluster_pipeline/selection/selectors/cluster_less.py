"""``cluster_less``: LESS scored per cluster, from the gradients of a few samples of each
(DataFlex, OpenDCAI: ``src/dataflex/train/selector/cluster_less_selector.py``, its
``ClusterLessSelector``).

LESS (selection/selectors/less.py) takes one gradient per pool sample; this variant clusters
the pool first, takes the gradients of a few representatives of each cluster, and scores the
whole cluster by the LESS influence of their mean gradient:

    k = ceil(N / cluster_size) clusters of the pool's representations      (lines 289-296)
    R_c = min(samples_per_cluster, |c|) random members of cluster c          (lines 524-542)
    g_c(theta_i) = normalise(mean_{z in R_c} Gamma(z, theta_i))               (lines 626-633)
    score(c) = sum_i eta_i mean_{z' in targets} cos(g_c(theta_i), grad l(z'; theta_i))
                                                                             (line 635)

Gamma(z, theta_i) is less's projected, L2-normalised Adam-preconditioned LoRA gradient at warm-up
checkpoint theta_i and grad l(z'; theta_i) the target's (less's passes: the same warm-up, the
same per-sample cache, so a representative's gradient is paid once for both selectors). Every
sample takes its cluster's score, and the samples are kept in that order, best cluster first
(whole clusters, the last one cut; within a cluster by index), up to the unclustered budget
(``base``: K floor(r m) samples, or K B tokens under token balance), as DataFlex's
``torch.topk`` over the sample scores (lines 636-638); weights are 1 and the subset is dealt
into random balanced shards.

The defaults are DataFlex's: ``cluster_less_cluster_size`` 64, ``cluster_less_samples_per_
cluster`` 3, random representatives, the mean over the target samples (DataFlex has no
subtasks). Departures: DataFlex selects during training, at the model's current step with its
optimizer state; here, as ``less``, at the checkpoints of less's warm-up, their influences
weighted by eta_i (with one checkpoint, DataFlex's formula). Its clustering embeds the pool with
the model's last hidden states averaged over every token and runs Lloyd's k-means from a random
start (20 iterations); here the pool pass's ``hidden_mean_normalised`` (the mean over the
response positions, no extra pass) and faiss's k-means (k-means++ start, 20 iterations, one
run). The k-means and the representatives are seeded by a fixed seed (0, as less's warm-up
share), so every selection seed selects the same subset (DataFlex: its run's seed).

Cost: the embedding pass (the clustering's representation, shared), less's warm-up, and at
each of its C checkpoints one forward and one backward pass per representative (about
samples_per_cluster / cluster_size of the pool: 4.7 % by default) and per target sample.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from cluster_pipeline.selection.clustering import kmeans, squared_distances
from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    Gathered,
    PassRunner,
    Pool,
    SelectionFacts,
    knob,
)
from cluster_pipeline.selection.selectors import less
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
)

# DataFlex's clustering iterations (clustering_max_iter).
CLUSTER_LESS_NITER = 20


class ClusterLessKnobs(less.LessPassKnobs):
    """cluster_less's knobs: less's (its target set, warm-up, preconditioning and projection)
    and its clusters."""

    cluster_less_cluster_size: int = Field(
        default=64,
        ge=1,
        description="cluster_less only: samples per cluster on average: k = ceil(N / this) "
        "k-means clusters of the pool (DataFlex's 64).",
    )
    cluster_less_samples_per_cluster: int = Field(
        default=3,
        ge=1,
        description="cluster_less only: random representatives per cluster whose gradients are "
        "averaged (DataFlex's 3); the only pool samples whose gradients are taken.",
    )


def pool_clusters(features: np.ndarray, cluster_size: int, seed: int) -> np.ndarray:
    """(N,) int64 each sample's cluster: faiss k-means with k = ceil(N / cluster_size) (at most
    N) on ``features`` (N, d), nearest centroid (module docstring)."""
    n = len(features)
    k = max(1, min(math.ceil(n / max(1, cluster_size)), n))
    x = np.ascontiguousarray(features, dtype=np.float32)
    fit = kmeans(x, k, seed, niter=CLUSTER_LESS_NITER, restarts=1)
    return squared_distances(x, fit.centroids).argmin(axis=1).astype(np.int64)


def representatives(labels: np.ndarray, per_cluster: int, seed: int) -> np.ndarray:
    """(R,) int64 sorted pool indices: min(per_cluster, |c|) random members of every non-empty
    cluster c (a seeded permutation of each cluster's members, in cluster order)."""
    rng = np.random.default_rng(seed)
    chosen = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        chosen.append(members[rng.permutation(len(members))[:per_cluster]])
    return np.sort(np.concatenate(chosen)).astype(np.int64)


def cluster_scores(
    labels: np.ndarray,
    reps: np.ndarray,
    rep_gradients: np.ndarray,
    targets: np.ndarray,
    learning_rates: np.ndarray,
) -> np.ndarray:
    """(G,) float64 score(c) (module docstring) for clusters 0..G-1 (G = labels.max() + 1; 0
    for a cluster without a representative).

    Args:
        labels: (N,) int64 cluster per pool sample.
        reps: (R,) int64 pool indices of the representatives.
        rep_gradients: (R, C, d) float32 their normalised projected gradients.
        targets: (M, C, d) float32 the target samples' normalised projected gradients.
        learning_rates: (C,) eta_i (renormalised to sum 1).
    """
    eta = less.checkpoint_weights(learning_rates)
    g = int(labels.max()) + 1
    rep_clusters = labels[reps]
    summed = np.zeros((g, *rep_gradients.shape[1:]))
    np.add.at(summed, rep_clusters, rep_gradients.astype(np.float64))
    counts = np.maximum(np.bincount(rep_clusters, minlength=g), 1)
    mean = summed / counts[:, None, None]
    mean /= np.maximum(np.linalg.norm(mean, axis=2, keepdims=True), 1e-12)
    # sum_i eta_i mean_j <g_c(i), t_j(i)> = sum_i eta_i <g_c(i), mean_j t_j(i)>
    target_mean = np.asarray(targets, dtype=np.float64).mean(axis=0)  # (C, d)
    return np.einsum("gcd,cd,c->g", mean, target_mean, eta)


def cluster_less(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Every sample scored by its cluster's LESS influence, the best clusters kept up to the
    global budget (module docstring).

    Raises:
        ValueError: inputs of mismatched shapes.
    """
    labels = inputs.get("cluster_less_labels")
    reps = inputs.get("cluster_less_representatives")
    grads = inputs.get("cluster_less_gradients")
    targets, eta = inputs.less_target_gradients, inputs.less_learning_rates
    assert labels is not None and reps is not None and grads is not None
    assert targets is not None and eta is not None  # run_selector checks the needs
    if len(labels) != inputs.n or len(grads) != len(reps):
        raise ValueError(
            f"cluster_less: {len(labels)} cluster labels for {inputs.n} samples, "
            f"{len(grads)} gradients for {len(reps)} representatives"
        )
    if len(targets) == 0:
        raise ValueError("cluster_less: the target set has no sample with a gradient")
    labels = np.asarray(labels, dtype=np.int64)
    score = cluster_scores(labels, np.asarray(reps, dtype=np.int64), grads, targets, eta)[labels]
    index = np.arange(inputs.n)
    order = index[np.lexsort((index, -score))]
    budget = global_budget(inputs, params)
    return global_selection("cluster_less", order, inputs, params, budget, score)


def gather(knobs: ClusterLessKnobs, pool: Pool, runner: PassRunner) -> Gathered:
    """The pool's clusters (on the pool pass's ``hidden_mean_normalised``) and their
    representatives (seed 0, module docstring), then less's passes with the pool's gradients
    taken for the representatives only (less.gradient_passes).

    Raises:
        PassFailed: no target sample has a response token.
    """
    features = runner.pool_vectors("hidden_mean_normalised")
    labels = pool_clusters(features, knobs.cluster_less_cluster_size, less.LESS_SEED)
    reps = representatives(labels, knobs.cluster_less_samples_per_cluster, less.LESS_SEED)
    runner.log(
        f"cluster_less: {len(np.unique(labels))} clusters of the {pool.n} samples, "
        f"{len(reps)} representatives"
    )
    got = less.gradient_passes(knobs, pool, runner, tuple(reps.tolist()), who="cluster_less")
    return Gathered(
        inputs={
            "cluster_less_labels": labels,
            "cluster_less_representatives": reps,
            "cluster_less_gradients": got.pool,
            "less_target_gradients": got.targets,
            "less_learning_rates": np.asarray(got.warmup.learning_rates),
            "target_tasks": got.tasks,
        },
        passes=got.costs,
        details={**got.details(knobs), "cluster_less_clusters": len(np.unique(labels))},
    )


def rules(knobs: ClusterLessKnobs, facts: SelectionFacts) -> list[str]:
    """Less's rules, and at least one cluster's worth of samples where N is known."""
    problems = less.rules(knobs, facts)
    size = knobs.cluster_less_cluster_size
    if facts.pool_size is not None and size > facts.pool_size:
        problems.append(
            f"{knob('cluster_less_cluster_size', size)}: more than the {facts.pool_size} "
            f"{facts.pool_is}, so every sample would be one cluster; lower it"
        )
    return problems


SELECTORS = (
    SelectorSpec(
        "cluster_less",
        "DataFlex's cluster-LESS: k-means clusters of the pool, each scored by the LESS "
        "influence of the mean gradient of 3 of its samples on the target set "
        "(peripheral_subsets.target), the best clusters kept (peripheral_subsets.less_*, "
        "cluster_less_*)",
        cluster_less,
        order=55,
        needs=(
            "cluster_less_labels",
            "cluster_less_representatives",
            "cluster_less_gradients",
            "less_target_gradients",
            "less_learning_rates",
        ),
        passes=(
            PASS_EMBEDDING,
            less.PASS_LESS_WARMUP,
            less.PASS_LESS_GRADIENTS,
            less.PASS_LESS_TARGETS,
        ),
        source="DataFlex (OpenDCAI), cluster_less_selector.py; LESS: Xia et al. 2024",
        knobs=ClusterLessKnobs,
        gather=gather,
        rules=rules,
        details={"cluster_less_clusters": 0},
    ),
)
