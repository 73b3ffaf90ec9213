"""``balanced_random``: random selection stratified over the pool's sources, the baseline that
RDS+'s tables report as "random (balanced)" (Ivison et al. 2025, *Large-Scale Data Selection for
Instruction Tuning*, arXiv 2503.01807, which finds that at scale most selectors fall below it;
the authors' ``scripts/construct_downsampled_balanced.py:48-59``, README "random-balanced").

Each source (a record's ``source`` field, else its ``dataset`` field as in RDS+'s data, else
the file a sample was read from: ``defs/pass_runner.record_sources``; the built-in dataset is
one source) has its samples in a seeded random order; in rounds, each source in the order its
first sample appears in the pool gives its next sample, a source that has none left being
passed over, until the budget is met:

    order = (round 0: s_1[0], s_2[0], ..., s_S[0]), (round 1: s_1[1], ...), ...

so every source gives the same number of samples (one more for the first few when the budget
does not divide), a small source all of its samples and the rest spread evenly over the larger
ones. The budget is the unclustered one (``base``: K floor(r m) samples, or K B tokens under
token balance, where the order is cut at its longest prefix within the budget), so it is
compared with ``peripheral`` at equal data; weights are 1 and the subset is dealt into random
balanced shards. ``selection_rank`` is the place in that order; the score is null (a random
order). A pool of one source is ``random_global`` with its own permutation.

Departure from the authors' script: it takes each source's records in file order
(``dataset_data.pop(0)``) and shuffles the selection after; here each source's samples are
drawn in a seeded random order, so the subset is random within every source.

Cost: no model pass; the sources are read from the ``raw_instructions`` table and the pool's
files.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from cluster_pipeline.selection.passes import Gathered, PassRunner, Pool
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
    groups_of,
)


def round_robin_order(sources: np.ndarray, seed: int) -> np.ndarray:
    """(N,) int64 the round-robin order over the sources (module docstring): each source's
    samples in a seeded random order, sources in the order of their first sample.

    Args:
        sources: (N,) str each sample's source.
        seed: seeds the order within each source.
    """
    groups = groups_of(sources)
    assert groups is not None
    rng = np.random.default_rng(seed)
    turn = np.empty(len(groups), dtype=np.int64)
    for g in range(int(groups.max()) + 1):
        members = np.flatnonzero(groups == g)
        turn[members[rng.permutation(len(members))]] = np.arange(len(members))
    index = np.arange(len(groups))
    return index[np.lexsort((groups, turn))]


def balanced_random(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The global budget from the round-robin over the sources (module docstring).

    Raises:
        ValueError: sources not one per sample.
    """
    sources = inputs.sources
    assert sources is not None  # run_selector checks the needs
    if len(sources) != inputs.n:
        raise ValueError(f"balanced_random: {len(sources)} sources for a pool of {inputs.n}")
    order = round_robin_order(sources, params.seed)
    budget = global_budget(inputs, params)
    return global_selection(
        "balanced_random", order, inputs, params, budget, np.full(inputs.n, np.nan)
    )


def gather(knobs: BaseModel, pool: Pool, runner: PassRunner) -> Gathered:
    """Each pool sample's source (the runner reads it from ``raw_instructions``)."""
    sources = runner.pool_sources()
    runner.log(sources_line(sources))
    return Gathered(inputs={"sources": sources})


def sources_line(sources: np.ndarray) -> str:
    """The run's line on the pool's sources; with one source, what that makes of the draw."""
    count = len(set(np.asarray(sources).astype(str).tolist()))
    if count > 1:
        return f"balanced_random: {count} sources in the pool"
    return (
        "balanced_random: 1 source in the pool, so the draw is random_global's; records whose "
        "`source` or `dataset` field takes several values, or one file per source, stratify it"
    )


SELECTORS = (
    SelectorSpec(
        "balanced_random",
        "the same budget drawn at random evenly across the pool's sources (its files), as "
        "RDS+'s balanced random baseline",
        balanced_random,
        order=70,
        needs=("sources",),
        source="Ivison et al. 2025 (RDS+), random-balanced: scripts/"
        "construct_downsampled_balanced.py",
        gather=gather,
    ),
)
