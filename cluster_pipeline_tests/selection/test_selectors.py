"""Selectors and weights on hand-checked clusters."""

import numpy as np
import pytest

from cluster_pipeline.selection.selectors import cluster_weights, per_cluster_budget, select

# Cluster 0: samples 0-5 (n=6), cluster 1: samples 6-9 (n=4). N=10, K=2, m=4.
LABELS = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
DIST = np.array([0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.4, 0.8, 0.05, 0.6], dtype=np.float32)


def test_weights_are_n_c_k_over_n():
    np.testing.assert_allclose(cluster_weights(np.array([6, 4])), [1.2, 0.8])
    np.testing.assert_allclose(cluster_weights(np.array([5, 5, 10])), [0.75, 0.75, 1.5])


def test_peripheral_keeps_the_farthest_of_each_cluster():
    r = select(LABELS, DIST, 2, "peripheral", r=0.5)  # floor(0.5 * 4) = 2 per cluster
    assert r.per_cluster == 2
    assert np.flatnonzero(r.selected).tolist() == [1, 4, 7, 9]
    assert r.selection_rank[[1, 4, 2, 3, 5, 0]].tolist() == [0, 1, 2, 3, 4, 5]
    np.testing.assert_allclose(r.weight[r.selected], [1.2, 1.2, 0.8, 0.8])
    assert r.data_fraction == pytest.approx(0.4)


def test_core_keeps_the_nearest():
    r = select(LABELS, DIST, 2, "core", r=0.5)
    assert np.flatnonzero(r.selected).tolist() == [0, 5, 6, 8]


def test_random_keeps_the_budget_per_cluster_and_is_seeded():
    a = select(LABELS, DIST, 2, "random", r=0.75, seed=1)
    b = select(LABELS, DIST, 2, "random", r=0.75, seed=1)
    assert (a.selected == b.selected).all()
    assert np.bincount(LABELS[a.selected]).tolist() == [3, 3]


def test_uniform_oversamples_every_cluster_to_the_largest():
    r = select(LABELS, DIST, 2, "uniform")
    assert np.bincount(LABELS, weights=r.copies).tolist() == [6, 6]
    assert r.selected.all() and (r.copies[:6] == 1).all() and r.copies[6:].sum() == 6
    assert (r.weight == 1).all()


def test_random_global_same_budget_and_full():
    g = select(LABELS, DIST, 2, "random_global", r=0.5)
    assert g.copies.sum() == 4 and (g.weight == 1).all()
    f = select(LABELS, DIST, 2, "full")
    assert f.selected.all() and f.n_selected == 10


def test_budget_errors_give_sizes():
    with pytest.raises(ValueError, match=r"floor\(0.2 \* 4\) = 0.*\[6, 4\]"):
        select(LABELS, DIST, 2, "peripheral", r=0.2)
    with pytest.raises(ValueError, match="r must be in"):
        per_cluster_budget(np.array([3, 3]), 0.0)
    with pytest.raises(ValueError, match="unknown selector"):
        select(LABELS, DIST, 2, "best")
