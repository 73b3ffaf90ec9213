"""The step plan's useful compute, from the lengths alone: the earlier plans vs today's.

    python benchmarks/step_plan_padding.py        # seconds; no model, no data beyond the lengths

Every packed micro-batch is padded to its longest row, and every rank pays for as many tensor
tokens as the busiest one, so the share of a step's compute spent on real tokens is fixed by the
step plan (``training/plan.py``) before anything trains: Σ_r real tokens / (K x the largest rank's
rows x longest row), summed over the steps. ``benchmarks/training_throughput.py`` measures the
same figure while training (its runs reproduce this script's numbers exactly). This script
compares, in one run and on the same lengths, three plans:

- ``first-fit``: the epoch's random order cut into S consecutive runs of about equal tokens, each
  run greedily into micro-batches of at most the budget, each micro-batch into first-fit
  decreasing rows (the plan of 2026-12-01, the baseline; kept here, not in the product);
- ``even``: the same, with the rows spread evenly over first fit's row count (the plan until
  2026-12-02);
- ``balanced``: today's :func:`~cluster_pipeline.training.plan.plan_packed`: each step's samples
  chosen by the longest-processing-time rule so that every step carries the same tokens, packed
  into rows of about equal length, rows grouped into micro-batches by length.

Lengths: ``benchmarks/throughput_lengths.json`` (the ``make run`` selection of python_stdlib at
256 tokens and alpaca_cherry_5pct at 1,024, K = 2, both balances), at several micro-batch budgets
and row bounds (accumulation 2, one epoch, seed 0).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cluster_pipeline.data import packing
from cluster_pipeline.training import plan as plan_module
from cluster_pipeline.training.plan import MicroBatch, Step

LENGTHS = Path(__file__).resolve().parent / "throughput_lengths.json"
SHAPES = [
    (727, 256),
    (727, 512),
    (1024, 256),
    (1024, 512),
    (1024, 1024),
    (2048, 1024),
    (8192, 4096),
]
Rows = Callable[[Sequence[int], int], list[list[int]]]


def consecutive_plan(lengths_per_rank, budget: int, row: int, rows: Rows) -> list[list[Step]]:
    """The earlier plan (module docstring), rows by ``rows``: accumulation 2, one epoch, seed 0."""
    lengths = [np.asarray(x, dtype=np.int64) for x in lengths_per_rank]
    steps = math.ceil(max(int(x.sum()) for x in lengths) / (2 * budget))
    steps = max(1, min(steps, min(len(x) for x in lengths)))
    plans = []
    for x in lengths:
        order = np.random.default_rng([0, 0]).permutation(len(x))
        cum = np.cumsum(x[order])
        cuts = [0]
        for s in range(1, steps):
            cut = int(np.searchsorted(cum, s * int(cum[-1]) / steps, side="left")) + 1
            cuts.append(min(max(cut, cuts[-1] + 1), len(x) - (steps - s)))
        cuts.append(len(x))
        plan = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            groups: list[list[int]] = []
            total = 0
            for i in order[a:b]:
                if groups and total + x[i] <= budget:
                    groups[-1].append(int(i))
                    total += int(x[i])
                else:
                    groups.append([int(i)])
                    total = int(x[i])
            mbs = [
                MicroBatch(tuple(tuple(g[j] for j in r) for r in rows([int(x[i]) for i in g], row)))
                for g in groups
            ]
            plan.append((0, mbs))
        plans.append(plan)
    return plan_module._aligned(plans)


def useful(plans: list[list[Step]], lengths_per_rank) -> tuple[float, float]:
    """(useful compute over the run, its worst step) of a plan."""
    real_sum = paid_sum = 0.0
    worst = 1.0
    for s in range(len(plans[0])):
        real, paid = [], []
        for r, rank_plan in enumerate(plans):
            lengths = lengths_per_rank[r]
            re = pa = 0
            for mb in rank_plan[s].micro_batches:
                rows = [sum(lengths[i] for i in row_) for row_ in mb.rows] or [1]
                re += sum(rows) if mb.rows else 0
                pa += len(rows) * max(rows)
            real.append(re)
            paid.append(pa)
        real_sum += sum(real)
        paid_sum += len(paid) * max(paid)
        worst = min(worst, plan_module.useful_compute_fraction(real, paid))
    return real_sum / paid_sum, worst


def main() -> None:
    data = json.loads(LENGTHS.read_text())
    print(
        f"{'pool':>20} {'balance':>8} {'budget':>6} {'row':>5} {'steps':>5} "
        f"{'first-fit':>9} {'even':>6} {'balanced':>8} {'ratio':>6}   worst step ff / even / bal"
    )
    for pool, by_balance in data.items():
        for balance, ranks in by_balance.items():
            if balance not in ("samples", "tokens"):
                continue
            lengths = [r["lengths"] for r in ranks]
            for budget, row in SHAPES:
                ff, ff_worst = useful(
                    consecutive_plan(lengths, budget, row, packing.first_fit_rows), lengths
                )
                ev, ev_worst = useful(
                    consecutive_plan(lengths, budget, row, packing.pack_rows), lengths
                )
                now = plan_module.plan_packed(lengths, budget, row, 2, 1, 0)
                bal, bal_worst = useful(now, lengths)
                print(
                    f"{pool:>20} {balance:>8} {budget:>6} {row:>5} {len(now[0]):>5} {ff:>9.3f} "
                    f"{ev:>6.3f} {bal:>8.3f} {bal / ff:>6.3f}   "
                    f"{ff_worst:.3f} / {ev_worst:.3f} / {bal_worst:.3f}"
                )


if __name__ == "__main__":
    main()
