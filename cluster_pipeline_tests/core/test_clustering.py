"""K-means plus the optimal capacity step, on hand-checked and property cases."""

import itertools

import numpy as np
import pytest

from cluster_pipeline.core.clustering import (
    balanced_kmeans,
    capacity,
    capacity_assignment,
    squared_distances,
)
from cluster_pipeline.core.embedding import l2_normalise


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
    labels = capacity_assignment(d, cap=2)
    assert labels.tolist() == [0, 0, 1, 1]


def test_capacity_assignment_matches_brute_force():
    rng = np.random.default_rng(0)
    d = rng.random((7, 3)).astype(np.float32)
    cap = 3
    best = min(
        (sum(d[i, c] for i, c in enumerate(assign)), assign)
        for assign in itertools.product(range(3), repeat=7)
        if max(np.bincount(assign, minlength=3)) <= cap
    )
    labels = capacity_assignment(d, cap)
    assert float(d[np.arange(7), labels].sum()) == pytest.approx(best[0], abs=1e-5)


def test_capacity_assignment_refuses_too_small_caps():
    with pytest.raises(ValueError, match="cannot hold"):
        capacity_assignment(np.zeros((5, 2), np.float32), cap=2)


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
    r = balanced_kmeans(same, 3)
    assert r.sizes.tolist() == [4, 4, 4]
    bad = _blobs([5, 5])
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        balanced_kmeans(bad, 2)
