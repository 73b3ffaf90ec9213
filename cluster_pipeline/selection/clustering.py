"""Balanced clustering (docs/design.md, step 2): k-means, then an optimal capacity-constrained
assignment, on pools of any size.

K-means (faiss) runs on the L2-normalised proxy embeddings: the centroids are trained on a seeded
sample of at most 65,536 rows, with k-means++ seeding and ``restarts`` runs of up to ``niter``
Lloyd iterations each, keeping the lowest inertia (the CluSTER reference runs scikit-learn's
``KMeans(init="k-means++", n_init=10, max_iter=300)``; faiss stops a run once its objective no
longer falls). Every row is then assigned. The capacity step assigns every sample to one of the
K centroids so that no cluster holds more than ``cap = ceil(alpha * N / K)`` samples, minimising
the total squared distance: a transportation problem with K sinks. It binds only when k-means
leaves a cluster above the cap; with the default alpha = 1.5 (the reference's soft cap) most
pools keep their k-means clusters, unequal sizes and all, and the weights w_c of step 5 depart
from 1. The reference reassigns greedily (sample-centroid pairs in ascending distance, each
sample to the first centroid with room); the flow here is the exact optimum of the same problem,
so its total distance is never higher (``test_clustering.py`` shows a case where greedy is
strictly worse), and it equals the greedy result whenever the cap does not bind.

The embeddings are streamed from their Delta table batch by batch (:func:`cluster_stream`): one
pass gathers the k-means sample, a second computes the (N, K) float32 distance matrix, which is
all that stays in memory (320 MB at N = 10M, K = 8), never the (N, d) embeddings. Small pools take
the same path; when the whole pool is the sample, one pass does.

The capacity step (:func:`capacity_assignment`) is exact without a flow over all N x K arcs:

1. Dual prices p (one per cluster) from the exact optimum of two disjoint seeded subsamples
   (caps scaled); how much the two disagree sets a margin.
2. Every sample whose best cluster under ``sq_dist + p`` leads the runner-up by more than the
   margin is fixed there; the samples within it (the boundary) are assigned by an exact min-cost
   flow (OR-Tools ``SimpleMinCostFlow``) into the capacity left. When the prices are within half
   the margin of optimal ones, some optimum agrees with every fixed sample, so this is exact.
3. Certificate: LP duality. For any p >= 0, ``D(p) = sum_i min_c (d_ic + p_c) - cap * sum_c p_c``
   is a lower bound on the optimum (weak duality of the transportation LP; e.g. Ahuja, Magnanti
   & Orlin, *Network Flows*, 1993, ch. 9). The prices that certify an assignment are shortest-path
   distances in the K-node graph whose arc l -> d costs ``min_{i in l} (d_id - d_il)`` (no
   negative cycle <=> optimal). The step returns when ``cost - D(p) <= tolerance * cost``;
   otherwise the margin doubles (up to the whole pool, which is the plain flow).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import polars as pl

from cluster_pipeline.storage.tables import TableRef, vectors_to_series

# A stream of embeddings: (sample ids or None, (b, d) float32 rows) batches; a fresh iterator
# per call, in the same rows each time.
Batches = Callable[[], Iterable[tuple[pl.Series | None, np.ndarray]]]

# Relative duality gap at which the capacity step stops (flow costs are integers at 1e-9 of the
# cost range per sample, so an optimal assignment certifies far below this).
GAP_TOLERANCE = 1e-8
# Samples in the two subsamples that price the clusters (pools up to this size: one flow).
_PRICE_SAMPLE = 200_000
# The margin a zero spread doubles from (distances are squared distances of unit vectors).
_MIN_MARGIN = 1e-9
# Rows per block when a (b, K) temporary is formed over the distance matrix.
_BLOCK = 1 << 20
# The capacity slack of the CluSTER reference (a cap of 1.5 N / K, binding only above it).
DEFAULT_ALPHA = 1.5


@dataclass(frozen=True)
class ClusterResult:
    """Output of :func:`balanced_kmeans` / :func:`cluster_stream` for N samples, K clusters.

    Attributes:
        labels: (N,) int64, cluster after the capacity step.
        kmeans_labels: (N,) int64, nearest centroid (before the capacity step).
        sq_distance: (N,) float32, squared L2 distance to the assigned cluster's centroid.
        centroids: (K, d) float32.
        kmeans_sizes / sizes: (K,) int64, cluster sizes before / after the capacity step.
        cap: the capacity ceil(alpha * N / K).
        kmeans_cost / cost: total squared distance before / after the capacity step.
        lower_bound: the LP dual bound D(p) certifying ``cost`` (module docstring); the optimum
            lies in [lower_bound, cost].
        boundary_samples: samples the exact flow assigned (0 when k-means already fit the caps).
        kmeans_fit: how the centroids were found (sample size, restarts, inertias).
    """

    labels: np.ndarray
    kmeans_labels: np.ndarray
    sq_distance: np.ndarray
    centroids: np.ndarray
    kmeans_sizes: np.ndarray
    sizes: np.ndarray
    cap: int
    kmeans_cost: float
    cost: float
    lower_bound: float
    boundary_samples: int
    kmeans_fit: KMeansFit

    @property
    def cost_increase(self) -> float:
        """Relative rise of the k-means objective caused by the capacity step (0.02 = 2 %)."""
        return self.cost / self.kmeans_cost - 1.0 if self.kmeans_cost > 0 else 0.0

    @property
    def optimality_gap(self) -> float:
        """(cost - lower_bound) / cost: how far above the optimum ``cost`` can be, at most."""
        return (self.cost - self.lower_bound) / self.cost if self.cost > 0 else 0.0

    def summary(self, weights: Iterable[float]) -> list[str]:
        """Three lines for a run's log (each short enough to read whole: issue 44): sizes
        before and after the capacity step, the cap and what the step cost; the k-means search;
        the clusters' ``weights`` n_c K / N (the ranks' weights under ``balance: samples``;
        token balance weights by response tokens)."""
        fit = self.kmeans_fit
        return [
            f"K={len(self.sizes)}: sizes {self.sizes.tolist()} (k-means "
            f"{self.kmeans_sizes.tolist()}), cap {self.cap}, "
            f"cost +{100 * self.cost_increase:.2f}% (optimal within "
            f"{100 * self.optimality_gap:.1e}%; {self.boundary_samples} samples by flow)",
            f"k-means: best of {fit.restarts} runs on {fit.sample_size} samples (inertia "
            f"{fit.inertia:.4f}, runs {min(fit.restart_inertias):.4f}-"
            f"{max(fit.restart_inertias):.4f}, {max(fit.restart_iterations)} iterations at most)",
            f"cluster weights by size, n_c K / N = {[round(float(w), 4) for w in weights]}: "
            "the ranks' weights only under balance: samples; peripheral_subsets sets and logs "
            "the weights a run trains with",
        ]


@dataclass(frozen=True)
class CapacityAssignment:
    """Output of :func:`capacity_assignment`: ``labels`` (N,) int64, their ``cost`` and the
    certified ``lower_bound`` on the optimum (float64 sums of float32 distances), and the number
    of ``boundary`` samples the flow solved."""

    labels: np.ndarray
    cost: float
    lower_bound: float
    boundary: int


def capacity(n: int, k: int, alpha: float) -> int:
    """Cap = ceil(alpha * N / K) (docs/design.md, step 2).

    The reference reassigns when the largest k-means cluster exceeds 1.5 N / K, with this cap;
    a largest size between 1.5 N / K and the cap reassigns nothing there (no cluster is full
    before its own samples are placed), so the rule is: the cap binds when a cluster exceeds
    ``cap``, as :func:`capacity_assignment` applies it.

    Raises:
        ValueError: alpha < 1 (the caps could not hold all N samples).
    """
    if alpha < 1.0:
        raise ValueError(f"alpha must be >= 1 (alpha = 1 is exact balance), got {alpha}")
    # Round before ceil so alpha * N / K = 3.0000000000000004 gives 3, not 4.
    return math.ceil(round(alpha * n / k, 9))


def squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """(N, K) float32 squared L2 distances between rows of x (N, d) and centroids (K, d)."""
    # einsum: row norms without an (N, d) temporary.
    d = x @ (-2.0 * centroids.T)
    d += np.einsum("ij,ij->i", x, x)[:, None]
    d += np.einsum("ij,ij->i", centroids, centroids)[None, :]
    return np.maximum(d, 0.0, out=d).astype(np.float32, copy=False)


class InfeasibleFlow(RuntimeError):
    """The allowed (sample, cluster) arcs cannot place every sample within the capacities."""


def capacity_assignment_flow(
    sq_dist: np.ndarray, caps: int | np.ndarray, allowed: np.ndarray | None = None
) -> np.ndarray:
    """Optimal assignment of N samples to K clusters, cluster c holding at most ``caps[c]``,
    by one min-cost flow over all N x K arcs: source -> sample (capacity 1) -> cluster (cost =
    squared distance) -> sink (capacity caps[c]). The reference solver; memory grows with N * K.

    Costs are reduced per row (subtracting a sample's smallest distance changes no optimum) and
    rounded to integers at 1e-9 of their range.

    Args:
        sq_dist: (N, K) float32 squared distances.
        caps: one capacity for every cluster, or (K,) int64 capacities; sum >= N.
        allowed: optional (N, K) bool, the clusters each sample may take (default: all).

    Returns:
        (N,) int64 labels.

    Raises:
        ValueError: the capacities sum below N.
        InfeasibleFlow: ``allowed`` leaves no way to place every sample.
        RuntimeError: the solver reports no optimal flow for another reason.
    """
    from ortools.graph.python import min_cost_flow

    n, k = sq_dist.shape
    caps = np.broadcast_to(np.asarray(caps, dtype=np.int64), (k,))
    if int(caps.sum()) < n:
        raise ValueError(
            f"K * cap = {int(caps.sum())} < N = {n}: the clusters cannot hold every sample"
        )
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    source, sink = n + k, n + k + 1
    if allowed is None:
        arc_sample, arc_cluster = np.repeat(np.arange(n), k), np.tile(np.arange(k), n)
    else:
        arc_sample, arc_cluster = np.nonzero(allowed)
    m = len(arc_sample)
    # Reduced per sample (its smallest distance subtracted), on the arcs only.
    reduced = sq_dist[arc_sample, arc_cluster].astype(np.float64)
    reduced -= sq_dist.min(axis=1).astype(np.float64)[arc_sample]
    top = float(reduced.max()) if m else 0.0
    scale = 1e9 / top if top > 0 else 1.0
    costs = np.concatenate(
        [np.zeros(n, np.int64), np.rint(reduced * scale).astype(np.int64), np.zeros(k, np.int64)]
    )
    del reduced
    tails = np.concatenate([np.full(n, source), arc_sample, n + np.arange(k)])
    heads = np.concatenate([np.arange(n), n + arc_cluster, np.full(k, sink)])
    arc_caps = np.concatenate([np.ones(n + m, np.int64), caps])
    flow = min_cost_flow.SimpleMinCostFlow()
    # OR-Tools' type stubs spell the dtype where the shape goes; the arrays are what it takes.
    flow.add_arcs_with_capacity_and_unit_cost(tails, heads, arc_caps, costs)  # pyright: ignore[reportArgumentType]
    del tails, heads, arc_caps, costs
    supplies = np.zeros(n + k + 2, dtype=np.int64)
    supplies[source], supplies[sink] = n, -n
    flow.set_nodes_supplies(np.arange(n + k + 2), supplies)  # pyright: ignore[reportArgumentType]
    status = flow.solve()
    if status == flow.INFEASIBLE:
        raise InfeasibleFlow("the allowed arcs cannot place every sample within the caps")
    if status != flow.OPTIMAL:
        raise RuntimeError(f"min-cost flow failed with status {status}")
    # Arcs n .. n + m - 1 are the sample -> cluster arcs, in (sample, cluster) order.
    used = np.asarray(flow.flows(np.arange(n, n + m))) > 0
    labels = np.empty(n, dtype=np.int64)
    labels[arc_sample[used]] = arc_cluster[used]
    return labels


def dual_prices(sq_dist: np.ndarray, labels: np.ndarray, cap: int | np.ndarray) -> np.ndarray:
    """Cluster prices p (K,) float64 >= 0 that certify ``labels`` when it is optimal.

    p_l is the shortest-path distance from l to the clusters below ``cap`` (price 0) in the K-node
    graph with arc l -> d of cost ``w_ld = min_{i: label_i = l} (d_id - d_il)``: then every sample
    is at a cheapest cluster under ``d + p`` and only full clusters have a positive price, the
    complementary slackness of the transportation LP. When every cluster is full, distances are
    taken to the cluster that is cheapest to reach. A negative cycle (a non-optimal assignment)
    leaves prices that still give a valid, looser, bound (they are clipped at 0).
    """
    n, k = sq_dist.shape
    w = np.full((k, k), np.inf)
    for lo in range(0, n, _BLOCK):
        d = sq_dist[lo : lo + _BLOCK].astype(np.float64)
        lab = labels[lo : lo + _BLOCK]
        own = d[np.arange(len(d)), lab]
        for c in np.unique(lab):
            rows = lab == c
            w[c] = np.minimum(w[c], (d[rows] - own[rows, None]).min(axis=0))
    sizes = np.bincount(labels, minlength=k)
    free = sizes < np.broadcast_to(cap, (k,))
    dist = np.where(free, 0.0, np.inf)
    if not free.any():
        dist[0] = 0.0
    for _ in range(k):
        dist = np.minimum(dist, (w + dist[None, :]).min(axis=1))
    dist = np.where(np.isfinite(dist), dist, 0.0)
    if not free.any():
        dist -= dist.min()
    return np.maximum(dist, 0.0)


def dual_bound(sq_dist: np.ndarray, prices: np.ndarray, cap: int) -> float:
    """D(p) = sum_i min_c (d_ic + p_c) - cap * sum_c p_c: a lower bound on the cost of every
    assignment with at most ``cap`` per cluster, for any prices p >= 0 (weak LP duality)."""
    total = 0.0
    for lo in range(0, len(sq_dist), _BLOCK):
        total += float((sq_dist[lo : lo + _BLOCK] + prices[None, :]).min(axis=1).sum())
    return total - cap * float(prices.sum())


def _boundary_solve(
    sq_dist: np.ndarray, cap: int, prices: np.ndarray, margin: float
) -> tuple[np.ndarray, int, float]:
    """Fix every sample at its cheapest cluster under ``sq_dist + prices`` unless its lead over
    the runner-up is <= ``margin``; assign those (the boundary) by exact flow into the capacity
    the fixed samples leave, each to a cluster within the margin of its best. The margin doubles
    until that is feasible. Returns (labels, boundary size, margin used)."""
    n, k = sq_dist.shape
    p = prices.astype(np.float32)[None, :]
    best = np.empty(n, dtype=np.int64)
    lead = np.empty(n, dtype=np.float32)
    for lo in range(0, n, _BLOCK):
        r = sq_dist[lo : lo + _BLOCK] + p
        best[lo : lo + len(r)] = r.argmin(axis=1)
        two = np.partition(r, 1, axis=1)
        lead[lo : lo + len(r)] = two[:, 1] - two[:, 0]
    while True:
        inside = lead <= margin
        left = cap - np.bincount(best[~inside], minlength=k)
        if (left >= 0).all():
            rows = np.flatnonzero(inside)
            r = sq_dist[rows] + p
            # Only the clusters within the margin of a sample's best: an optimum under prices
            # within half the margin of optimal ones uses no other arc.
            allowed = r <= r.min(axis=1, keepdims=True) + margin
            del r
            try:
                best[rows] = capacity_assignment_flow(sq_dist[rows], left, allowed)
                return best, len(rows), margin
            except InfeasibleFlow:
                pass
        margin = max(2 * margin, _MIN_MARGIN)


def _sample_prices(sq_dist: np.ndarray, cap: int, seed: int) -> tuple[np.ndarray, float]:
    """Prices from two disjoint seeded subsamples (each solved exactly, caps scaled): their
    mean, and three times their largest difference as the margin within which a sample's
    cluster is left to the flow (the error of the mean is about half that difference)."""
    n = sq_dist.shape[0]
    rng = np.random.default_rng(seed)
    half = _PRICE_SAMPLE // 2
    drawn = rng.choice(n, size=2 * half, replace=False)
    estimates = []
    for part in (np.sort(drawn[:half]), np.sort(drawn[half:])):
        part_cap = math.ceil(cap * half / n)
        labels = capacity_assignment_flow(sq_dist[part], part_cap)
        estimates.append(dual_prices(sq_dist[part], labels, part_cap))
    spread = float(np.abs(estimates[0] - estimates[1]).max())
    scale = float(sq_dist[drawn].max() - sq_dist[drawn].min())
    return (estimates[0] + estimates[1]) / 2, max(3.0 * spread, 1e-6 * scale)


def capacity_assignment(
    sq_dist: np.ndarray, cap: int, seed: int = 0, tolerance: float = GAP_TOLERANCE
) -> CapacityAssignment:
    """Optimal assignment of N samples to K clusters with at most ``cap`` per cluster,
    minimising sum_i sq_dist[i, label_i], certified by an LP dual bound (module docstring).

    Memory: a few (N,) arrays beside the input, and a flow over the boundary only (the samples
    whose cluster the subsample prices leave uncertain); pools of up to 200,000 samples are
    solved by one flow outright.

    Args:
        sq_dist: (N, K) float32 squared distances.
        cap: cluster capacity; must satisfy K * cap >= N.
        seed: seed of the subsamples that give the first prices.
        tolerance: stop when (cost - bound) <= tolerance * cost.

    Raises:
        ValueError: K * cap < N.
        RuntimeError: the flow solver reports no optimal flow.
    """
    n, k = sq_dist.shape
    if k * cap < n:
        raise ValueError(f"K * cap = {k} * {cap} < N = {n}: the clusters cannot hold every sample")
    labels = sq_dist.argmin(axis=1).astype(np.int64)
    solved = 0
    if k > 1 and n and np.bincount(labels, minlength=k).max() > cap:
        if n <= _PRICE_SAMPLE:
            prices, margin = np.zeros(k), np.inf
        else:
            prices, margin = _sample_prices(sq_dist, cap, seed)
        while True:
            labels, solved, margin = _boundary_solve(sq_dist, cap, prices, margin)
            cost = _cost(sq_dist, labels)
            bound = dual_bound(sq_dist, dual_prices(sq_dist, labels, cap), cap)
            if cost - bound <= tolerance * cost or solved >= n:
                return CapacityAssignment(labels, cost, bound, solved)
            margin = max(2 * margin, _MIN_MARGIN)
    cost = _cost(sq_dist, labels)
    return CapacityAssignment(labels, cost, cost, solved)


def _cost(sq_dist: np.ndarray, labels: np.ndarray) -> float:
    return float(sq_dist[np.arange(len(labels)), labels].astype(np.float64).sum())


# Defaults of the k-means search: the CluSTER reference's n_init and max_iter.
KMEANS_RESTARTS = 10
KMEANS_NITER = 300


@dataclass(frozen=True)
class KMeansFit:
    """The centroids of the best of several k-means runs on one sample.

    Attributes:
        centroids: (K, d) float32, of the run with the lowest inertia.
        inertia: that run's sum of squared distances of the sample to its nearest centroid.
        restart_inertias: each run's final inertia, in run order.
        restart_iterations: Lloyd iterations each run took (< niter when it converged).
        sample_size: rows the centroids were trained on.
        niter: the iteration limit per run.
    """

    centroids: np.ndarray
    inertia: float
    restart_inertias: tuple[float, ...]
    restart_iterations: tuple[int, ...]
    sample_size: int
    niter: int

    @property
    def restarts(self) -> int:
        """k-means runs made."""
        return len(self.restart_inertias)


def kmeans(
    x: np.ndarray,
    k: int,
    seed: int,
    niter: int = KMEANS_NITER,
    restarts: int = KMEANS_RESTARTS,
) -> KMeansFit:
    """Faiss k-means on all rows of x (n, d) float32 (the caller samples): ``restarts`` runs,
    each seeded by k-means++ (Arthur & Vassilvitskii 2007: every next centroid drawn with
    probability proportional to its squared distance to the nearest one chosen; faiss's
    ``ClusteringInitMethod_KMEANS_PLUS_PLUS``) and refined by up to ``niter`` Lloyd iterations,
    stopping early once the objective stops falling; the run with the lowest inertia wins.
    Run r is seeded by ``(seed, r)``, so the result is deterministic for a given seed.

    K = 1 needs no search: the centroid is the mean (one "run", 0 iterations).

    Raises:
        ValueError: K < 1, restarts < 1, niter < 1 or fewer rows than K.
    """
    import faiss

    n, d = x.shape
    if k < 1 or restarts < 1 or niter < 1:
        raise ValueError(f"need K >= 1, restarts >= 1 and niter >= 1, got {k}, {restarts}, {niter}")
    if n < k:
        raise ValueError(f"cannot make K={k} clusters from {n} rows")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if k == 1:
        centroid = x.mean(axis=0, dtype=np.float64).astype(np.float32)[None, :]
        inertia = float(squared_distances(x, centroid).astype(np.float64).sum())
        return KMeansFit(centroid, inertia, (inertia,), (0,), n, niter)
    best: np.ndarray | None = None
    inertias: list[float] = []
    iterations: list[int] = []
    for r in range(restarts):
        km = faiss.Kmeans(
            d,
            k,
            niter=niter,
            seed=int(np.random.default_rng([seed, r]).integers(2**31 - 1)),
            init_method=faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS,
            verbose=False,
            min_points_per_centroid=1,
            # No subsampling: the caller's sample is what k-means sees.
            max_points_per_centroid=max(1, math.ceil(n / k)),
        )
        inertias.append(float(km.train(x)))  # the final objective: the inertia
        iterations.append(len(km.iteration_stats or ()))
        if best is None or inertias[-1] < min(inertias[:-1]):
            best = np.asarray(km.centroids, dtype=np.float32)
    assert best is not None
    return KMeansFit(best, min(inertias), tuple(inertias), tuple(iterations), n, niter)


@dataclass(frozen=True)
class StreamedClusters:
    """Output of :func:`cluster_stream`.

    Attributes:
        result: the clustering of the N finite rows, in stream order.
        sample_ids: (N,) String ids of those rows (null where the stream gave no ids).
        quarantined: ids of the rows left out for NaN or inf values, in stream order.
        kmeans_sample: (m, d) float32, the seeded rows the centroids were trained on
            (m <= 65,536); kmeans_sample_ids their ids, kmeans_sample_labels (m,) int64 their
            clusters after the capacity step (for plots).
    """

    result: ClusterResult
    sample_ids: pl.Series
    quarantined: pl.Series
    kmeans_sample: np.ndarray
    kmeans_sample_ids: pl.Series
    kmeans_sample_labels: np.ndarray


def cluster_stream(
    batches: Batches,
    n_rows: int,
    k: int,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    niter: int = KMEANS_NITER,
    max_train_points: int = 65536,
    restarts: int = KMEANS_RESTARTS,
) -> StreamedClusters:
    """Balanced k-means over a stream of L2-normalised embeddings (docs/design.md, step 2).

    Pass 1 gathers a seeded sample of at most ``max_train_points`` rows (all rows when the
    stream is no longer) and finds the non-finite rows; faiss k-means trains on the sample. Pass
    2 (skipped when the sample is the whole stream) fills the (N, K) float32 distance matrix.
    Then :func:`capacity_assignment`. Peak memory: the distance matrix, the sample and one
    batch; never the (N, d) embeddings.

    Args:
        batches: a fresh iterator of (ids or None, (b, d) float32) batches per call, the same
            rows each time (e.g. :meth:`TableRef.vector_batches`).
        n_rows: rows the stream yields (an upper bound is enough), for drawing the sample.
        k: number of clusters K (= data-parallel world size).
        alpha: capacity slack, >= 1 (1.5, the reference's soft cap; 1 = exact balance).
        seed: seed of the sample, of k-means and of the capacity step's subsample; the result
            is deterministic for a given seed and stream.
        niter: Lloyd iterations at most per k-means run (:func:`kmeans`).
        max_train_points: rows of the seeded sample k-means trains on.
        restarts: k-means runs from different k-means++ seedings (:func:`kmeans`).

    Raises:
        ValueError: K < 1, alpha < 1, fewer finite rows than K, or batches of unequal width.
    """
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    rng = np.random.default_rng(seed)
    whole = n_rows <= max_train_points
    wanted = None if whole else np.sort(rng.choice(n_rows, size=max_train_points, replace=False))
    sample_parts: list[np.ndarray] = []
    sample_rows: list[np.ndarray] = []
    sample_id_parts: list[pl.Series] = []
    bad_ids: list[pl.Series] = []
    total = None
    n = seen = 0
    for ids, x in batches():
        finite = _finite_rows(x)
        if ids is not None and not finite.all():
            bad_ids.append(ids.filter(pl.Series(~finite)))
        if wanted is None:
            take = finite
        else:
            lo, hi = np.searchsorted(wanted, [seen, seen + len(x)])
            take = np.zeros(len(x), dtype=bool)
            take[wanted[lo:hi] - seen] = True
            take &= finite
        sample_parts.append(x[take])
        # Where the sampled rows fall among the finite rows, for streams without ids.
        sample_rows.append(n + np.flatnonzero(take[finite]))
        sample_id_parts.append(
            ids.filter(pl.Series(take))
            if ids is not None
            else pl.Series([None] * int(take.sum()), dtype=pl.String)
        )
        if k == 1:
            part = x[finite].sum(axis=0, dtype=np.float64)
            total = part if total is None else total + part
        n += int(finite.sum())
        seen += len(x)
    quarantined = pl.concat(bad_ids) if bad_ids else pl.Series("sample_id", [], dtype=pl.String)
    if n < k:
        raise ValueError(f"cannot make K={k} clusters from N={n} samples; lower K or add data")
    widths = {part.shape[1] for part in sample_parts if len(part)}
    if len(widths) > 1:
        raise ValueError(f"embedding batches have different widths {sorted(widths)}")
    sample = np.concatenate([p for p in sample_parts if len(p)]) if n else np.zeros((0, 0))
    sample_ids = pl.concat(sample_id_parts)
    del sample_parts, sample_id_parts
    cap = capacity(n, k, alpha)
    if total is not None:  # K = 1: the centroid is the mean of the whole stream
        centroids = (total / n).astype(np.float32)[None, :]
        inertia = float(squared_distances(sample, centroids).astype(np.float64).sum())
        fit = KMeansFit(centroids, inertia, (inertia,), (0,), len(sample), niter)
    else:
        fit = kmeans(sample, k, seed, niter, restarts)
        centroids = fit.centroids
    if whole:
        dist, ids_all = squared_distances(sample, centroids), sample_ids
    else:
        dist = np.empty((n, k), dtype=np.float32)
        id_parts: list[pl.Series] = []
        row = 0
        for ids, x in batches():
            finite = _finite_rows(x)
            x = x if finite.all() else x[finite]
            dist[row : row + len(x)] = squared_distances(x, centroids)
            id_parts.append(
                ids.filter(pl.Series(finite))
                if ids is not None
                else pl.Series([None] * len(x), dtype=pl.String)
            )
            row += len(x)
        if row != n:
            raise ValueError(
                f"the stream gave {row} finite rows on its second pass, {n} on its first"
            )
        ids_all = pl.concat(id_parts)
    kmeans_labels = dist.argmin(axis=1).astype(np.int64)
    assignment = capacity_assignment(dist, cap, seed=seed)
    labels = assignment.labels
    rows = np.arange(n)
    result = ClusterResult(
        labels=labels,
        kmeans_labels=kmeans_labels,
        sq_distance=dist[rows, labels],
        centroids=centroids,
        kmeans_sizes=np.bincount(kmeans_labels, minlength=k).astype(np.int64),
        sizes=np.bincount(labels, minlength=k).astype(np.int64),
        cap=cap,
        kmeans_cost=float(dist[rows, kmeans_labels].astype(np.float64).sum()),
        cost=assignment.cost,
        lower_bound=assignment.lower_bound,
        boundary_samples=assignment.boundary,
        kmeans_fit=fit,
    )
    if whole:
        sample_labels = labels
    elif ids_all.null_count():
        # No ids (an in-memory stream): both passes yield the same rows in the same order.
        sample_labels = labels[np.concatenate(sample_rows)]
    else:
        # Rows are matched by id: the two passes need not yield batches in one order.
        position = (
            ids_all.to_frame("sample_id")
            .with_row_index("i")
            .join(sample_ids.to_frame("sample_id"), on="sample_id", how="right")["i"]
        )
        sample_labels = labels[position.fill_null(0).to_numpy()]
    return StreamedClusters(
        result=result,
        sample_ids=ids_all.rename("sample_id"),
        quarantined=quarantined.rename("sample_id"),
        kmeans_sample=sample,
        kmeans_sample_ids=sample_ids.rename("sample_id"),
        kmeans_sample_labels=sample_labels,
    )


def _finite_rows(x: np.ndarray) -> np.ndarray:
    """(b,) bool: rows of x without NaN or inf."""
    return np.asarray(np.isfinite(x).all(axis=1), dtype=bool)


def balanced_kmeans(
    x: np.ndarray,
    k: int,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    niter: int = KMEANS_NITER,
    restarts: int = KMEANS_RESTARTS,
) -> ClusterResult:
    """:func:`cluster_stream` over an in-memory (N, d) float32 matrix of L2-normalised rows.

    Raises:
        ValueError: N < K, K < 1, alpha < 1, or non-finite values in x.
    """
    if not np.isfinite(x).all():
        raise ValueError("embeddings contain NaN or inf; quarantine those samples first")
    blocks = range(0, len(x), _BLOCK)
    return cluster_stream(
        lambda: ((None, x[lo : lo + _BLOCK]) for lo in blocks),
        len(x),
        k,
        alpha,
        seed,
        niter,
        restarts=restarts,
    ).result


def cluster_table(
    embeddings: TableRef,
    column: str,
    k: int,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    niter: int = KMEANS_NITER,
    batch_rows: int = 65536,
    restarts: int = KMEANS_RESTARTS,
) -> StreamedClusters:
    """:func:`cluster_stream` over ``column`` of a ``proxy_embeddings`` table version, read
    ``batch_rows`` at a time. Skipped samples (``skip_reason`` set) are left out; samples with
    NaN or inf values are quarantined by id.

    Raises:
        ValueError: see :func:`cluster_stream`.
    """
    return cluster_stream(
        lambda: embeddings.vector_batches(column, keep="skip_reason", batch_rows=batch_rows),
        embeddings.row_count(),
        k,
        alpha,
        seed,
        niter,
        restarts=restarts,
    )


def cluster_frames(streamed: StreamedClusters) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The two tables of a clustering, for N clustered samples and K clusters.

    Returns:
        The assignment: ``sample_id`` (String), ``cluster`` (Int64, after the capacity step),
        ``kmeans_cluster`` (Int64, nearest centroid), ``sq_distance`` (Float32, squared L2 to
        its cluster's centroid); N rows in stream order. And the centroids: ``cluster``,
        ``centroid`` (List[Float32] of width d), ``size`` and ``kmeans_size`` (Int64); K rows.
    """
    result = streamed.result
    frame = streamed.sample_ids.to_frame().with_columns(
        pl.Series("cluster", result.labels),
        pl.Series("kmeans_cluster", result.kmeans_labels),
        pl.Series("sq_distance", result.sq_distance),
    )
    centroids = pl.DataFrame({"cluster": np.arange(len(result.sizes))}).with_columns(
        vectors_to_series("centroid", result.centroids),
        pl.Series("size", result.sizes),
        pl.Series("kmeans_size", result.kmeans_sizes),
    )
    return frame, centroids


def check_capacity(
    sample_ids: pl.Series, labels: np.ndarray, k: int, n: int, cap: int
) -> tuple[bool, str]:
    """Independent check of a capacity-constrained assignment: every one of the ``n`` samples
    in exactly one cluster (ids unique, sizes sum to n) and no cluster above ``cap``.

    Returns (passed, description with the sizes)."""
    sizes = np.bincount(labels, minlength=k)
    unique = sample_ids.n_unique() == len(sample_ids)
    passed = unique and int(sizes.sum()) == n and int(sizes.max()) <= cap
    return bool(passed), (
        f"sizes {sizes.tolist()} (sum {int(sizes.sum())}, N {n}), cap {cap}, "
        f"sample ids unique: {unique}"
    )
