"""The step plan's useful compute, from the lengths alone: first-fit rows vs evenly spread rows.

    python benchmarks/step_plan_padding.py        # seconds; no model, no data beyond the lengths

Every packed micro-batch is padded to its longest row, and every rank pays for as many tensor
tokens as the busiest one, so the share of a step's compute spent on real tokens is fixed by the
step plan (``training/plan.py``) before anything trains: Σ_r real tokens / (K x the largest rank's
rows x longest row), summed over the steps. ``benchmarks/training_throughput.py`` measures the
same figure while training (its runs reproduce this script's numbers exactly). This script
compares, in one run, the rows of plain first-fit decreasing packing (the baseline, as before)
with :func:`~cluster_pipeline.data.packing.pack_rows` (the same row count, spread evenly), on
the lengths the throughput benchmark saved (``benchmarks/throughput_lengths.json``: the
``make run`` selection of python_stdlib at 256 tokens and alpaca_cherry_5pct at 1,024, K = 2,
both balances), at several micro-batch budgets and row bounds.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster_pipeline.data import packing
from cluster_pipeline.training import plan as plan_module

LENGTHS = Path(__file__).resolve().parent / "throughput_lengths.json"
SHAPES = [(727, 512), (1024, 512), (2048, 1024), (8192, 4096)]


def useful(lengths_per_rank, budget: int, row: int) -> tuple[float, float, int]:
    """(useful compute over the run, its worst step, steps) of the packed plan."""
    plans = plan_module.plan_packed(lengths_per_rank, budget, row, 2, 1, 0)
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
    return real_sum / paid_sum, worst, len(plans[0])


def main() -> None:
    data = json.loads(LENGTHS.read_text())
    print(
        f"{'pool':>20} {'balance':>8} {'budget':>6} {'row':>5} {'steps':>5} "
        f"{'first-fit':>9} {'even':>6} {'ratio':>6} {'worst step ff/even':>19}"
    )
    even_rows = packing.pack_rows
    for pool, by_balance in data.items():
        for balance, ranks in by_balance.items():
            if balance not in ("samples", "tokens"):
                continue
            lengths = [r["lengths"] for r in ranks]
            for budget, row in SHAPES:
                plan_module.pack_rows = packing.first_fit_rows
                ff, ff_worst, steps = useful(lengths, budget, row)
                plan_module.pack_rows = even_rows
                ev, ev_worst, _ = useful(lengths, budget, row)
                print(
                    f"{pool:>20} {balance:>8} {budget:>6} {row:>5} {steps:>5} {ff:>9.3f} "
                    f"{ev:>6.3f} {ev / ff:>6.3f} {ff_worst:>9.3f} / {ev_worst:.3f}"
                )


if __name__ == "__main__":
    main()
