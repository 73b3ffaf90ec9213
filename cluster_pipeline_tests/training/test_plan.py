"""The step plan: every rank takes the same steps and micro-batch counts, sees each sample once
per epoch, and packed steps carry about equal tokens."""

import json
from pathlib import Path

import numpy as np
import pytest

from cluster_pipeline.training.plan import (
    PLACEHOLDER,
    balanced_steps,
    packing_notes,
    plan_packed,
    plan_padded,
    step_micro_batches,
    useful_compute_fraction,
)

LENGTHS = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput_lengths.json"


def test_padded_plan_of_unequal_shards_lines_up_with_placeholders():
    # 10 and 6 samples, batch 2 x 2: ceil(10 / 4) = 3 steps; rank 1 runs out in step 2.
    a, b = plan_padded([10, 6], 2, 2, epochs=1, seed=0)
    assert [len(s.micro_batches) for s in a] == [len(s.micro_batches) for s in b] == [2, 2, 1]
    assert sorted(i for s in a for i in s.samples) == list(range(10))
    assert sorted(i for s in b for i in s.samples) == list(range(6))
    assert b[2].micro_batches == (PLACEHOLDER,) and b[2].samples == []


@pytest.mark.parametrize("seed", range(4))
def test_packed_plan_visits_every_sample_once_per_epoch_in_equal_steps(seed):
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(20, 256, n).tolist() for n in (150, 110, 130)]
    plans = plan_packed(lengths, 1024, 512, accumulation=2, epochs=2, seed=seed)
    assert len({len(p) for p in plans}) == 1
    for s in range(len(plans[0])):
        assert len({len(p[s].micro_batches) for p in plans}) == 1
    for r, plan in enumerate(plans):
        for epoch in (0, 1):
            seen = [i for s in plan if s.epoch == epoch for i in s.samples]
            assert sorted(seen) == list(range(len(lengths[r])))
        for step in plan:
            for mb in step.micro_batches:
                tokens = sum(lengths[r][i] for i in mb.samples)
                assert tokens <= 1024 or len(mb.samples) == 1
                for row in mb.rows:
                    assert sum(lengths[r][i] for i in row) <= 512 or len(row) == 1


def test_packed_steps_follow_the_tokens_not_the_samples():
    # Rank 0: 40 samples of 100 tokens (4,000); rank 1: 10 samples of 400 (4,000). Micro-batches
    # of 1,000 tokens, 2 per step: ceil(4,000 / 2,000) = 2 steps per epoch, 2,000 tokens each.
    plans = plan_packed([[100] * 40, [400] * 10], 1000, 1000, accumulation=2, epochs=1, seed=0)
    for r, plan in enumerate(plans):
        size = 100 if r == 0 else 400
        assert [sum(size for _ in s.samples) for s in plan] == [2000, 2000]
    assert [len(s.samples) for s in plans[0]] == [20, 20]
    assert [len(s.samples) for s in plans[1]] == [5, 5]
    # Rank 1's 5 samples of 400 need 3 micro-batches of <= 1,000 tokens, rank 0's 20 of 100
    # need 2: rank 0 gets a placeholder, so both run 3 forward passes a step.
    assert [len(s.micro_batches) for s in plans[1]] == [3, 3]
    assert plans[0][0].micro_batches[-1] == PLACEHOLDER


def test_the_plan_is_a_function_of_lengths_settings_and_seed():
    lengths = [[30, 40, 50, 60, 70] * 6, [35, 45, 55] * 10]
    assert plan_packed(lengths, 200, 100, 2, 2, seed=3) == plan_packed(lengths, 200, 100, 2, 2, 3)
    assert plan_packed(lengths, 200, 100, 2, 2, seed=3) != plan_packed(lengths, 200, 100, 2, 2, 4)
    assert len(plan_packed(lengths, 200, 100, 2, 2, seed=3, max_steps=3)[0]) == 3


