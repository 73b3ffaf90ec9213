"""Every selector refuses, before any pass, a pool it cannot give each rank a sample from, and
no subset that leaves a rank empty is written (issue 43: on a pool of 3 for 2 ranks, ifd,
s2l, less and rds each ran their expensive pass, saved a subset with an empty rank reported
as weights [1.0, 1.0], and the next stage failed with "1 selected samples cannot fill 2 ranks",
naming no setting).

The kind, "the ranks a selector must fill": every selector in the registry, at sample and
token balance; the smallest pool it fills, and the pool one sample smaller refused naming the
knob; the two ways a result can leave a rank empty (a clustered selector's empty cluster, an
unclustered one's fewer samples than ranks)."""

import numpy as np
import pytest

from cluster_pipeline.selection.selectors import (
    REGISTRY,
    SELECTORS,
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    empty_ranks,
    fill_problems,
    run_selector,
    smallest_pool,
)
from cluster_pipeline.selection.sharding import allocate

LENGTH = 10  # tokens per sample of the pools below

# The smallest pool each registered selector fills (K equal clusters of equal samples), worked
# out by hand from its rule: a budgeted selector needs floor(r m) >= 1 per cluster, m >= 2 at
# r = 0.5 and m >= 4 at r = 0.3 (0.3 x 3 = 0.9); under token balance a clustered one keeps each
# cluster's first sample (K samples), an unclustered one needs r m >= 1 again; full and
# uniform keep every sample (K).
SMALLEST = {
    # selector: {(K, r, balance): N}
    "peripheral": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 12},
    "core": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 12},
    "random": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 12},
    "cluster_ifd": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 12},
    "uniform": {(2, 0.5, "samples"): 2, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 3},
    "full": {(2, 0.5, "samples"): 2, (2, 0.5, "tokens"): 2, (3, 0.3, "samples"): 3},
    "random_global": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "ifd": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "rds": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "s2l": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "less": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    # Issue 41's baselines: unclustered, the global budget (as ifd).
    "cluster_less": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "balanced_random": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
    "longest": {(2, 0.5, "samples"): 4, (2, 0.5, "tokens"): 4, (3, 0.3, "tokens"): 12},
}


def test_every_registered_selector_has_its_smallest_pools_worked_out():
    """A selector added to the registry gets its row above (worked out from its rule)."""
    assert sorted(SMALLEST) == sorted(SELECTORS)


SETTINGS = [(2, 0.5, "samples"), (2, 0.5, "tokens"), (3, 0.3, "samples"), (3, 0.3, "tokens")]


