"""The step plan: which samples every rank trains on at every optimizer step, fixed in advance.

Every rank must take the same number of optimizer steps (a rank that stops early leaves the
others waiting in DDP's all-reduce for ever) and, under FSDP, the same number of forward passes
per step (each one all-gathers parameters). The plan is computed from every rank's sample
lengths (gathered once at setup), the same way on every rank, so it is identical everywhere and
a resumed run continues at the same place.

- **Padded** (``packing: false``): epoch e visits each rank's shard in the permutation drawn from
  ``default_rng([seed, e])``, in micro-batches of ``per_device_batch_size`` samples (one per
  row, right-padded), ``gradient_accumulation_steps`` per step; steps per epoch
  ``ceil(max_c n_c / (batch * accumulation))``.
- **Packed** (``packing: true``): steps per epoch
  ``S = ceil(max_c L_c / (accumulation * max_tokens_per_micro_batch))`` (L_c the rank's tokens,
  at most the smallest shard's sample count). Each rank splits its epoch into S steps of equal
  tokens by the longest-processing-time rule (samples longest first, ties in the epoch's random
  order, each into the step with the fewest tokens so far: every step within one sample of
  the others, and in practice within a few tokens). A step's samples are packed into rows of at
  most ``min(max_packed_length, max_tokens_per_micro_batch)`` tokens (first fit's row count,
  spread evenly: data/packing.py), the rows sorted by length and grouped
  ``max_tokens_per_micro_batch // row bound`` to a micro-batch (fewer where a sample longer
  than the bound makes a longer row), so a micro-batch's rows are about equally long, little
  is padded, and its tensor never passes ``max_tokens_per_micro_batch`` tokens but for a
  single longer sample. With token-balanced shards every rank then does the
  same work at every step: the plan's useful compute (``benchmarks/step_plan_padding.py``) is
  0.96-0.99 at the profiles' shapes, against 0.91-0.93 for consecutive runs of the epoch's order
  cut into greedy micro-batches (the plan before 2026-12-02).

Where ranks need different numbers of micro-batches at a step, the shorter plans get
placeholder micro-batches (one padding token, no loss): a forward and backward of one token, so
that the collectives line up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster_pipeline.data.packing import pack_rows


@dataclass(frozen=True)
class MicroBatch:
    """Rows of sample positions (into the rank's shard); no rows = a placeholder."""

    rows: tuple[tuple[int, ...], ...]

    @property
    def samples(self) -> list[int]:
        """The micro-batch's sample positions, row by row."""
        return [i for row in self.rows for i in row]

    @property
    def placeholder(self) -> bool:
        """Whether this is a placeholder (no rows: one padding token, no loss)."""
        return not self.rows


@dataclass(frozen=True)
class Step:
    """One optimizer step of one rank."""

    epoch: int
    micro_batches: tuple[MicroBatch, ...]

    @property
    def samples(self) -> list[int]:
        """The step's sample positions, micro-batch by micro-batch."""
        return [i for mb in self.micro_batches for i in mb.samples]


PLACEHOLDER = MicroBatch(())


def _aligned(per_rank: list[list[tuple[int, list[MicroBatch]]]]) -> list[list[Step]]:
    """Steps whose micro-batch counts agree across ranks (placeholders appended)."""
    steps = len(per_rank[0])
    out: list[list[Step]] = [[] for _ in per_rank]
    for s in range(steps):
        width = max(len(plan[s][1]) for plan in per_rank)
        for r, plan in enumerate(per_rank):
            epoch, mbs = plan[s]
            out[r].append(Step(epoch, tuple(mbs + [PLACEHOLDER] * (width - len(mbs)))))
    return out


def plan_padded(
    n_per_rank: Sequence[int],
    batch_size: int,
    accumulation: int,
    epochs: int,
    seed: int,
    max_steps: int | None = None,
) -> list[list[Step]]:
    """The padded plan of every rank (module docstring); rank r's steps are ``[r]``.

    Raises:
        ValueError: a rank without samples.
    """
    if min(n_per_rank) < 1:
        raise ValueError(f"every rank needs samples, got {list(n_per_rank)}")
    per_epoch = math.ceil(max(n_per_rank) / (batch_size * accumulation))
    plans: list[list[tuple[int, list[MicroBatch]]]] = []
    for n in n_per_rank:
        plan = []
        for epoch in range(epochs):
            order = np.random.default_rng([seed, epoch]).permutation(n)
            micro = [
                MicroBatch(tuple((int(i),) for i in order[j : j + batch_size]))
                for j in range(0, n, batch_size)
            ]
            plan += [
                (epoch, micro[s * accumulation : (s + 1) * accumulation]) for s in range(per_epoch)
            ]
        plans.append(plan[:max_steps] if max_steps else plan)
    return _aligned(plans)


def balanced_steps(lengths: np.ndarray, order: np.ndarray, steps: int) -> list[list[int]]:
    """``order``'s samples into ``steps`` groups of about equal tokens by the
    longest-processing-time rule (Graham 1969): longest first (ties in ``order``), each into the
    group with the fewest tokens so far (ties: fewer samples, then the lower index). Each group
    lists its samples in ``order``. With ``steps <= len(order)`` no group is empty.

    Example: lengths [5, 4, 3, 3, 2, 1] into 2 steps gives 5 + 3 + 1 and 4 + 3 + 2, 9 tokens each.
    """
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    load = [0] * steps
    groups: list[list[int]] = [[] for _ in range(steps)]
    for i in sorted(order.tolist(), key=lambda i: (-int(lengths[i]), position[i])):
        s = min(range(steps), key=lambda k: (load[k], len(groups[k]), k))
        groups[s].append(int(i))
        load[s] += int(lengths[i])
    return [sorted(g, key=lambda i: position[i]) for g in groups]


def step_micro_batches(
    lengths: np.ndarray, samples: Sequence[int], max_tokens: int, max_row: int
) -> list[MicroBatch]:
    """One step's samples of a rank into micro-batches: packed rows of at most
    ``min(max_row, max_tokens)`` tokens (a longer sample alone; :func:`pack_rows`), sorted
    longest first and grouped ``max_tokens // max(row bound, the group's longest row)`` (at
    least 1) to a micro-batch, so each micro-batch's tensor (its rows x its longest row, real
    tokens included) holds at most ``max_tokens`` tokens, in rows of about equal length; only a
    sample longer than ``max_tokens`` exceeds it, alone. A sample longer than the row bound (a
    bound below the samples' lengths) makes a row of its own and its micro-batch holds fewer
    rows."""
    bound = min(max_row, max_tokens)
    packed = pack_rows([int(lengths[i]) for i in samples], bound)
    rows = [tuple(samples[j] for j in row) for row in packed]
    size = {row: sum(int(lengths[i]) for i in row) for row in rows}
    rows.sort(key=lambda row: -size[row])
    out, k = [], 0
    while k < len(rows):
        per = max(1, max_tokens // max(bound, size[rows[k]]))
        out.append(MicroBatch(tuple(rows[k : k + per])))
        k += per
    return out


def plan_packed(
    lengths_per_rank: Sequence[Sequence[int]],
    max_tokens_per_micro_batch: int,
    max_packed_length: int,
    accumulation: int,
    epochs: int,
    seed: int,
    max_steps: int | None = None,
) -> list[list[Step]]:
    """The packed plan of every rank (module docstring); rank r's steps are ``[r]``.

    Args:
        lengths_per_rank: per rank, the token length of each sample of its shard.
        max_tokens_per_micro_batch: most real tokens per micro-batch (a longer sample alone).
        max_packed_length: most tokens per packed row.
        accumulation: micro-batches per step the step count is sized for.
        epochs: passes over each shard.
        seed: the training seed (epoch e's order: ``default_rng([seed, e])``).
        max_steps: cut the plan after this many steps (None: all epochs).

    Raises:
        ValueError: a rank without samples or a sample without tokens.
    """
    lengths = [np.asarray(x, dtype=np.int64) for x in lengths_per_rank]
    if min(len(x) for x in lengths) < 1 or min(int(x.min()) for x in lengths) < 1:
        raise ValueError("every rank needs samples of at least one token")
    totals = [int(x.sum()) for x in lengths]
    per_epoch = math.ceil(max(totals) / (accumulation * max_tokens_per_micro_batch))
    per_epoch = max(1, min(per_epoch, min(len(x) for x in lengths)))
    plans: list[list[tuple[int, list[MicroBatch]]]] = [[] for _ in lengths]
    for epoch in range(epochs):
        for r, x in enumerate(lengths):
            order = np.random.default_rng([seed, epoch]).permutation(len(x))
            for samples in balanced_steps(x, order, per_epoch):
                plans[r].append(
                    (
                        epoch,
                        step_micro_batches(
                            x, samples, max_tokens_per_micro_batch, max_packed_length
                        ),
                    )
                )
    if max_steps:
        plans = [p[:max_steps] for p in plans]
    return _aligned(plans)


def packing_notes(
    lengths_per_rank: Sequence[Sequence[int]],
    max_tokens_per_micro_batch: int,
    max_packed_length: int,
) -> list[str]:
    """What a packed plan of these lengths and settings does that a user may not expect, one
    sentence each (the training log's warnings): a budget below every sample (nothing is
    packed), samples longer than the row bound (rows of their own, fewer rows a micro-batch),
    and samples longer than the budget (micro-batches of their own). Empty when none applies."""
    lengths = np.concatenate([np.asarray(x, dtype=np.int64) for x in lengths_per_rank])
    budget, bound = max_tokens_per_micro_batch, min(max_packed_length, max_tokens_per_micro_batch)
    notes = []
    if len(lengths) and budget < int(lengths.min()):
        notes.append(
            f"max_tokens_per_micro_batch = {budget} is below every sample (the shortest has "
            f"{int(lengths.min())} tokens): every micro-batch holds one sample and nothing is "
            "packed; set it to several samples' tokens (cpu_quick: 1,024)"
        )
    elif (lengths > budget).any():
        notes.append(
            f"{int((lengths > budget).sum())} of {len(lengths)} samples are longer than "
            f"max_tokens_per_micro_batch = {budget} tokens: each is a micro-batch of its own"
        )
    longer = int(((lengths > bound) & (lengths <= budget)).sum())
    if longer:
        notes.append(
            f"{longer} of {len(lengths)} samples are longer than the row bound {bound} "
            f"(min(max_packed_length, max_tokens_per_micro_batch)): each is a row of its own, "
            "so their micro-batches hold fewer rows; raise max_packed_length to pack them"
        )
    return notes


def useful_compute_fraction(real: Sequence[float], padded: Sequence[float]) -> float:
    """Σ_r real tokens / (world size x the largest rank's padded tokens): the share of the
    step's compute (every rank paid for as much as the busiest one) spent on real tokens."""
    top = max(padded)
    return float(sum(real) / (len(padded) * top)) if top > 0 else 0.0
