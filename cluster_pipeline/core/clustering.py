"""Balanced clustering (docs/design.md, step 2): k-means, then an optimal capacity-constrained
assignment.

K-means (faiss) runs on the L2-normalised proxy embeddings. The capacity step then assigns every
sample to one of the K centroids so that no cluster holds more than ``cap = ceil(alpha * N / K)``
samples, minimising the total squared distance. That is a transportation problem, solved exactly
as a min-cost flow (OR-Tools ``SimpleMinCostFlow``): source -> sample (capacity 1) -> centroid
(cost = squared distance) -> sink (capacity cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from cluster_pipeline.core.tables import TableRef

# Min-cost flow needs integer costs; squared distances of unit vectors lie in [0, 4].
_COST_SCALE = 1e6


@dataclass(frozen=True)
class ClusterResult:
    """Output of :func:`balanced_kmeans` for N samples, d dimensions, K clusters.

    Attributes:
        labels: (N,) int64, cluster after the capacity step.
        kmeans_labels: (N,) int64, nearest centroid (before the capacity step).
        sq_distance: (N,) float32, squared L2 distance to the assigned cluster's centroid.
        centroids: (K, d) float32.
        kmeans_sizes / sizes: (K,) int64, cluster sizes before / after the capacity step.
        cap: the capacity ceil(alpha * N / K).
        kmeans_cost / cost: total squared distance before / after the capacity step.
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

    @property
    def cost_increase(self) -> float:
        """Relative rise of the k-means objective caused by the capacity step (0.02 = 2 %)."""
        return self.cost / self.kmeans_cost - 1.0 if self.kmeans_cost > 0 else 0.0


def capacity(n: int, k: int, alpha: float) -> int:
    """cap = ceil(alpha * N / K) (docs/design.md, step 2).

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


def capacity_assignment(sq_dist: np.ndarray, cap: int) -> np.ndarray:
    """Optimal assignment of N samples to K clusters with at most ``cap`` per cluster.

    Minimises sum_i sq_dist[i, label_i] exactly (min-cost flow; costs rounded to 1e-6).

    Args:
        sq_dist: (N, K) float32 squared distances.
        cap: cluster capacity; must satisfy K * cap >= N.

    Returns:
        (N,) int64 labels.

    Raises:
        ValueError: K * cap < N.
        RuntimeError: the solver reports no optimal flow.
    """
    from ortools.graph.python import min_cost_flow

    n, k = sq_dist.shape
    if k * cap < n:
        raise ValueError(f"K * cap = {k} * {cap} < N = {n}: the clusters cannot hold every sample")
    if k == 1:
        return np.zeros(n, dtype=np.int64)
    source, sink = n + k, n + k + 1
    samples = np.arange(n, dtype=np.int64)
    clusters = n + np.arange(k, dtype=np.int64)
    tails = np.concatenate([np.full(n, source), np.repeat(samples, k), clusters])
    heads = np.concatenate([samples, np.tile(clusters, n), np.full(k, sink)])
    caps = np.concatenate([np.ones(n, np.int64), np.ones(n * k, np.int64), np.full(k, cap)])
    costs = np.concatenate(
        [
            np.zeros(n, np.int64),
            np.rint(sq_dist.astype(np.float64).ravel() * _COST_SCALE).astype(np.int64),
            np.zeros(k, np.int64),
        ]
    )
    flow = min_cost_flow.SimpleMinCostFlow()
    # OR-Tools' type stubs spell the dtype where the shape goes; the arrays are what it takes.
    flow.add_arcs_with_capacity_and_unit_cost(tails, heads, caps, costs)  # pyright: ignore[reportArgumentType]
    supplies = np.zeros(n + k + 2, dtype=np.int64)
    supplies[source], supplies[sink] = n, -n
    flow.set_nodes_supplies(np.arange(n + k + 2), supplies)  # pyright: ignore[reportArgumentType]
    status = flow.solve()
    if status != flow.OPTIMAL:
        raise RuntimeError(f"min-cost flow failed with status {status}")
    # Arcs n .. n + n*k - 1 are the sample -> cluster arcs, in (sample, cluster) order.
    used = np.asarray(flow.flows(np.arange(n, n + n * k))).reshape(n, k)
    return used.argmax(axis=1).astype(np.int64)


def kmeans(x: np.ndarray, k: int, seed: int, niter: int = 25, max_train_points: int = 65536):
    """faiss k-means on rows of x (N, d) float32; returns (K, d) float32 centroids.

    Centroids are trained on a seeded sample of at most ``max_train_points`` rows (faiss's own
    subsampling); every row is then assigned by the caller.
    """
    import faiss

    n, d = x.shape
    km = faiss.Kmeans(
        d,
        k,
        niter=niter,
        seed=seed,
        verbose=False,
        min_points_per_centroid=1,
        max_points_per_centroid=max(1, math.ceil(max_train_points / k)),
    )
    km.train(np.ascontiguousarray(x, dtype=np.float32))
    return np.asarray(km.centroids, dtype=np.float32)


def balanced_kmeans(
    x: np.ndarray, k: int, alpha: float = 1.0, seed: int = 0, niter: int = 25
) -> ClusterResult:
    """K-means on L2-normalised rows of x, then the capacity step (docs/design.md, step 2).

    Args:
        x: (N, d) float32 L2-normalised embeddings; all finite.
        k: number of clusters K (= data-parallel world size).
        alpha: capacity slack, >= 1.
        seed: k-means seed; the result is deterministic for a given seed.

    Raises:
        ValueError: N < K, K < 1, alpha < 1, or non-finite values in x.
    """
    n = x.shape[0]
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot make K={k} clusters from N={n} samples; lower K or add data")
    if not np.isfinite(x).all():
        raise ValueError("embeddings contain NaN or inf; quarantine those samples first")
    cap = capacity(n, k, alpha)
    if k == 1:
        centroids = x.mean(axis=0, keepdims=True).astype(np.float32)
    else:
        centroids = kmeans(x, k, seed, niter)
    dist = squared_distances(x, centroids)
    kmeans_labels = dist.argmin(axis=1).astype(np.int64)
    labels = capacity_assignment(dist, cap)
    rows = np.arange(n)
    return ClusterResult(
        labels=labels,
        kmeans_labels=kmeans_labels,
        sq_distance=dist[rows, labels],
        centroids=centroids,
        kmeans_sizes=np.bincount(kmeans_labels, minlength=k).astype(np.int64),
        sizes=np.bincount(labels, minlength=k).astype(np.int64),
        cap=cap,
        kmeans_cost=float(dist[rows, kmeans_labels].sum()),
        cost=float(dist[rows, labels].sum()),
    )


def read_clusterable(
    embeddings: TableRef, column: str = "embedding_normalised"
) -> tuple[pl.DataFrame, np.ndarray, pl.DataFrame]:
    """Split a ``proxy_embeddings`` table version into (rows to cluster: ``sample_id``, their
    (N, d) float32 vectors from ``column``, rows quarantined for non-finite values). Skipped
    samples are left out; vectors are read batch by batch."""
    rows, matrix = embeddings.read_vectors(column, keep="skip_reason")
    finite = np.asarray(np.isfinite(matrix).all(axis=1))
    if finite.all():
        return rows, matrix, rows.clear()
    keep = pl.Series("finite", finite)
    return rows.filter(keep), matrix[finite], rows.filter(~keep)


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
