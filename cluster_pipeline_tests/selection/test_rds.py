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


# --- Fidelity to the authors' released code (hamishivi/automated-instruction-selection) ------
# Each reference below is a few-line transcription of the cited lines, run on a tiny random
# case; the product must select exactly what it selects.


def _released_round_robin(sim: np.ndarray, output_size: int) -> list[int]:
    """minimal_multitask/get_top_influences.py:237-284 (--selection_method max): every test
    point's influences sorted descending (Python's stable sort: ties keep train order), then in
    rounds each test point pops its best, appends it and drops it again if it was a duplicate;
    cut to output_size at the end."""
    instance_to_influences = {t: dict(enumerate(sim[:, t].tolist())) for t in range(sim.shape[1])}
    sorted_instance_to_influence = {
        t: sorted(infl.items(), key=lambda x: x[1], reverse=True)
        for t, infl in instance_to_influences.items()
    }
    saved_instances: list[int] = []
    while len(saved_instances) < output_size:
        for test_d in sorted_instance_to_influence:
            inst, _ = sorted_instance_to_influence[test_d].pop(0)
            saved_instances.append(inst)
            saved_instances = list(dict.fromkeys(saved_instances))  # remove_dupes_ordered
    return saved_instances[:output_size]


def _released_top_max(sim: np.ndarray, output_size: int) -> list[int]:
    """minimal_multitask/get_top_optimized.py:106-154: a heap of (-score, train_idx) over every
    (test, train) pair, popped until output_size distinct train samples."""
    import heapq

    heap = [(-float(sim[i, t]), i) for t in range(sim.shape[1]) for i in range(sim.shape[0])]
    heapq.heapify(heap)
    saved, seen = [], set()
    while len(saved) < output_size and heap:
        _, inst = heapq.heappop(heap)
        if inst in seen:
            continue
        saved.append(inst)
        seen.add(inst)
    return saved


def _released_aggregated(sim: np.ndarray, tasks: list[str], output_size: int) -> list[int]:
    """minimal_multitask/get_top_aggregated_influences.py:103-106 (max over a task's test
    points) and 131-152 (round-robin over the tasks, a dict keyed by train index)."""
    per_dataset = {}
    for task in dict.fromkeys(tasks):
        cols = [t for t, name in enumerate(tasks) if name == task]
        scores = {i: max(sim[i, t] for t in cols) for i in range(sim.shape[0])}
        per_dataset[task] = sorted(scores.items(), key=lambda x: x[1], reverse=True)
    inter: dict[int, float] = {}
    while len(inter) < output_size:
        for name in per_dataset:
            if len(inter) >= output_size:
                break
            idx, score = per_dataset[name].pop(0)
            inter[idx] = min(score, inter.get(idx, np.inf))
    return list(inter)


def _case(seed: int, n: int = 14, m: int = 4, d: int = 3):
    rng = np.random.default_rng(seed)
    pool = l2_normalise(rng.normal(size=(n, d)).astype(np.float32))
    targets = l2_normalise(rng.normal(size=(m, d)).astype(np.float32))
    return pool, targets


def _selected_order(result, budget: int) -> list[int]:
    return np.argsort(result.selection_rank)[:budget].tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_default_rule_is_the_released_round_robin_that_spends_a_turn_on_a_duplicate(seed):
    pool, targets = _case(seed)
    sim = pool.astype(np.float64) @ targets.T.astype(np.float64)
    inputs = SelectionInputs(np.zeros(14, dtype=np.int64), 1, hidden_mean=pool, targets=targets)
    for r, budget in ((0.5, 7), (0.79, 11)):
        result = run_selector("rds", inputs, SelectionParams(r=r))
        assert _selected_order(result, budget) == _released_round_robin(sim, budget)
        top = run_selector("rds", inputs, SelectionParams(r=r, knobs={"rds_selection": "top_max"}))
        assert _selected_order(top, budget) == _released_top_max(sim, budget)


def _at(*degrees: float) -> np.ndarray:
    radians = np.deg2rad(degrees)
    return np.stack([np.cos(radians), np.sin(radians)], axis=1).astype(np.float32)