def _pool(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """n samples of :data:`LENGTH` tokens dealt round-robin into k clusters (sizes differ by
    at most one)."""
    return np.arange(n, dtype=np.int64) % k, np.full(n, LENGTH, dtype=np.int64)


@pytest.mark.parametrize("selector", SELECTORS)
def test_every_selector_names_the_smallest_pool_it_fills(selector):
    for k, r, balance in SETTINGS:
        n = smallest_pool(selector, k, r, balance)
        if (k, r, balance) in SMALLEST.get(selector, {}):
            assert n == SMALLEST[selector][(k, r, balance)], (k, r, balance)
        # It fills that pool; the pool one sample smaller (K clusters still) is refused.
        labels, lengths = _pool(n, k)
        assert fill_problems(selector, labels, k, r, balance, lengths) == []
        if n - 1 >= k:
            labels, lengths = _pool(n - 1, k)
            assert fill_problems(selector, labels, k, r, balance, lengths), (n - 1, k, r)


@pytest.mark.parametrize("selector", SELECTORS)
def test_the_pool_one_sample_too_small_is_refused_naming_the_knob(selector):
    k, r = 2, 0.5
    spec = REGISTRY[selector]
    advice = (
        "raise ratio, lower balanced_clusters.num_clusters, or add data ({s} needs a pool of at "
        "least {n} samples in 2 equal clusters to fill 2 ranks at ratio 0.5, balance {b})"
    )
    # Sample balance: 3 samples in clusters of [2, 1].
    labels, lengths = _pool(3, k)
    got = fill_problems(selector, labels, k, r, "samples", lengths)
    if spec.budgeted:
        assert got == [
            f"peripheral_subsets.ratio = 0.5: {selector} keeps no sample: every cluster keeps "
            "floor(r x the smallest cluster's size) = floor(0.5 x 1) = 0 samples (cluster "
            "sizes [2, 1] at balanced_clusters.num_clusters = 2); "
            + advice.format(s=selector, n=4, b="samples")
        ]
    else:
        assert got == []
    # Token balance, issue 43's pool: 3 samples of 100, 80 and 90 tokens, clusters [1, 2].
    labels, lengths = np.array([0, 1, 1]), np.array([100, 80, 90])
    got = fill_problems(selector, labels, k, r, "tokens", lengths)
    if spec.budgeted and not spec.clustered:
        assert got == [
            f"peripheral_subsets.ratio = 0.5: {selector} can keep at most 1 of the pool's 3 "
            "samples: its budget, K x floor(r x the smallest cluster's tokens) = 2 x floor(0.5 x "
            "100) = 100 tokens, holds 1 even taking the shortest first, and the 2 ranks "
            "(balanced_clusters.num_clusters = 2) need a sample each; "
            + advice.format(s=selector, n=4, b="tokens")
        ]
    else:
        assert got == []


def test_a_zero_token_budget_is_refused():
    labels, lengths = np.array([0, 1]), np.array([1, 5])
    assert fill_problems("peripheral", labels, 2, 0.5, "tokens", lengths) == [
        "peripheral_subsets.ratio = 0.5: peripheral keeps no sample: every cluster keeps "
        "floor(r x the smallest cluster's tokens) = floor(0.5 x 1) = 0 tokens (cluster tokens "
        "[1, 5] at balanced_clusters.num_clusters = 2); raise ratio, lower "
        "balanced_clusters.num_clusters, or add data (peripheral needs a pool of at least 2 "
        "samples in 2 equal clusters to fill 2 ranks at ratio 0.5, balance tokens)"
    ]


CLUSTERING_ONLY = [s for s in SELECTORS if not set(REGISTRY[s].passes) - {"embedding"}]
NEEDS_SOURCES = {s for s in CLUSTERING_ONLY if "sources" in REGISTRY[s].needs}


def test_the_selectors_run_for_real_are_those_without_a_model_pass_of_their_own():
    assert sorted(CLUSTERING_ONLY) == sorted(
        [
            "balanced_random",
            "core",
            "full",
            "longest",
            "peripheral",
            "random",
            "random_global",
            "uniform",
        ]
    )


@pytest.mark.parametrize("selector", CLUSTERING_ONLY)
@pytest.mark.parametrize("balance", ["samples", "tokens"])
def test_the_smallest_pool_really_fills_every_rank(selector, balance):
    """Run for real: the selectors that read only the clustering, at their smallest pool, give
    every rank a sample (the sharding deals them without an error)."""
    k, r = 2, 0.5
    n = smallest_pool(selector, k, r, balance)
    labels, lengths = _pool(n, k)
    # balanced_random reads each sample's source (its file): two, alternating.
    sources = (
        np.array([f"part{i % 2}.jsonl" for i in range(n)]) if selector in NEEDS_SOURCES else None
    )
    inputs = SelectionInputs(
        labels=labels,
        k=k,
        sq_distance=np.linspace(0, 1, n).astype(np.float32),
        lengths=lengths,
        response_tokens=lengths // 2,
        sources=sources,
    )
    result = run_selector(selector, inputs, SelectionParams(r=r, balance=balance))
    assert empty_ranks(result, labels, k, r, n) is None
    ids = np.array([f"s{i}" for i in range(n)])
    manifests = allocate("tiny", ids, labels, result, k, lengths=lengths).manifests
    assert all(m.n_samples >= 1 for m in manifests)


def _result(selector: str, copies: list[int], k: int) -> SelectionResult:
    c = np.array(copies, dtype=np.int64)
    n = len(c)
    return SelectionResult(selector, c > 0, c, np.arange(n), np.ones(n), np.ones(k), int(c.sum()))


def test_a_result_that_leaves_a_rank_empty_is_never_written():
    labels = np.array([0, 0, 1, 1, 2])
    # A clustered selector that kept nothing of cluster 2 (an unscored cluster, say).
    assert empty_ranks(_result("cluster_ifd", [1, 0, 1, 0, 0], 3), labels, 3, 0.5, 5) == (
        "peripheral_subsets.ratio = 0.5: cluster_ifd kept no sample of cluster(s) [2] (cluster "
        "c trains on rank c; kept per cluster [1, 1, 0]), so those ranks would train on "
        "nothing; nothing was saved; raise ratio, lower balanced_clusters.num_clusters, or add "
        "data"
    )
    # An unclustered selector that kept fewer samples than ranks (ifd on issue 43's pool).
    assert empty_ranks(_result("ifd", [0, 1, 0], 2), labels[:3], 2, 0.5, 3) == (
        "peripheral_subsets.ratio = 0.5: ifd kept 1 sample(s) of the pool's 3 for 2 ranks "
        "(balanced_clusters.num_clusters = 2), so a rank would train on nothing; nothing was "
        "saved; raise ratio, lower balanced_clusters.num_clusters, or add data"
    )
    # Copies count: one sample twice fills two ranks; every cluster kept: fine.
    assert empty_ranks(_result("ifd", [0, 2, 0], 2), labels[:3], 2, 0.5, 3) is None
    assert empty_ranks(_result("peripheral", [1, 0, 1, 0, 1], 3), labels, 3, 0.5, 5) is None


def test_an_order_that_fills_fewer_ranks_than_its_budget_allows_is_caught_before_writing():
    """The budget bounds what a selector can keep (shortest first); ``longest`` takes the
    longest first, so at token balance it can keep fewer: two clusters of a 10- and a
    100-token sample, budget 2 x floor(0.5 x 110) = 110 tokens: shortest first holds 2 samples
    (the check passes), longest first holds one 100-token sample (one rank left empty). It has
    no pass of its own, so the check after it runs, before anything is written, refuses."""
    labels, lengths = np.array([0, 0, 1, 1]), np.array([10, 100, 10, 100])
    assert fill_problems("longest", labels, 2, 0.5, "tokens", lengths) == []
    inputs = SelectionInputs(labels=labels, k=2, lengths=lengths, response_tokens=lengths // 2)
    result = run_selector("longest", inputs, SelectionParams(r=0.5, balance="tokens"))
    assert result.copies.tolist() == [0, 1, 0, 0]
    assert empty_ranks(result, labels, 2, 0.5, 4) == (
        "peripheral_subsets.ratio = 0.5: longest kept 1 sample(s) of the pool's 4 for 2 ranks "
        "(balanced_clusters.num_clusters = 2), so a rank would train on nothing; nothing was "
        "saved; raise ratio, lower balanced_clusters.num_clusters, or add data"
    )