def test_useful_compute_fraction_by_hand():
    # Two ranks; the busier one pays for 1,000 tensor positions: (900 + 500) / (2 x 1,000).
    assert useful_compute_fraction([900, 500], [1000, 600]) == pytest.approx(0.7)
    assert useful_compute_fraction([10, 10], [10, 10]) == 1.0


def test_balanced_steps_by_hand():
    # Samples 0-5 of 5, 4, 3, 3, 2, 1 tokens, epoch order 5, 4, 3, 2, 1, 0. LPT, ties (samples 2
    # and 3) in the epoch's order: 0 -> s0 (5), 1 -> s1 (4), 3 -> s1 (7), 2 -> s0 (8), 4 -> s1
    # (9), 5 -> s0 (9). Each step lists its samples in the epoch's order.
    lengths = np.array([5, 4, 3, 3, 2, 1])
    order = np.array([5, 4, 3, 2, 1, 0])
    assert balanced_steps(lengths, order, 2) == [[5, 2, 0], [4, 3, 1]]
    # Equal lengths: the ties fall in the epoch's order, one sample to each step in turn.
    assert balanced_steps(np.array([7] * 4), np.array([2, 0, 3, 1]), 2) == [[2, 3], [0, 1]]


def test_a_steps_rows_are_even_and_grouped_by_length():
    # 6 samples, 1,100 tokens, rows of at most 400 (budget 800: 2 rows a micro-batch). First fit
    # needs 3 rows; spread evenly they hold 400, 400 and 300 tokens; the two longest rows form
    # the first micro-batch.
    lengths = np.array([300, 250, 200, 150, 100, 100])
    mbs = step_micro_batches(lengths, [0, 1, 2, 3, 4, 5], 800, 400)
    rows = [[int(lengths[i]) for i in row] for mb in mbs for row in mb.rows]
    assert [sum(r) for r in rows] == [400, 400, 300]
    assert [len(mb.rows) for mb in mbs] == [2, 1]
    assert sorted(i for mb in mbs for i in mb.samples) == list(range(6))
    # A budget below the row bound bounds the rows: at most 300 tokens a row, one row a batch.
    small = step_micro_batches(lengths, [0, 1, 2, 3, 4, 5], 300, 400)
    assert all(len(mb.rows) == 1 for mb in small)
    assert all(sum(int(lengths[i]) for i in mb.samples) <= 300 for mb in small)


def test_samples_longer_than_the_row_bound_keep_the_micro_batch_within_its_budget():
    # Rows of at most 100 tokens, micro-batches of 1,024: 10 rows a micro-batch while rows fit
    # the bound. Samples of 200 tokens each make a row of their own, so only 1,024 // 200 = 5
    # fit (1,000 tokens); before 2026-12-03 they were grouped 10 a micro-batch (2,000 tokens).
    mbs = step_micro_batches(np.array([200] * 12), list(range(12)), 1024, 100)
    assert [len(mb.rows) for mb in mbs] == [5, 5, 2]
    # A row bound of 1 token: every sample alone in its row, micro-batches by the longest row.
    lengths = np.array([600, 500, 300, 200, 100, 90, 80])
    mbs = step_micro_batches(lengths, list(range(7)), 1024, 1)
    assert [[int(lengths[i]) for i in mb.samples] for mb in mbs] == [
        [600],
        [500, 300],
        [200, 100, 90, 80],
    ]
    # A sample longer than the budget goes alone; first fit packs the rest into rows of 400 +
    # 100 and 400, which share the next micro-batch (2 x 500 <= 1,024).
    mbs = step_micro_batches(np.array([1500, 400, 400, 100]), [0, 1, 2, 3], 1024, 512)
    assert [mb.rows for mb in mbs] == [((0,),), ((1, 3), (2,))]


