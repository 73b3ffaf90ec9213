"""``rds``: representation-based selection towards a target set, RDS+ (Ivison et al. 2025,
*Large-Scale Data Selection for Instruction Tuning*, arXiv 2503.01807).

Every pool sample i and every target sample j (a benchmark's prompts with reference solutions,
or a user's folder; ``evaluation/targets.py``) is represented by the mean final hidden state
over its response, L2-normalised (``hidden_mean`` of the embedding pass, docs/design.md
step 1: ``(1/T) sum_t h_t`` over the positions that predict response tokens):

    cos(i, j) = <x_i, t_j>                  x_i = hidden_mean_i / ||hidden_mean_i||, (N, d)
                                            t_j the same for target j, (M, d)

Selection is round-robin over the targets: in rounds, each target j = 0..M-1 in turn takes
its most similar pool sample not yet taken (``argmax_{i not taken} cos(i, j)``, ties to the
lower index) until the budget is met. The budget is the unclustered one (``base``: K floor(r m)
samples, or K B tokens under token balance, where the round-robin order is cut at its longest
prefix within the budget), so ``rds`` is compared with ``peripheral`` at equal data. The score
is ``max_j cos(i, j)``; the samples never taken are ranked after the taken ones by that score.
Weights are 1 and the subset is dealt into random balanced shards, as for the paper's other
baselines.

Departure from RDS+: the paper pools the final hidden states of the whole sequence (prompt and
response) with position weights; this project reuses the embedding pass's unweighted mean over
the response positions, so the pool costs no pass beyond step 1, and embeds the targets the
same way (one forward per target sample, under the pool's settings).

Cost: the pool's representation comes from the embedding pass (N forwards, shared with the
cluster selectors); the target pass is M forwards; the selection is N x M dot products in
blocks of pool rows, keeping each target's best L candidates (L the most samples the budget can
hold: at any pick, fewer than L samples are taken, so a target's next untaken sample is within
its best L), so memory is O(M L + block x M), never N x M.
"""

from __future__ import annotations

import numpy as np

from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    global_budget,
    global_selection,
)

BLOCK_ROWS = 8192


def candidates(
    pool: np.ndarray, targets: np.ndarray, depth: int, block_rows: int = BLOCK_ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """Each target's ``depth`` most similar pool rows, and every pool row's best similarity.

    Args:
        pool: (N, d) float32 L2-normalised pool representations.
        targets: (M, d) float32 L2-normalised target representations.
        depth: L, candidates kept per target (at most N).
        block_rows: pool rows per block of dot products.

    Returns:
        ((M, L) int64 pool indices, most similar first, ties to the lower index; (N,) float64
        ``max_j cos(i, j)``).
    """
    n, m = len(pool), len(targets)
    depth = min(depth, n)
    t = np.asarray(targets, dtype=np.float64)
    best_idx = np.zeros((m, 0), dtype=np.int64)
    best_sim = np.zeros((m, 0), dtype=np.float64)
    score = np.empty(n, dtype=np.float64)
    for start in range(0, n, block_rows):
        stop = min(start + block_rows, n)
        sim = np.asarray(pool[start:stop], dtype=np.float64) @ t.T  # (b, M)
        score[start:stop] = sim.max(axis=1)
        idx = np.broadcast_to(np.arange(start, stop), (m, stop - start))
        all_sim = np.concatenate([best_sim, sim.T], axis=1)
        all_idx = np.concatenate([best_idx, idx], axis=1)
        order = np.lexsort((all_idx, -all_sim), axis=-1)[:, :depth]
        best_sim = np.take_along_axis(all_sim, order, axis=1)
        best_idx = np.take_along_axis(all_idx, order, axis=1)
    return best_idx, score


def round_robin(candidates: np.ndarray, n: int, picks: int) -> np.ndarray:
    """The round-robin order: in rounds, target j = 0..M-1 takes its best candidate not yet
    taken, until ``picks`` samples are taken (or no target has a candidate left).

    Args:
        candidates: (M, L) int64 pool indices per target, best first.
        n: pool size N.
        picks: samples to take.

    Returns:
        (S,) int64 pool indices in the order taken, S <= picks.
    """
    m, depth = candidates.shape
    taken = np.zeros(n, dtype=bool)
    pointer = np.zeros(m, dtype=np.int64)
    order: list[int] = []
    while len(order) < picks:
        progressed = False
        for j in range(m):
            if len(order) >= picks:
                break
            while pointer[j] < depth and taken[candidates[j, pointer[j]]]:
                pointer[j] += 1
            if pointer[j] < depth:
                i = int(candidates[j, pointer[j]])
                taken[i] = True
                order.append(i)
                pointer[j] += 1
                progressed = True
        if not progressed:
            break
    return np.asarray(order, dtype=np.int64)


def most_samples_within(lengths: np.ndarray, budget: int) -> int:
    """The most samples whose tokens fit ``budget`` (the shortest ones), at least 1."""
    total = np.cumsum(np.sort(np.asarray(lengths, dtype=np.int64)))
    return max(1, int(np.searchsorted(total, budget, side="right")))


def rds(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Round-robin over the targets, each taking its most similar untaken pool sample, up to
    the global budget (module docstring); score = max_j cos(i, j).

    Raises:
        ValueError: no target, or representations of different widths.
    """
    pool, targets = inputs.hidden_mean, inputs.targets
    assert pool is not None and targets is not None  # run_selector checks the needs
    if len(targets) == 0:
        raise ValueError("rds: the target set has no sample with a response token")
    if pool.shape[1] != targets.shape[1]:
        raise ValueError(
            f"rds: pool representations are {pool.shape[1]} wide, targets {targets.shape[1]}: "
            "embed both with the same model"
        )
    n = inputs.n
    budget = global_budget(inputs, params)
    if params.balance == "tokens":
        depth = most_samples_within(np.asarray(inputs.lengths), budget)
    else:
        depth = budget
    depth = min(depth, n)
    best, score = candidates(pool, targets, depth)
    taken = round_robin(best, n, depth)
    rest = np.setdiff1d(np.arange(n), taken)
    rest = rest[np.lexsort((rest, -score[rest]))]
    order = np.concatenate([taken, rest])
    return global_selection("rds", order, inputs, params, budget, score)
