"""The unclustered baselines (docs/design.md, step 3; CluSTER, Kim et al.: the
random baseline and full-data training): clusters are ignored, the subset is dealt into random
balanced shards with weight 1 (selection/sharding.py).

- ``random_global``: the global budget (K * floor(r * m) samples, or K * B tokens under token
  balance; ``base.global_budget``), drawn as the first samples of a seeded permutation of the
  whole pool; the cluster sizes set only the budget, so it is compared with ``peripheral`` at
  equal data.
- ``full``: every sample; ``selection_rank`` is its place in a seeded permutation.

Neither reads the embeddings: their cost record has no model pass.
"""

from __future__ import annotations

import numpy as np

from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
)


def random_global(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The global budget from a seeded permutation of the pool."""
    order = np.random.default_rng(params.seed).permutation(inputs.n)
    budget = global_budget(inputs, params)
    return global_selection(
        "random_global", order, inputs, params, budget, np.full(inputs.n, np.nan)
    )


def full(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Every sample (ranked by a seeded permutation)."""
    order = np.random.default_rng(params.seed).permutation(inputs.n)
    if params.balance == "tokens":
        budget = int(np.asarray(inputs.lengths, dtype=np.int64).sum())
    else:
        budget = inputs.n
    return global_selection("full", order, inputs, params, budget, np.full(inputs.n, np.nan))


SELECTORS = (
    SelectorSpec(
        "random_global",
        "the same budget drawn from the whole pool, without clusters",
        random_global,
        order=10,
        source="Kim et al., CluSTER, random baseline",
    ),
    # r does not bound what full keeps.
    SelectorSpec("full", "all data", full, order=11, source="full-data training", budgeted=False),
)
