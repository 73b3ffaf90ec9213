"""The published rule, written out plainly from the CluSTER reference's description, against the
product's capacity step, selector and weights on fixed centroids.

The reference (kaist-dmlab/CluSTER, ``call_back.py``): k-means labels; if the largest cluster
holds more than 1.5 N / K samples, reassign greedily under ``cap = ceil(1.5 N / K)`` (every
(sample, centroid) pair in ascending distance, each sample to the first centroid with room);
m = the smallest cluster after that; keep the ``floor(r m)`` farthest samples of every cluster
(its ``--prune close``, which prunes the close ones); rank c's weight ``K n_c / N``.
"""

import math

import numpy as np
import pytest

from cluster_pipeline.selection.clustering import capacity, capacity_assignment, squared_distances
from cluster_pipeline.selection.selectors import select


def reference_rule(x, centroids, alpha, r):
    """(labels, selected sample indices, weights) by the reference's rule, in plain loops."""
    n, k = len(x), len(centroids)
    dist = [[float(((x[i] - centroids[c]) ** 2).sum()) for c in range(k)] for i in range(n)]
    labels = [min(range(k), key=lambda c, i=i: dist[i][c]) for i in range(n)]
    sizes = [labels.count(c) for c in range(k)]
    if max(sizes) > alpha * n / k:
        cap = math.ceil(alpha * n / k)
        pairs = sorted((dist[i][c], i, c) for i in range(n) for c in range(k))
        labels = [-1] * n
        counts = [0] * k
        for _, i, c in pairs:
            if labels[i] == -1 and counts[c] < cap:
                labels[i] = c
                counts[c] += 1
        sizes = counts
    m = min(sizes)
    keep = math.floor(r * m)
    selected = []
    for c in range(k):
        members = [i for i in range(n) if labels[i] == c]
        members.sort(key=lambda i: dist[i][c], reverse=True)
        selected += members[:keep]
    weights = [k * sizes[c] / n for c in range(k)]
    return labels, sorted(selected), weights


def product_rule(x, centroids, alpha, r):
    d = squared_distances(x, centroids)
    labels = capacity_assignment(d, capacity(len(x), len(centroids), alpha)).labels
    sel = select(labels, d[np.arange(len(x)), labels], len(centroids), "peripheral", r)
    return labels.tolist(), np.flatnonzero(sel.selected).tolist(), sel.cluster_weights.tolist()


def _line_blobs(sizes, seed=0):
    """Samples of cluster c spread along a line towards the next centroid, so that the samples
    farthest from an overfull centroid are the cheapest to move (greedy = optimum there)."""
    rng = np.random.default_rng(seed)
    k = len(sizes)
    centroids = np.stack([[10.0 * c, 0.0] for c in range(k)]).astype(np.float32)
    parts = []
    for c, n in enumerate(sizes):
        t = np.sort(rng.uniform(0.0, 4.0, n))
        parts.append(np.stack([10.0 * c + t, np.zeros(n)], axis=1))
    return np.concatenate(parts).astype(np.float32), centroids


@pytest.mark.parametrize(
    ("sizes", "alpha", "r", "binds", "expected_sizes", "expected_keep"),
    [
        # Unequal, under the cap (ceil(1.5 * 100 / 3) = 50): k-means sizes stand.
        ([30, 50, 20], 1.5, 0.5, False, [30, 50, 20], 10),
        # 1.5 N / K = 75.75 and the largest is 76 = the cap: the reference reassigns, but
        # nothing moves.
        ([76, 25], 1.5, 1.0, False, [76, 25], 25),
        # 80 of 100 nearest one centroid: the cap (50) binds, 30 move to the next one.
        ([80, 15, 5], 1.5, 0.6, True, [50, 45, 5], 3),
        # Exact balance (alpha = 1): 60 per cluster of 120; every weight 1.
        ([90, 30], 1.0, 0.5, True, [60, 60], 30),
    ],
)
def test_the_product_selects_the_reference_rules_samples_with_its_weights(
    sizes, alpha, r, binds, expected_sizes, expected_keep
):
    x, centroids = _line_blobs(sizes)
    n, k = len(x), len(sizes)
    labels, selected, weights = reference_rule(x, centroids, alpha, r)
    ours = product_rule(x, centroids, alpha, r)
    assert ours[0] == labels
    assert ours[1] == selected
    np.testing.assert_allclose(ours[2], weights, rtol=1e-12)
    # The expected values, by hand: sizes after the cap, floor(r * m) kept, w_c = K n_c / N.
    assert [labels.count(c) for c in range(k)] == expected_sizes
    assert len(selected) == k * expected_keep
    np.testing.assert_allclose(weights, [k * s / n for s in expected_sizes], rtol=1e-12)
    assert (max(sizes) > capacity(n, k, alpha)) == binds


def test_the_exact_flow_beats_the_greedy_cap_where_they_differ():
    # Four samples nearest cluster 0, cap ceil(1.5 * 4 / 2) = 3. Greedy fills cluster 0 with
    # the three nearest (0.00, 0.01, 0.02) and sends sample 3 to cluster 1 at 0.99: total 1.02.
    # The optimum moves sample 0 instead (0.10): 0.10 + 0.01 + 0.02 + 0.03 = 0.16.
    d = np.array([[0.00, 0.10], [0.01, 0.90], [0.02, 0.95], [0.03, 0.99]], dtype=np.float32)
    result = capacity_assignment(d, capacity(4, 2, 1.5))
    assert result.labels.tolist() == [1, 0, 0, 0]
    assert result.cost == pytest.approx(0.16, abs=1e-6)
    greedy = [-1] * 4
    counts = [0, 0]
    for _, i, c in sorted((float(d[i, c]), i, c) for i in range(4) for c in range(2)):
        if greedy[i] == -1 and counts[c] < 3:
            greedy[i], counts[c] = c, counts[c] + 1
    assert greedy == [0, 0, 0, 1]
    assert float(d[np.arange(4), greedy].sum()) == pytest.approx(1.02, abs=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_the_flow_is_never_costlier_than_the_greedy_cap(seed):
    rng = np.random.default_rng(seed)
    n, k = 60, 3
    d = (rng.random((n, k)) * rng.random((1, k)) * 2).astype(np.float32)
    d[: n // 2, 0] *= 0.1  # half of the samples crowd cluster 0, so the cap binds
    cap = capacity(n, k, 1.5)
    greedy = [-1] * n
    counts = [0] * k
    for _, i, c in sorted((float(d[i, c]), i, c) for i in range(n) for c in range(k)):
        if greedy[i] == -1 and counts[c] < cap:
            greedy[i], counts[c] = c, counts[c] + 1
    flow = capacity_assignment(d, cap)
    assert np.bincount(flow.labels, minlength=k).max() <= cap
    assert flow.cost <= float(d[np.arange(n), greedy].astype(np.float64).sum()) + 1e-6
