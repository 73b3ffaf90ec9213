"""s2l (SmallToLarge, Yang et al. 2024): Algorithm 1's balanced draw on hand-checked cluster
sizes, k-means on trajectories that separate two obvious groups, the token-balanced variant and
the errors."""

from dataclasses import replace

import numpy as np
import pytest

from cluster_pipeline.selection.selectors import (
    REGISTRY,
    SelectionInputs,
    SelectionParams,
    run_selector,
)
from cluster_pipeline.selection.selectors.base import global_budget
from cluster_pipeline.selection.selectors.s2l import (
    S2LKnobs,
    balanced_sampling,
    source_split,
    trajectory_clusters,
    unclustered_sources,
)


def _labels(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


def _kept_per_cluster(labels, selected, k):
    return np.bincount(labels[selected], minlength=k).tolist()


@pytest.mark.parametrize(
    ("sizes", "budget", "expected"),
    [
        # Ascending 2, 5, 9. R = 9: 9 // 3 = 3 > 2, the small one whole (R = 7); 7 // 2 = 3 of
        # the 5 (R = 4); 4 // 1 = 4 of the 9.
        ([2, 5, 9], 9, [2, 3, 4]),
        # Ids out of size order: ascending 1 (id 1), 4 (id 2), 6 (id 3), 9 (id 0). R = 12:
        # 12 // 4 = 3 > 1: 1 (R = 11); 11 // 3 = 3 of 4 (R = 8); 8 // 2 = 4 of 6 (R = 4); 4.
        ([9, 1, 4, 6], 12, [4, 1, 3, 4]),
        # A budget above the pool: every cluster whole.
        ([2, 3], 10, [2, 3]),
        # Equal sizes, budget 7 over 3: 7 // 3 = 2, 5 // 2 = 2, 3 // 1 = 3 (ties by id).
        ([4, 4, 4], 7, [2, 2, 3]),
    ],
)
def test_algorithm_1_takes_small_clusters_whole_and_spreads_the_rest(sizes, budget, expected):
    labels = _labels(sizes)
    order, selected = balanced_sampling(labels, budget, seed=0)  # Algorithm 1 as published
    assert _kept_per_cluster(labels, selected, len(sizes)) == expected
    # The order is a permutation whose first samples are exactly the kept ones.
    assert sorted(order.tolist()) == list(range(len(labels)))
    assert selected[order[: sum(expected)]].all() and not selected[order[sum(expected) :]].any()


def test_the_draw_within_a_cluster_is_seeded():
    labels = _labels([2, 5, 9])
    a = balanced_sampling(labels, 9, seed=3)[1]
    assert (balanced_sampling(labels, 9, seed=3)[1] == a).all()
    draws = {tuple(np.flatnonzero(balanced_sampling(labels, 9, seed=s)[1])) for s in range(8)}
    assert len(draws) > 1  # different seeds draw different members (the counts stay)


def test_token_balance_spreads_tokens_small_clusters_first():
    # Cluster 0: 2 x 10 tokens (20); cluster 1: 6 x 5 (30); cluster 2: 2 x 50 (100).
    lengths = np.array([10, 10, 5, 5, 5, 5, 5, 5, 50, 50])
    labels = _labels([2, 6, 2])
    # R = 60: 60 // 3 = 20 tokens for cluster 0, both fit (R = 40); 40 // 2 = 20 for cluster 1:
    # 4 samples (R = 20); 20 for cluster 2: its first sample (50) does not fit.
    _, selected = balanced_sampling(labels, 60, seed=0, lengths=lengths)
    assert _kept_per_cluster(labels, selected, 3) == [2, 4, 0]
    assert int(lengths[selected].sum()) == 40


# Three trajectory groups, far apart: falling losses, flat low losses, flat high losses.
def _trajectories(sizes, seed=0):
    rng = np.random.default_rng(seed)
    shapes = np.array([[3.0, 2.0, 1.0], [0.5, 0.5, 0.5], [6.0, 6.0, 6.0]])
    rows = np.repeat(shapes[: len(sizes)], sizes, axis=0)
    return (rows + 0.01 * rng.standard_normal(rows.shape)).astype(np.float32)


def test_k_means_on_trajectories_separates_two_obviously_different_groups():
    trajectories = _trajectories([7, 5])
    truth = _labels([7, 5])
    groups = trajectory_clusters(trajectories, 2, seed=0)
    # The same partition as the truth, whatever the cluster ids.
    assert len(set(zip(groups.tolist(), truth.tolist(), strict=True))) == 2
    assert len(set(groups[:7].tolist())) == 1 and groups[0] != groups[7]


def test_s2l_through_the_registry_draws_algorithm_1_over_the_trajectory_clusters():
    # K = 1 over N = 16: r = 9/16 gives the budget floor(r * 16) = 9; groups of 2, 5, 9.
    trajectories = _trajectories([2, 5, 9])
    inputs = SelectionInputs(np.zeros(16, dtype=np.int64), 1, loss_trajectories=trajectories)
    knobs = S2LKnobs(s2l_clusters=3, s2l_small_clusters="algorithm_1")
    result = run_selector("s2l", inputs, SelectionParams(r=0.5625, knobs=knobs))
    truth = _labels([2, 5, 9])
    assert _kept_per_cluster(truth, result.selected, 3) == [2, 3, 4]
    assert result.per_cluster == 9 and result.n_selected == 9
    # Score: the kept share of the sample's trajectory cluster.
    assert result.score is not None
    np.testing.assert_allclose(result.score, np.repeat([1.0, 3 / 5, 4 / 9], [2, 5, 9]))
    # The first 9 of the order are the kept ones; weights 1; random balanced shards.
    assert set(np.flatnonzero(result.selection_rank < 9)) == set(np.flatnonzero(result.selected))
    assert (result.weight == 1).all() and not REGISTRY["s2l"].clustered


def test_s2l_under_token_balance_cuts_at_the_global_token_budget():
    # K = 2 clusters of the pool (8 samples each, 10 tokens a sample: L_c = 80); r = 0.5 gives
    # B = 40 tokens per cluster and the global budget K B = 80 tokens. Trajectory groups of
    # 2, 5, 9 samples (20, 50, 90 tokens): 80 // 3 = 26 tokens, group 0 whole (20, R = 60);
    # 60 // 2 = 30: 3 samples of group 1 (R = 30); 30: 3 samples of group 2.
    trajectories = _trajectories([2, 5, 9])
    inputs = SelectionInputs(
        np.array([0, 1] * 8, dtype=np.int64),
        2,
        lengths=np.full(16, 10),
        response_tokens=np.full(16, 5),
        loss_trajectories=trajectories,
    )
    knobs = S2LKnobs(s2l_clusters=3, s2l_small_clusters="algorithm_1")
    result = run_selector("s2l", inputs, SelectionParams(r=0.5, balance="tokens", knobs=knobs))
    assert _kept_per_cluster(_labels([2, 5, 9]), result.selected, 3) == [2, 3, 3]
    assert result.balance == "tokens" and result.token_budget == 80
    assert result.per_cluster == 8


def test_s2l_refuses_what_it_cannot_select_from():
    trajectories = _trajectories([2, 3])
    inputs = SelectionInputs(np.zeros(5, dtype=np.int64), 1, loss_trajectories=trajectories)
    with pytest.raises(ValueError, match="cannot make 6 trajectory clusters from 5 samples"):
        run_selector("s2l", inputs, SelectionParams(r=1.0, knobs=S2LKnobs(s2l_clusters=6)))
    with pytest.raises(ValueError, match="needs loss_trajectories"):
        run_selector("s2l", SelectionInputs(np.zeros(5, dtype=np.int64), 1), SelectionParams())
    short = SelectionInputs(np.zeros(5, dtype=np.int64), 1, loss_trajectories=trajectories[:4])
    with pytest.raises(ValueError, match=r"shape \(4, 3\) for a pool of 5"):
        run_selector("s2l", short, SelectionParams(knobs=S2LKnobs(s2l_clusters=2)))


# --- Fidelity to the authors' released code (BigML-CS-UCLA/S2L, schedules/s2l.py) ------------


def test_by_default_clusters_of_at_most_two_wait_for_what_the_others_leave():
    # The authors' rule (schedules/s2l.py:125-144): groups of 2, 5, 9 and a budget of 9. The
    # group of 2 waits: 9 // 2 = 4 of the 5 (R = 5), 5 // 1 = 5 of the 9, nothing left for it.
    trajectories = _trajectories([2, 5, 9])
    inputs = SelectionInputs(np.zeros(16, dtype=np.int64), 1, loss_trajectories=trajectories)
    result = run_selector("s2l", inputs, SelectionParams(r=0.5625, knobs=S2LKnobs(s2l_clusters=3)))
    assert _kept_per_cluster(_labels([2, 5, 9]), result.selected, 3) == [0, 4, 5]
    # A budget of 15: 15 // 2 = 7 > 5, the 5 whole (R = 10); 10 of the 9: whole (R = 1); the
    # one left is drawn from the set-aside group.
    result = run_selector("s2l", inputs, SelectionParams(r=15 / 16, knobs=S2LKnobs(s2l_clusters=3)))
    assert _kept_per_cluster(_labels([2, 5, 9]), result.selected, 3) == [1, 5, 9]


def _released_allocation(sources, kmeans_labels, num):
    """schedules/s2l.py:54-79 (initialize_labeled_data) and 107-146 (faiss_kmeans_selection),
    transcribed, with the k-means labels given (the groups below are far apart, so faiss's
    clusters are them): how many samples each (source, cluster) gives; the clusters of at most 2
    samples pooled as (source, "small"). The draws themselves are random in both."""
    sources = np.array(sources)
    got: dict = {}
    names, counts = np.unique(sources, return_counts=True)
    sorted_idx = np.argsort(counts)
    for i in range(len(sorted_idx)):
        n_per_source = num // (len(sorted_idx) - i)
        indices = np.where(sources == names[sorted_idx[i]])[0]
        source = str(names[sorted_idx[i]])
        if len(indices) > n_per_source:
            big_i = kmeans_labels[indices]  # faiss_kmeans_selection(self.losses[indices], n)
            n = n_per_source
            clusters, c_counts = np.unique(big_i, return_counts=True)
            c_sorted = np.argsort(c_counts)
            c_sorted = c_sorted[c_counts[c_sorted] > 2]
            for j in range(len(c_sorted)):
                n_per_cluster = n // (len(c_sorted) - j)
                members = np.where(big_i == clusters[c_sorted[j]])[0]
                key = (source, int(clusters[c_sorted[j]]))
                if len(members) > n_per_cluster:
                    got[key] = n_per_cluster
                    n -= n_per_cluster
                else:
                    got[key] = len(members)
                    n -= len(members)
            if n > 0:
                got[(source, "small")] = n
            num -= n_per_source
        else:
            got[(source, "all")] = len(indices)
            num -= len(indices)
    return got


@pytest.mark.parametrize("budget", [16, 31, 9])
def test_the_budget_is_split_over_sources_then_clusters_as_the_authors_code(budget):
    # Three files: a.jsonl with groups of 2, 6, 9; b.jsonl with 1, 4, 7; c.jsonl with 3.
    layout = [("a.jsonl", [2, 6, 9]), ("b.jsonl", [1, 4, 7]), ("c.jsonl", [3])]
    rows, sources, truth = [], [], []
    for name, sizes in layout:
        rows.append(_trajectories(sizes, seed=len(rows)))
        sources += [name] * sum(sizes)
        truth += _labels(sizes).tolist()
    trajectories, truth_arr = np.concatenate(rows), np.array(truth)
    n = len(truth)
    want = _released_allocation(sources, truth_arr, budget)
    inputs = SelectionInputs(
        np.zeros(n, dtype=np.int64),
        1,
        loss_trajectories=trajectories,
        sources=np.array(sources),
    )
    result = run_selector(
        "s2l", inputs, SelectionParams(r=budget / n, knobs=S2LKnobs(s2l_clusters=3))
    )
    got: dict = {}
    for i in np.flatnonzero(result.selected):
        name = sources[i]
        whole = (name, "all") in want
        small = dict(layout)[name][truth[i]] <= 2
        key = (name, "all") if whole else (name, "small") if small else (name, int(truth[i]))
        got[key] = got.get(key, 0) + 1
    assert result.n_selected == budget
    assert got == {k: v for k, v in want.items() if v}
    # s2l_sources: false clusters the pool as one source (3 clusters over every sample).
    one = run_selector(
        "s2l",
        inputs,
        SelectionParams(r=budget / n, knobs=S2LKnobs(s2l_clusters=3, s2l_sources=False)),
    )
    assert one.n_selected == budget and not np.array_equal(one.selected, result.selected)


def test_a_source_with_no_more_samples_than_clusters_is_named_and_drawn_at_random():
    """The authors' faiss k-means stops on a source with fewer samples than clusters
    (schedules/s2l.py:113-114: ``faiss.Kmeans(d, n_components)``; faiss requires nx >= k); the
    product clusters such a source into one cluster per sample, so its draw is random, and
    ``gather`` logs one line per such source (issue 41's S2L departure, measured on the
    ``mixed`` pool where every source had fewer samples than the default 100 clusters)."""
    sources = np.array(["b"] * 3 + ["a"] * 5 + ["c"] * 2)
    tail = (
        "each of their samples is a trajectory cluster of its own, so their shares are drawn "
        "uniformly at random (the authors' faiss k-means stops on fewer samples than clusters)"
    )
    assert unclustered_sources(sources, len(sources), 3) == (
        "s2l: 2 of the 3 sources have no more samples than s2l_clusters (3): 'b' (3), 'c' (2); "
        + tail
        + "; peripheral_subsets.s2l_clusters below 3 gives trajectory clusters in the largest "
        "of them"
    )
    assert unclustered_sources(sources, len(sources), 2) == (
        "s2l: 1 of the 3 sources has no more samples than s2l_clusters (2): 'c' (2); "
        + tail
        + "; peripheral_subsets.s2l_clusters below 2 gives trajectory clusters in the largest "
        "of them"
    )
    # One line however many sources; no advice where every such source has one sample.
    files = np.array([f"f{i}.json" for i in range(8)])
    assert unclustered_sources(files, 8, 2) == (
        "s2l: 8 of the 8 sources have no more samples than s2l_clusters (2): 'f0.json' (1), "
        "'f1.json' (1), 'f2.json' (1), 'f3.json' (1), 'f4.json' (1) and 3 more; " + tail
    )
    assert unclustered_sources(None, 3, 3) == (
        "s2l: the pool has 3 samples, no more than s2l_clusters (3): each is a trajectory "
        "cluster of its own, so the draw is uniformly random (the authors' faiss k-means stops "
        "on fewer samples than clusters); peripheral_subsets.s2l_clusters below 3 gives "
        "trajectory clusters"
    )
    assert unclustered_sources(None, 4, 3) is None
    # What the line says: at a budget of 3 (one per source, none kept whole) source b (3
    # samples, 3 clusters) gets one trajectory cluster per sample; source a (5 samples) gets 3
    # clusters for 5 samples.
    rng = np.random.default_rng(0)
    trajectories = rng.normal(size=(len(sources), 4)).astype(np.float32)
    _, selected, groups = source_split(trajectories, sources, 3, 3, 0)
    assert selected.sum() == 3 and (groups >= 0).all()
    assert len(set(groups[sources == "b"].tolist())) == 3
    assert len(set(groups[sources == "a"].tolist())) == 3


def test_sources_that_outnumber_the_budget_never_take_more_than_it():
    """A source whose share is 0 (``num // sources_left``) takes nothing, as the authors'
    ``np.random.choice(indices, 0)`` (schedules/s2l.py:62-70, 132-139); it used to keep one
    sample per such source (40 one-sample sources at budget 20 kept all 40)."""
    # 40 one-sample sources s00..s39, K = 2 clusters of 20, r = 0.5: budget 2 x floor(10) = 20.
    # Shares 20 // 40 .. 20 // 21 are 0 (s00..s19 take nothing); s20..s39 take 1 each.
    names = np.array([f"s{i:02d}" for i in range(40)])
    inputs = SelectionInputs(
        np.repeat([0, 1], 20),
        2,
        loss_trajectories=np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32),
        sources=names,
    )
    result = run_selector("s2l", inputs, SelectionParams(r=0.5, knobs=S2LKnobs(s2l_clusters=3)))
    assert names[result.selected].tolist() == [f"s{i}" for i in range(20, 40)]
    # 20 sources of 3 samples, r = 0.25 of clusters of 30: budget 2 x floor(7.5) = 14; shares
    # 14 // 20 .. 14 // 15 are 0 (sources 0-5), then 1 each for sources 6-19.
    names = np.repeat([f"t{i:02d}" for i in range(20)], 3)
    inputs = replace(
        inputs,
        labels=np.repeat([0, 1], 30),
        loss_trajectories=np.random.default_rng(1).normal(size=(60, 3)).astype(np.float32),
        sources=names,
    )
    result = run_selector("s2l", inputs, SelectionParams(r=0.25, knobs=S2LKnobs(s2l_clusters=3)))
    kept = names[result.selected].tolist()
    assert result.n_selected == 14 and kept == [f"t{i:02d}" for i in range(6, 20)]


