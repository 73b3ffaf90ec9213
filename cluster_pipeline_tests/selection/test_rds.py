"""rds (RDS+, Ivison et al. 2025): round-robin over the targets on a hand-worked case."""

import numpy as np
import pytest

from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline.selection.selectors import SelectionInputs, SelectionParams, run_selector
from cluster_pipeline.selection.selectors.rds import candidates, round_robin

# Three targets: t0 = (1, 0), t1 = (0, 1), t2 = (-1, 0). Eight pool samples (normalised below):
POOL = l2_normalise(
    np.array([[3, 1], [2, 1], [1, 3], [-1, 3], [-3, 1], [1, 1], [-1, 1], [0, -1]], dtype=np.float32)
)
TARGETS = np.array([[1, 0], [0, 1], [-1, 0]], dtype=np.float32)
# By hand, cos = x for t0, y for t1, -x for t2 of the normalised samples:
#   t0: p0 .949, p1 .894, p5 .707, p2 .316, p7 0, ...
#   t1: p2 .949 = p3 .949 (tie: lower index first), p5 .707 = p6 .707, p1 .447, ...
#   t2: p4 .949, p6 .707, p3 .316, p7 0, ...
# Round 1: t0 takes p0, t1 p2, t2 p4; round 2: t0 p1, t1 p3 (p2 taken), t2 p6; round 3: t0 p5.
EXPECTED_ORDER = [0, 2, 4, 1, 3, 6, 5]


def _inputs(**kw):
    return SelectionInputs(
        labels=np.zeros(8, dtype=np.int64), k=1, hidden_mean=POOL, targets=TARGETS, **kw
    )


def test_round_robin_on_three_targets_matches_the_hand_worked_order():
    best, score = candidates(POOL, TARGETS, depth=8, block_rows=3)  # blocks merge exactly
    assert round_robin(best, 8, 7).tolist() == EXPECTED_ORDER
    np.testing.assert_allclose(score[[0, 5, 7]], [3 / np.sqrt(10), np.sqrt(0.5), 0.0], atol=1e-6)
    # r = 0.75 of m = 8 (K = 1): a budget of 6 samples, the first six picks.
    result = run_selector("rds", _inputs(), SelectionParams(r=0.75))
    assert np.flatnonzero(result.selected).tolist() == [0, 1, 2, 3, 4, 6]
    assert result.selection_rank[EXPECTED_ORDER[:6]].tolist() == [0, 1, 2, 3, 4, 5]
    # Not the top 6 by best cosine, which would take p5 (.707, lower index) over p6.
    assert not result.selected[5]
    # The samples never taken follow by their best cosine: p5 (.707), then p7 (0).
    assert result.selection_rank[[5, 7]].tolist() == [6, 7]
    assert (result.weight == 1).all() and result.per_cluster == 6


def test_rds_under_token_balance_cuts_the_order_at_the_budget():
    lengths = np.array([10, 10, 10, 10, 50, 10, 10, 10])
    inputs = _inputs(lengths=lengths, response_tokens=lengths // 2)
    # B = floor(0.5 * 120) = 60 tokens: p0 (10) + p2 (10) fit, p4 (50) would pass 60: stop.
    result = run_selector("rds", inputs, SelectionParams(r=0.5, balance="tokens"))
    assert np.flatnonzero(result.selected).tolist() == [0, 2]
    assert result.token_budget == 60


def test_rds_refuses_representations_of_different_widths():
    inputs = SelectionInputs(
        np.zeros(8, dtype=np.int64), 1, hidden_mean=POOL, targets=np.ones((2, 3))
    )
    with pytest.raises(ValueError, match="same model"):
        run_selector("rds", inputs, SelectionParams(r=0.5))
