"""Paired bootstrap intervals and verdicts, and gradient diversity, on data with known answers."""

import numpy as np
import pytest

from cluster_pipeline.evaluation.statistics import gradient_diversity, paired_bootstrap


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


def test_gradient_diversity_hand_checked():
    same = np.ones((4, 3))
    assert gradient_diversity(same) == pytest.approx(0.25)  # 1/n for identical gradients
    orthogonal = np.eye(3)
    assert gradient_diversity(orthogonal) == pytest.approx(1.0)  # 3 / ||(1,1,1)||^2
    partly_cancel = np.array([[1.0, 0.0], [-0.5, 0.0]])
    assert gradient_diversity(partly_cancel) == pytest.approx(1.25 / 0.25)