def test_the_three_rules_differ_where_a_target_meets_a_duplicate():
    # Targets at 30 and 60 degrees; pool samples at 45, 10, 78 and 170 degrees. By hand:
    #   t0: p0 cos 15 = .966, p1 cos 20 = .940, p2 cos 48 = .669
    #   t1: p0 cos 15 = .966, p2 cos 18 = .951, p1 cos 50 = .643
    # Released round-robin, budget 2: t0 takes p0; t1's best is p0 too: its turn is spent;
    # round 2: t0 takes p1. The earlier rule: t1 skips to p2. Top-max: p0 (.966), p2 (.951).
    pool, targets = _at(45, 10, 78, 170), _at(30, 60)
    inputs = SelectionInputs(np.zeros(4, dtype=np.int64), 1, hidden_mean=pool, targets=targets)
    sim = pool.astype(np.float64) @ targets.T.astype(np.float64)
    orders = {
        rule: _selected_order(
            run_selector("rds", inputs, SelectionParams(r=0.5, knobs={"rds_selection": rule})), 2
        )
        for rule in ("round_robin", "top_max", "round_robin_untaken")
    }
    assert orders == {"round_robin": [0, 1], "top_max": [0, 2], "round_robin_untaken": [0, 2]}
    assert orders["round_robin"] == _released_round_robin(sim, 2)
    assert orders["top_max"] == _released_top_max(sim, 2)


@pytest.mark.parametrize("seed", range(4))
def test_a_target_set_with_tasks_is_round_robined_over_its_tasks_as_released(seed):
    pool, targets = _case(seed, n=16, m=6)
    tasks = ["b", "a", "b", "c", "a", "a"]  # tasks in order of first appearance: b, a, c
    sim = pool.astype(np.float64) @ targets.T.astype(np.float64)
    inputs = SelectionInputs(
        np.zeros(16, dtype=np.int64),
        1,
        hidden_mean=pool,
        targets=targets,
        target_tasks=np.array(tasks),
    )
    result = run_selector("rds", inputs, SelectionParams(r=0.5))
    assert _selected_order(result, 8) == _released_aggregated(sim, tasks, 8)
    # One task (or none) is the per-target round-robin.
    single = SelectionInputs(
        np.zeros(16, dtype=np.int64),
        1,
        hidden_mean=pool,
        targets=targets,
        target_tasks=np.array(["mmlu"] * 6),
    )
    assert _selected_order(
        run_selector("rds", single, SelectionParams(r=0.5)), 8
    ) == _released_round_robin(sim, 8)


def test_rds_pooling_is_the_released_position_weighted_mean_over_the_whole_sequence(
    tiny_model, tiny_tokenizer
):
    """minimal_multitask/compute_influence_cosinesim.py:132-137 (batch size 1): weights
    arange(L) + 1 normalised to sum 1, times hidden_states[-1], summed over positions; the
    product computes it in a padded and in a packed batch."""
    import torch

    from cluster_pipeline.data.packing import collate_rows
    from cluster_pipeline.data.tokenization import encode_sample
    from cluster_pipeline.selection.embedding import embed_batch

    texts = [
        ("", "Add 3 and 4.", "The sum is 7."),
        ("Be brief.", "Reverse the word apple.", "elppa"),
        ("", "Explain the river.", "A river is water that flows to the sea " * 2),
    ]
    encoded = [encode_sample(tiny_tokenizer, *t, max_length=128) for t in texts]
    want = []
    for sample in encoded:
        with torch.no_grad():
            out = tiny_model(input_ids=torch.tensor([sample.input_ids]), output_hidden_states=True)
        hidden_states = out.hidden_states[-1]
        weighting_mask = torch.arange(hidden_states.size(1)).unsqueeze(0) + 1
        weighting_mask = weighting_mask / weighting_mask.sum(dim=1, keepdim=True)
        want.append(torch.sum(hidden_states * weighting_mask.unsqueeze(-1), dim=1)[0].numpy())
    pad = tiny_tokenizer.pad_token_id
    padded = collate_rows(encoded, [[0], [1], [2]], pad, packed=False)
    packed = collate_rows(encoded, [[0, 1], [2]], pad, packed=True)
    for batch in (padded, packed):
        got = embed_batch(tiny_model, batch, pooling="position_weighted").hidden_mean
        np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-6)
    # The response mean is something else.
    plain = embed_batch(tiny_model, padded).hidden_mean
    assert not np.allclose(plain, np.stack(want), atol=1e-3)
