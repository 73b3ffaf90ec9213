"""K-means plus the optimal capacity step, on hand-checked and property cases."""

import itertools

import numpy as np
import polars as pl
import pytest

from cluster_pipeline.selection.clustering import (
    InfeasibleFlow,
    balanced_kmeans,
    capacity,
    capacity_assignment,
    capacity_assignment_flow,
    cluster_stream,
    dual_bound,
    dual_prices,
    kmeans,
    squared_distances,
)
from cluster_pipeline.selection.embedding_table import l2_normalise


def test_capacity_formula():
    assert capacity(10, 3, 1.0) == 4
    assert capacity(9, 3, 1.0) == 3
    assert capacity(10, 2, 1.2) == 6
    with pytest.raises(ValueError, match="alpha"):
        capacity(10, 2, 0.9)


def test_capacity_assignment_hand_checked():
    # Three samples nearest cluster 0, cap 2: the one that loses least by moving (sample 2,
    # cost 0.2 -> 0.3) goes to cluster 1. Optimum: 0.0 + 0.1 + 0.3 + 0.5 = 0.9.
    d = np.array([[0.0, 1.0], [0.1, 0.9], [0.2, 0.3], [0.9, 0.5]], dtype=np.float32)
    result = capacity_assignment(d, cap=2)
    assert result.labels.tolist() == [0, 0, 1, 1]
    assert result.cost == pytest.approx(0.9) and result.lower_bound == pytest.approx(0.9)


def test_dual_prices_and_bound_hand_checked():
    # Optimal labels [0, 0, 1, 1], both clusters full. Arc 1 -> 0 costs min(0.2 - 0.3,
    # 0.9 - 0.5) = -0.1, arc 0 -> 1 costs min(1.0 - 0.0, 0.9 - 0.1) = 0.8; rooted at cluster 0
    # and shifted to >= 0: p = [0.1, 0]. D(p) = (0.1 + 0.2 + 0.3 + 0.5) - 2 * 0.1 = 0.9 (optimum).
    d = np.array([[0.0, 1.0], [0.1, 0.9], [0.2, 0.3], [0.9, 0.5]], dtype=np.float32)
    p = dual_prices(d, np.array([0, 0, 1, 1]), cap=2)
    np.testing.assert_allclose(p, [0.1, 0.0], atol=1e-7)
    assert dual_bound(d, p, cap=2) == pytest.approx(0.9, abs=1e-6)
    # A worse assignment ([0, 1, 0, 1], cost 1.4) still gets a valid bound: never above 0.9.
    worse = dual_prices(d, np.array([0, 1, 0, 1]), cap=2)
    assert (worse >= 0).all() and dual_bound(d, worse, cap=2) <= 0.9 + 1e-6


def test_capacity_assignment_matches_brute_force():
    rng = np.random.default_rng(0)
    d = rng.random((7, 3)).astype(np.float32)
    cap = 3
    best = min(
        (sum(d[i, c] for i, c in enumerate(assign)), assign)
        for assign in itertools.product(range(3), repeat=7)
        if max(np.bincount(assign, minlength=3)) <= cap
    )
    labels = capacity_assignment(d, cap).labels
    assert float(d[np.arange(7), labels].sum()) == pytest.approx(best[0], abs=1e-5)
    assert capacity_assignment_flow(d, cap).tolist() == labels.tolist()


def test_capacity_assignment_refuses_too_small_caps():
    with pytest.raises(ValueError, match="cannot hold"):
        capacity_assignment(np.zeros((5, 2), np.float32), cap=2)