def test_packing_notes_name_what_the_settings_do_to_these_lengths():
    lengths = [[68, 120, 300], [90, 700]]
    assert packing_notes(lengths, 1024, 512) == [
        "1 of 5 samples are longer than the row bound 512 (min(max_packed_length, "
        "max_tokens_per_micro_batch)): each is a row of its own, so their micro-batches hold "
        "fewer rows; raise max_packed_length to pack them"
    ]
    assert packing_notes(lengths, 1, 512) == [
        "max_tokens_per_micro_batch = 1 is below every sample (the shortest has 68 tokens): "
        "every micro-batch holds one sample and nothing is packed; set it to several samples' "
        "tokens (cpu_quick: 1,024)"
    ]
    assert packing_notes(lengths, 200, 100) == [
        "2 of 5 samples are longer than max_tokens_per_micro_batch = 200 tokens: each is a "
        "micro-batch of its own",
        "1 of 5 samples are longer than the row bound 100 (min(max_packed_length, "
        "max_tokens_per_micro_batch)): each is a row of its own, so their micro-batches hold "
        "fewer rows; raise max_packed_length to pack them",
    ]
    assert packing_notes(lengths, 1024, 4096) == []


@pytest.mark.parametrize("seed", range(6))
def test_no_micro_batch_tensor_passes_the_budget_but_a_single_longer_sample(seed):
    # Any lengths, any row bound (below, within or above the samples' lengths): rows x the
    # longest row <= max_tokens, or the micro-batch is one row of one sample longer than it.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 700, 60)
    budget = int(rng.integers(50, 2000))
    bound = int(rng.choice([1, 37, 128, 512, 4096]))
    mbs = step_micro_batches(lengths, list(range(60)), budget, bound)
    assert sorted(i for mb in mbs for i in mb.samples) == list(range(60))
    for mb in mbs:
        longest = max(sum(int(lengths[i]) for i in row) for row in mb.rows)
        if len(mb.rows) * longest > budget:
            assert len(mb.rows) == 1 and len(mb.samples) == 1 and longest > budget


@pytest.mark.parametrize("seed", range(4))
def test_every_step_of_a_rank_carries_the_same_tokens_to_within_one_sample(seed):
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(20, 256, n).tolist() for n in (150, 110)]
    plans = plan_packed(lengths, 1024, 512, accumulation=2, epochs=2, seed=seed)
    for r, plan in enumerate(plans):
        for epoch in (0, 1):
            loads = [sum(lengths[r][i] for i in s.samples) for s in plan if s.epoch == epoch]
            assert max(loads) - min(loads) <= max(lengths[r])


@pytest.mark.parametrize(
    ("pool", "budget", "row"),
    [
        ("python_stdlib", 1024, 512),
        ("python_stdlib", 8192, 4096),
        ("alpaca_cherry_5pct", 1024, 512),
    ],
)
def test_token_balanced_plans_spend_at_least_95_percent_of_compute_on_real_tokens(
    pool, budget, row
):
    # The make run selection's lengths (benchmarks/throughput_lengths.json), at the cpu_quick
    # (1,024 / 512) and gpu8 (8,192 / 4,096) shapes: Σ real / Σ (K x the busiest rank's tensor
    # tokens) over the steps, the target 0.95.
    lengths = [r["lengths"] for r in json.loads(LENGTHS.read_text())[pool]["tokens"]]
    plans = plan_packed(lengths, budget, row, accumulation=2, epochs=1, seed=0)
    real = paid = 0
    for s in range(len(plans[0])):
        per_rank = []
        for r, plan in enumerate(plans):
            rows = [
                [sum(lengths[r][i] for i in row_) for row_ in mb.rows] or [1]
                for mb in plan[s].micro_batches
            ]
            real += sum(
                sum(x) for x, mb in zip(rows, plan[s].micro_batches, strict=True) if mb.rows
            )
            per_rank.append(sum(len(x) * max(x) for x in rows))
        paid += len(plans) * max(per_rank)
    assert real == sum(sum(x) for x in lengths)
    assert real / paid >= 0.95
