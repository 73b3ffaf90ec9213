"""Paired bootstrap intervals, sign-flip p-values and verdicts, and gradient diversity, on data
with known answers."""

import numpy as np
import pytest

from cluster_pipeline.evaluation.statistics import (
    gradient_diversity,
    paired_bootstrap,
    sign_flip_p_value,
)


def _pair(rng, n, shift, seeds=(1, 1), seed_sd=0.0):
    """Per-item losses of a reference and a candidate that is ``shift`` worse on average."""
    item = rng.normal(1.2, 0.3, size=n)  # item difficulty, shared by both models
    ref = item + rng.normal(0, 0.05, size=(seeds[1], n)) + rng.normal(0, seed_sd, (seeds[1], 1))
    cand = (
        item
        + shift
        + rng.normal(0, 0.05, size=(seeds[0], n))
        + rng.normal(0, seed_sd, (seeds[0], 1))
    )
    return cand, ref


def test_the_interval_covers_a_known_difference_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(100):
        cand, ref = _pair(rng, 120, shift=0.02)
        c = paired_bootstrap(cand, ref, n_resamples=1000, seed=trial)
        hits += c.low <= 0.02 <= c.high
    # Binomial(100, 0.95): 88 or more with probability > 0.99.
    assert hits >= 88


def test_verdicts_follow_the_sign_and_the_interval():
    rng = np.random.default_rng(1)
    cand, ref = _pair(rng, 300, shift=0.05)
    worse = paired_bootstrap(cand, ref, lower_is_better=True)
    assert worse.verdict == "worse" and worse.low > 0
    assert paired_bootstrap(cand, ref, lower_is_better=False).verdict == "better"
    assert paired_bootstrap(ref, cand).verdict == "better"
    same = paired_bootstrap(ref, ref.copy())
    assert same.difference == 0.0 and same.verdict == "no detectable difference"
    null, ref2 = _pair(rng, 300, shift=0.0)
    assert paired_bootstrap(null, ref2).verdict == "no detectable difference"


def test_weighted_difference_and_minimum_detectable_difference():
    cand = np.array([[2.0, 1.0, 1.0]])
    ref = np.array([[1.0, 1.0, 1.0]])
    c = paired_bootstrap(cand, ref, weights=np.array([3.0, 1.0, 0.0]))
    assert c.difference == pytest.approx(0.75)  # (3 * 1 + 1 * 0) / 4; item 3 has weight 0
    assert c.items == 2
    assert c.relative == pytest.approx(0.75)
    assert c.min_detectable == pytest.approx(2.801585 * c.standard_error, rel=1e-6)


def test_seed_variance_widens_the_interval():
    rng = np.random.default_rng(2)
    cand, ref = _pair(rng, 200, shift=0.0, seeds=(3, 3), seed_sd=0.05)
    with_seeds = paired_bootstrap(cand, ref)
    items_only = paired_bootstrap(cand.mean(axis=0, keepdims=True), ref.mean(axis=0, keepdims=True))
    assert (
        with_seeds.candidate_seeds == 3
        and with_seeds.standard_error > 1.5 * items_only.standard_error
    )


@pytest.mark.parametrize(
    ("difference", "weights", "p"),
    [
        # Pass/fail items: the exact two-sided sign test on the discordant items, 2 x 0.5^k.
        ([1, 1, 1, 0, 0, 0, 0, 0], None, 2 * 0.5**3),
        ([1, 1, 1, 1, 1, 1, 0, 0], None, 2 * 0.5**6),
        ([-1, -1, -1, -1, -1, -1, 0, 0], None, 2 * 0.5**6),
        # 5 up, 1 down: sign patterns with |sum| >= 4 are 0, 1, 5 or 6 downs: (1+6+6+1)/64.
        ([1, 1, 1, 1, 1, -1], None, 14 / 64),
        # Weighted: D = (2 - 3)/4; the four patterns give -0.25, -1.25, 1.25, 0.25: all count.
        ([2.0, -1.0], [1.0, 3.0], 1.0),
        ([2.0, 0.0], [1.0, 3.0], 1.0),
        ([0, 0, 0], None, 1.0),
    ],
    ids=["3-of-8", "6-of-8", "6-of-8-worse", "5-up-1-down", "weighted", "one-item", "all-tied"],
)
def test_the_sign_flip_p_value_is_exact_for_few_items(difference, weights, p):
    d = np.asarray(difference, dtype=np.float64)
    w = np.ones(len(d)) if weights is None else np.asarray(weights)
    assert sign_flip_p_value(d, w) == pytest.approx(p, rel=1e-9)


def test_with_many_items_the_sampled_p_value_is_close_to_the_exact_one():
    # 14 of 40 items up, none down: exact 2 x 0.5^14 = 1.2e-4; sampled with 9,999 patterns,
    # p = (hits + 1) / 10,000 with hits ~ Poisson(1.2): 1e-4 at the least, 1e-3 (8 hits) at
    # odds below 1e-4.
    d = np.r_[np.ones(14), np.zeros(26)]
    assert 1e-4 <= sign_flip_p_value(d, np.ones(40)) <= 1e-3
    # 9 up, 5 down of 40: exact two-sided binomial P(|X - 7| >= 2 | n=14) = 0.424.
    d = np.r_[np.ones(9), -np.ones(5), np.zeros(26)]
    assert sign_flip_p_value(d, np.ones(40)) == pytest.approx(0.4240, abs=0.015)


def test_a_bootstrap_interval_over_few_items_alone_gives_no_verdict():
    # The default run's MBPP: 0/8 -> 3/8 solved, the other 5 tied. Whatever the bootstrap's
    # interval, p = 0.25, so no verdict.
    cand, ref = np.array([[1.0, 1, 1, 0, 0, 0, 0, 0]]), np.zeros((1, 8))
    for seed in range(5):
        c = paired_bootstrap(cand, ref, lower_is_better=False, seed=seed)
        assert c.p_value == pytest.approx(0.25)
        assert c.verdict == "no detectable difference"
    # 7 of 8 solved by the candidate alone: p = 2 x 0.5^7 = 0.0156 and the interval is above 0.
    c = paired_bootstrap(
        np.array([[1.0, 1, 1, 1, 1, 1, 1, 0]]), np.zeros((1, 8)), lower_is_better=False
    )
    assert c.p_value == pytest.approx(2 * 0.5**7) and c.low > 0
    assert c.verdict == "better"


def test_gradient_diversity_hand_checked():
    same = np.ones((4, 3))
    assert gradient_diversity(same) == pytest.approx(0.25)  # 1/n for identical gradients
    orthogonal = np.eye(3)
    assert gradient_diversity(orthogonal) == pytest.approx(1.0)  # 3 / ||(1,1,1)||^2
    partly_cancel = np.array([[1.0, 0.0], [-0.5, 0.0]])
    assert gradient_diversity(partly_cancel) == pytest.approx(1.25 / 0.25)