def _unequal_costs(n, k, seed, distinct=None):
    """(n, k) float32 squared distances of n unit vectors to k centroids, most samples near
    the first centroids (so the caps bind); with ``distinct``, only that many distinct rows."""
    rng = np.random.default_rng(seed)
    centroids = l2_normalise(rng.normal(size=(k, 16)).astype(np.float32))
    m = distinct or n
    x = l2_normalise(
        (centroids[rng.integers(0, max(1, k // 2), m)] + rng.normal(size=(m, 16))).astype(
            np.float32
        )
    )
    if distinct:
        x = x[rng.integers(0, distinct, n)]
    return squared_distances(x, centroids)


@pytest.mark.parametrize(("n", "k", "distinct"), [(240_000, 4, None), (210_000, 3, 5)])
def test_the_certified_boundary_assignment_equals_the_full_flow_optimum(n, k, distinct):
    # Beyond 200,000 samples only the boundary goes through the flow; ties (5 distinct rows
    # repeated 42,000 times each) are all on the boundary.
    d = _unequal_costs(n, k, seed=3, distinct=distinct)
    cap = capacity(n, k, 1.0)
    result = capacity_assignment(d, cap)
    sizes = np.bincount(result.labels, minlength=k)
    assert sizes.sum() == n and sizes.max() <= cap
    assert np.bincount(d.argmin(axis=1), minlength=k).max() > cap  # the caps bind
    assert result.boundary < n or distinct
    full = capacity_assignment_flow(d, cap)
    optimum = float(d[np.arange(n), full].astype(np.float64).sum())
    cost = float(d[np.arange(n), result.labels].astype(np.float64).sum())
    assert cost == pytest.approx(result.cost, rel=1e-12)
    assert abs(cost - optimum) <= 1e-6 * optimum
    assert result.lower_bound <= cost and (cost - result.lower_bound) <= 1e-8 * cost


def test_a_two_pass_stream_clusters_like_the_matrix_it_streams():
    # 3,000 rows, a 500-row k-means sample: the stream is read twice, in batches of 700, ids
    # kept; the same rows fed as one in-memory block give the same clusters.
    x = _blobs([1500, 900, 600])
    ids = pl.Series("sample_id", [f"s{i}" for i in range(len(x))])

    def batches(size):
        return lambda: ((ids[lo : lo + size], x[lo : lo + size]) for lo in range(0, len(x), size))

    a = cluster_stream(batches(700), len(x), 3, alpha=1.0, seed=2, max_train_points=500)
    b = cluster_stream(batches(3000), len(x), 3, alpha=1.0, seed=2, max_train_points=500)
    assert a.kmeans_sample.shape == (500, x.shape[1]) and a.sample_ids.to_list() == ids.to_list()
    np.testing.assert_array_equal(a.result.labels, b.result.labels)
    np.testing.assert_array_equal(a.result.centroids, b.result.centroids)
    rows = [int(s[1:]) for s in a.kmeans_sample_ids.to_list()]
    np.testing.assert_array_equal(a.kmeans_sample, x[rows])
    np.testing.assert_array_equal(a.kmeans_sample_labels, a.result.labels[rows])
    # Without ids (and with a NaN row left out) the sample's labels come by position.
    y = x.copy()
    y[5] = np.nan
    c = cluster_stream(
        lambda: ((None, y[lo : lo + 700]) for lo in range(0, len(y), 700)),
        len(y),
        3,
        seed=2,
        max_train_points=500,
    )
    finite_rows = np.delete(np.arange(len(y)), 5)
    picked = [int(np.flatnonzero((y == row).all(axis=1))[0]) for row in c.kmeans_sample]
    np.testing.assert_array_equal(
        c.kmeans_sample_labels, c.result.labels[np.searchsorted(finite_rows, picked)]
    )
    assert a.result.sizes.max() <= a.result.cap == 1000 and a.result.sizes.sum() == 3000


def _blobs(sizes, d=8, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(len(sizes), d)) * 5
    x = np.concatenate([c + rng.normal(size=(n, d)) for c, n in zip(centers, sizes, strict=True)])
    return l2_normalise(x.astype(np.float32))


@pytest.mark.parametrize(("k", "alpha"), [(2, 1.0), (3, 1.0), (4, 1.5)])
def test_every_sample_in_one_cluster_and_no_cluster_above_cap(k, alpha):
    x = _blobs([70, 20, 10, 30])
    r = balanced_kmeans(x, k, alpha, seed=0)
    assert r.labels.shape == (130,) and set(r.labels.tolist()) <= set(range(k))
    assert r.sizes.sum() == 130 and r.sizes.max() <= r.cap == capacity(130, k, alpha)
    np.testing.assert_allclose(
        r.sq_distance, squared_distances(x, r.centroids)[np.arange(130), r.labels], rtol=1e-6
    )
    assert r.cost >= r.kmeans_cost - 1e-6 and r.cost_increase >= -1e-9


def test_clustering_is_deterministic_for_a_seed():
    x = _blobs([50, 50, 50])
    a, b = balanced_kmeans(x, 3, seed=5), balanced_kmeans(x, 3, seed=5)
    assert (a.labels == b.labels).all()


def test_balanced_input_is_left_as_k_means_found_it():
    x = _blobs([40, 40])
    r = balanced_kmeans(x, 2)
    assert (r.labels == r.kmeans_labels).all() and r.cost_increase == pytest.approx(0.0)


def test_edge_cases():
    x = _blobs([3])
    with pytest.raises(ValueError, match="K=4 clusters from N=3"):
        balanced_kmeans(x, 4)
    one = balanced_kmeans(_blobs([10, 10]), 1)
    assert one.sizes.tolist() == [20] and (one.labels == 0).all()
    same = np.tile(l2_normalise(np.ones((1, 8), np.float32)), (12, 1))
    # Identical rows: every distance ties, so the caps alone decide; exact balance splits them
    # evenly, the default soft cap (6 of 12) fills two clusters and leaves the third empty
    # (peripheral_subsets then refuses the empty cluster).
    assert balanced_kmeans(same, 3, alpha=1.0).sizes.tolist() == [4, 4, 4]
    assert sorted(balanced_kmeans(same, 3).sizes.tolist()) == [0, 6, 6]
    bad = _blobs([5, 5])
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        balanced_kmeans(bad, 2)


def test_the_flow_takes_only_allowed_arcs_and_says_when_they_cannot_fit():
    d = np.array([[0.0, 1.0], [0.1, 0.9], [0.2, 0.3], [0.9, 0.5]], dtype=np.float32)
    # Sample 2 may only join cluster 0, so sample 1 (next cheapest to move) goes to cluster 1.
    allowed = np.array([[1, 1], [1, 1], [1, 0], [1, 1]], dtype=bool)
    assert capacity_assignment_flow(d, 2, allowed).tolist() == [0, 1, 0, 1]
    with pytest.raises(InfeasibleFlow):
        capacity_assignment_flow(d, 2, np.array([[1, 0]] * 4, dtype=bool))


def _labelled_blobs(sizes, d=8, seed=1):
    """Well-separated Gaussian blobs (centres 5 sd apart on average), unnormalised, with their
    blob of origin; the blob partition is the k-means optimum, its inertia known exactly."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sizes), d)) * 5
    x = np.concatenate([c + rng.normal(size=(n, d)) for c, n in zip(centres, sizes, strict=True)])
    return x.astype(np.float32), np.repeat(np.arange(len(sizes)), sizes)


def test_restarts_reach_the_known_optimum_where_one_initialisation_does_not():
    sizes = [400, 300, 200, 100, 60, 40]
    x, blob = _labelled_blobs(sizes)
    means = np.stack([x[blob == c].mean(axis=0) for c in range(6)])
    optimum = float(((x - means[blob]) ** 2).sum())
    # Seed 4's first k-means++ draw puts two centroids in one blob: a local optimum 60 % worse.
    single = kmeans(x, 6, seed=4, restarts=1)
    assert single.inertia > 1.5 * optimum and single.restarts == 1
    best = kmeans(x, 6, seed=4)
    assert best.restarts == 10 and best.inertia == pytest.approx(optimum, rel=1e-4)
    assert best.inertia == min(best.restart_inertias) and best.restart_inertias[0] == single.inertia
    assert all(1 <= i <= best.niter == 300 for i in best.restart_iterations)
    # The optimum is the blob partition: each centroid is one blob's mean.
    labels = squared_distances(x, best.centroids).argmin(axis=1)
    assert all(len(set(labels[blob == c].tolist())) == 1 for c in range(6))
    assert len(set(labels.tolist())) == 6
    # Over ten seeds, single runs miss the optimum several times, ten restarts never.
    singles = [kmeans(x, 6, seed=s, restarts=1).inertia for s in range(10)]
    assert sum(v > 1.01 * optimum for v in singles) >= 2
    assert all(kmeans(x, 6, seed=s).inertia == pytest.approx(optimum, rel=1e-4) for s in range(10))


def test_k_means_records_its_search():
    x = _blobs([50, 30, 20])
    r = balanced_kmeans(x, 3, seed=0, restarts=4, niter=50)
    fit = r.kmeans_fit
    assert fit.sample_size == 100 and fit.restarts == 4 and fit.niter == 50
    assert len(fit.restart_iterations) == 4 and fit.inertia == min(fit.restart_inertias)
    np.testing.assert_array_equal(fit.centroids, r.centroids)
    assert fit.inertia == pytest.approx(r.kmeans_cost, rel=1e-4)
    with pytest.raises(ValueError, match="restarts >= 1"):
        kmeans(x, 3, seed=0, restarts=0)