@pytest.mark.parametrize("seed", range(6))
def test_the_subset_stays_within_the_budget_whatever_the_sources(seed):
    """Random pools of 1-30 sources of 1-9 samples, r in (0, 1), both balances: the subset never
    exceeds the budget (one sample in all when the token budget holds none)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 10, size=rng.integers(1, 31))
    n = int(sizes.sum())
    sources = np.repeat([f"src{i}" for i in range(len(sizes))], sizes)
    lengths = rng.integers(5, 50, size=n)
    inputs = SelectionInputs(
        np.arange(n) % 2 if n >= 2 else np.zeros(n, dtype=np.int64),
        2 if n >= 2 else 1,
        lengths=lengths,
        response_tokens=lengths // 2,
        loss_trajectories=rng.normal(size=(n, 4)).astype(np.float32),
        sources=sources,
    )
    for r in (0.1, 0.3, 0.7):
        for balance in ("samples", "tokens"):
            params = SelectionParams(r=r, balance=balance, knobs=S2LKnobs(s2l_clusters=4))
            budget = global_budget(inputs, params)
            if budget == 0 and balance == "samples":
                continue
            result = run_selector("s2l", inputs, params)
            if balance == "samples":
                assert result.n_selected == min(budget, n), (r, sizes.tolist())
            else:
                spent = int(lengths[result.selected].sum())
                assert spent <= budget or result.n_selected == 1, (r, spent, budget)
