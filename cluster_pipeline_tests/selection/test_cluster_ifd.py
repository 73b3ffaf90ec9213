"""cluster_ifd (arXiv 2504.12687): the highest IFD within each cluster, under the product's
balanced rule, on hand-checked pools; its passes asked of a fake runner (fake_runner.py) are
ifd's, so one cached unconditioned pass serves both."""

from dataclasses import replace

import numpy as np
import pytest

from cluster_pipeline.selection.passes import ForwardPass
from cluster_pipeline.selection.selectors import (
    CLUSTER_SELECTORS,
    REGISTRY,
    REWEIGHTED_SELECTORS,
    SelectionInputs,
    SelectionParams,
    gather_inputs,
    knobs_of,
    run_selector,
)
from cluster_pipeline.selection.selectors.cluster_ifd import ifd_order
from cluster_pipeline_tests.selection.fake_runner import FakeRunner, tiny_pool

# Clusters of 3 and 4 samples (m = 3, N = 7, K = 2). s(A | Q) / s(A):
#   cluster 0: 0.5 / 1, 1.8 / 2, 3 / 2       IFD 0.5, 0.9, 1.5
#   cluster 1: 0.2 / 1, 1.2 / 1, 1.1 / 1, 1 / 0   IFD 0.2, 1.2, 1.1, none (s(A) = 0)
LABELS = [0, 0, 0, 1, 1, 1, 1]
CONDITIONED = np.array([0.5, 1.8, 3.0, 0.2, 1.2, 1.1, 1.0], dtype=np.float32)
ALONE = np.array([1.0, 2.0, 2.0, 1.0, 1.0, 1.0, 0.0], dtype=np.float32)
IFD = [0.5, 0.9, 1.5, 0.2, 1.2, 1.1, np.nan]


def test_the_order_is_ifds_below_1_first_then_the_rest_then_no_ifd():
    # Below 1, highest first: 1 (0.9), 0 (0.5), 3 (0.2); then 2 (1.5), 4 (1.2), 5 (1.1); then 6.
    assert ifd_order(np.array(IFD)).tolist() == [1, 0, 3, 2, 4, 5, 6]


def _gathered(pool):
    runner = FakeRunner(
        columns={"truncated": np.zeros(7, dtype=np.float32)},
        answer=lambda request: (
            np.ones(7, dtype=bool),
            {"mean_loss": ALONE if request.response_only else CONDITIONED},
        ),
    )
    inputs, _ = gather_inputs("cluster_ifd", knobs_of("cluster_ifd", {}), pool, runner)
    return inputs, runner


def test_each_cluster_keeps_its_highest_ifd_under_sample_balance():
    inputs, runner = _gathered(tiny_pool(LABELS))
    result = run_selector("cluster_ifd", inputs, SelectionParams(r=2 / 3))
    # floor(2/3 x 3) = 2 per cluster: cluster 0 keeps 1 and 0 (IFD 0.9, 0.5); cluster 1 has one
    # sample below 1 (3) and fills its budget with the highest of the rest (4, IFD 1.2).
    assert np.flatnonzero(result.selected).tolist() == [0, 1, 3, 4]
    assert result.selection_rank.tolist() == [1, 0, 2, 0, 1, 2, 3]
    assert result.per_cluster == 2 and result.n_selected == 4
    # That fill (sample 4, IFD 1.2, in cluster 1) is the step's warning.
    assert result.notes == (
        "cluster_ifd: 1 of the 4 kept samples have IFD > 1 or none (per cluster [0, 1] of "
        "[2, 2]): those clusters have fewer samples with IFD <= 1 than their budget and are "
        "filled from the rest of their order, to keep the ranks equal; arXiv 2504.12687 "
        "discards IFD > 1",
    )
    # At floor(1/3 x 3) = 1 per cluster every kept sample has IFD <= 1 (1 and 3): no warning.
    one = run_selector("cluster_ifd", inputs, SelectionParams(r=1 / 3))
    assert np.flatnonzero(one.selected).tolist() == [1, 3] and one.notes == ()
    # w_c = n_c K / N = 3 x 2 / 7 and 4 x 2 / 7.
    np.testing.assert_allclose(result.cluster_weights, [6 / 7, 8 / 7])
    np.testing.assert_allclose(result.weight, [6 / 7] * 3 + [8 / 7] * 4)
    assert result.score is not None
    np.testing.assert_allclose(result.score, IFD, rtol=1e-6)
    # The cost: the pool pass its clusters come from (the selection_cost benchmark found it
    # left out), then ifd's two passes, asked exactly as ifd asks them.
    assert result.cost is not None
    assert [p.name for p in result.cost.passes] == ["embedding", "conditioned", "unconditioned"]
    assert runner.requests == [
        ForwardPass("conditioned", end_of_turn=False, label="ifd conditioned pass"),
        ForwardPass(
            "unconditioned", response_only=True, end_of_turn=False, label="ifd unconditioned pass"
        ),
    ]


def test_each_cluster_keeps_its_token_budget_under_token_balance():
    pool = replace(
        tiny_pool(LABELS),
        lengths=np.array([10, 30, 10, 10, 10, 10, 10]),
        response_tokens=np.array([5, 15, 5, 5, 5, 5, 5]),
    )
    inputs, _ = _gathered(pool)
    result = run_selector("cluster_ifd", inputs, SelectionParams(r=0.5, balance="tokens"))
    # L_c = 50 and 40 tokens: B = floor(0.5 x 40) = 20. Cluster 0's first sample (1) has 30
    # tokens, over B: kept alone (at least one); cluster 1 keeps 3 and 4 (10 + 10 tokens).
    assert np.flatnonzero(result.selected).tolist() == [1, 3, 4]
    assert result.token_budget == 20 and result.balance == "tokens"
    # w_c = K R_c / R with R_c = 25 and 20 response tokens.
    np.testing.assert_allclose(result.cluster_weights, [2 * 25 / 45, 2 * 20 / 45])


def test_it_is_registered_as_a_clustered_reweighted_selector_that_refuses_an_empty_budget():
    spec = REGISTRY["cluster_ifd"]
    assert "cluster_ifd" in CLUSTER_SELECTORS and "cluster_ifd" in REWEIGHTED_SELECTORS
    assert "2504.12687" in spec.source and spec.gather is REGISTRY["ifd"].gather
    inputs = SelectionInputs(np.array(LABELS), 2, mean_loss=CONDITIONED, unconditioned_loss=ALONE)
    with pytest.raises(ValueError, match=r"floor\(r \* m\) = floor\(0.2 \* 3\) = 0"):
        run_selector("cluster_ifd", inputs, SelectionParams(r=0.2))
    with pytest.raises(ValueError, match="needs mean_loss, unconditioned_loss"):
        run_selector("cluster_ifd", SelectionInputs(np.array(LABELS), 2))
