"""``rds``: representation-based selection towards a target set, RDS+ (Ivison et al. 2025,
*Large-Scale Data Selection for Instruction Tuning*, arXiv 2503.01807; the authors' code,
hamishivi/automated-instruction-selection).

Every pool sample i and every target sample j (a benchmark's prompts with reference solutions,
or a user's folder; ``evaluation/targets.py``) is represented by a pooled final hidden state,
L2-normalised, and compared by cosine:

    cos(i, j) = <x_i, t_j>                  x_i the pool sample's, (N, d); t_j the target's, (M, d)

Pooling (``RdsKnobs.rds_pooling``). By default RDS+'s: the position-weighted mean of the final
hidden states over every position p = 0 .. L-1 of the sample, prompt and response,
``sum_p (p + 1) h_p / sum_p (p + 1)`` (``minimal_multitask/compute_influence_cosinesim.py:
132-137``, after SGPT; selection/embedding.py), computed by rds's own pass over the pool and the
target set. ``response_mean`` reuses the embedding pass's unweighted mean over the response
positions (``hidden_mean``, docs/design.md step 1), so the pool costs no pass beyond step 1.

Selection (``RdsKnobs.rds_selection``). By default the rule of the authors' main pipeline
(README: ``get_top_influences --selection_method max``; ``minimal_multitask/
get_top_influences.py:237-284``): in rounds, each target j = 0..M-1 in turn takes its next most
similar pool sample (ties to the lower index); a sample already taken is not taken again, and
that target's turn is spent on it. ``top_max`` is the authors' other selection script
(``get_top_optimized.py:106-154``): the pool's samples by their best cosine to any target,
``max_j cos(i, j)``, highest first. ``round_robin_untaken`` is this project's earlier rule (each
target skips to its best sample not yet taken, so every turn takes a new sample).

Tasks. When the target set has tasks (at least two: MMLU's topics, a folder's `task` field or files;
``evaluation/targets.target_tasks``), the round-robin runs over the tasks instead of the
target samples, as the authors' multi-task selection (``get_top_aggregated_influences.py:
103-106,131-152``): each task t scores pool sample i by ``max_{j in t} cos(i, j)``, and in rounds
each task in turn takes its next best sample (a duplicate spends its turn). ``top_max`` has no
task step (the max over every target is the max over the tasks).

The budget is the unclustered one (``base``: K floor(r m) samples, or K B tokens under token
balance, where the order is cut at its longest prefix within the budget), so ``rds`` is
compared with ``peripheral`` at equal data. The score is ``max_j cos(i, j)``; the samples
never taken are ranked after the taken ones by that score. Weights are 1 and the subset is
dealt into random balanced shards, as for the paper's other baselines.

Cost: with RDS+'s pooling, its pool pass (N forwards) and the target pass (M forwards); with
``response_mean``, the embedding pass (shared with the cluster selectors) and the target pass;
no backward pass. The selection is N x M dot products in blocks of pool rows, keeping each
target's (or task's) best L candidates (L the most samples the budget can hold: a target's
r-th turn takes its r-th best, and after L rounds the targets' top L hold at least L samples),
so memory is O(M L + block x M), never N x M.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    ForwardPass,
    Gathered,
    PassFailed,
    PassRunner,
    Pool,
    TargetKnobs,
    target_rules,
)
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
    groups_of,
)

# rds's own passes: the pool under RDS+'s pooling, and the target set.
PASS_RDS_POOL = "rds_pool"
PASS_TARGETS = "targets"
# What the record of a targeted selection keeps (rds, less): the target set's name or folder,
# and its samples used.
TARGET_DETAILS = {"selection_target": None, "selection_target_samples": 0}

BLOCK_ROWS = 8192

RdsSelection = Literal["round_robin", "top_max", "round_robin_untaken"]
RdsPooling = Literal["position_weighted", "response_mean"]


class RdsKnobs(TargetKnobs):
    """rds's knobs: its target set (the targeted selectors'), its selection rule and its
    pooling (module docstring)."""

    rds_selection: RdsSelection = Field(
        default="round_robin",
        description="rds only: round_robin = the authors' main rule (get_top_influences.py: in "
        "rounds each target, or each task of a target set with tasks, takes its next most "
        "similar sample; a duplicate spends the turn); top_max = their get_top_optimized.py "
        "(highest best cosine first); round_robin_untaken = each target skips to its best "
        "sample not yet taken (this project's rule before issue 41).",
    )
    rds_pooling: RdsPooling = Field(
        default="position_weighted",
        description="rds only: position_weighted = RDS+'s representation, the final hidden "
        "states of the whole sequence averaged with weights proportional to the position (one "
        "extra forward pass over the pool); response_mean = the embedding pass's mean over the "
        "response positions (no extra pass).",
    )


def candidates(
    pool: np.ndarray,
    targets: np.ndarray,
    depth: int,
    block_rows: int = BLOCK_ROWS,
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each target's (or each group of targets') ``depth`` most similar pool rows, and every
    pool row's best similarity.

    Args:
        pool: (N, d) float32 L2-normalised pool representations.
        targets: (M, d) float32 L2-normalised target representations.
        depth: L, candidates kept per target or group (at most N).
        block_rows: pool rows per block of dot products.
        groups: (M,) int64 each target's group in [0, G) (a task); a group scores a pool row
            by its best cosine to the group's targets. None: every target its own.

    Returns:
        ((M, L) or (G, L) int64 pool indices, most similar first, ties to the lower index;
        (N,) float64 ``max_j cos(i, j)``).
    """
    n = len(pool)
    depth = min(depth, n)
    t = np.asarray(targets, dtype=np.float64)
    columns = len(t) if groups is None else int(groups.max()) + 1
    best_idx = np.zeros((columns, 0), dtype=np.int64)
    best_sim = np.zeros((columns, 0), dtype=np.float64)
    score = np.empty(n, dtype=np.float64)
    for start in range(0, n, block_rows):
        stop = min(start + block_rows, n)
        sim = np.asarray(pool[start:stop], dtype=np.float64) @ t.T  # (b, M)
        score[start:stop] = sim.max(axis=1)
        if groups is not None:
            sim = np.stack([sim[:, groups == g].max(axis=1) for g in range(columns)], axis=1)
        idx = np.broadcast_to(np.arange(start, stop), (columns, stop - start))
        all_sim = np.concatenate([best_sim, sim.T], axis=1)
        all_idx = np.concatenate([best_idx, idx], axis=1)
        order = np.lexsort((all_idx, -all_sim), axis=-1)[:, :depth]
        best_sim = np.take_along_axis(all_sim, order, axis=1)
        best_idx = np.take_along_axis(all_idx, order, axis=1)
    return best_idx, score


def round_robin(
    candidates: np.ndarray, n: int, picks: int, spend_duplicates: bool = False
) -> np.ndarray:
    """The round-robin order: in rounds, each row j = 0..M-1 of ``candidates`` (a target or a
    task) takes its next candidate, until ``picks`` samples are taken (or no row has a
    candidate left). ``spend_duplicates``: a candidate already taken is passed over and the
    turn is spent (the authors' ``get_top_influences.py:237-284``); else the row skips to its
    best candidate not yet taken.

    Args:
        candidates: (M, L) int64 pool indices per row, best first.
        n: pool size N.
        picks: samples to take.
        spend_duplicates: see above.

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
            if not spend_duplicates:
                while pointer[j] < depth and taken[candidates[j, pointer[j]]]:
                    pointer[j] += 1
            if pointer[j] < depth:
                i = int(candidates[j, pointer[j]])
                pointer[j] += 1
                progressed = True
                if not taken[i]:
                    taken[i] = True
                    order.append(i)
        if not progressed:
            break
    return np.asarray(order, dtype=np.int64)


def most_samples_within(lengths: np.ndarray, budget: int) -> int:
    """The most samples whose tokens fit ``budget`` (the shortest ones), at least 1."""
    total = np.cumsum(np.sort(np.asarray(lengths, dtype=np.int64)))
    return max(1, int(np.searchsorted(total, budget, side="right")))


def rds(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The rule of ``rds_selection`` over the targets (or their tasks), up to the global budget
    (module docstring); score = max_j cos(i, j).

    Raises:
        ValueError: no target, representations of different widths, or tasks not one per
            target.
    """
    pool, targets = inputs.hidden_mean, inputs.targets
    assert pool is not None and targets is not None  # run_selector checks the needs
    knobs = params.knobs if isinstance(params.knobs, RdsKnobs) else RdsKnobs()
    if len(targets) == 0:
        raise ValueError("rds: the target set has no sample with a response token")
    if pool.shape[1] != targets.shape[1]:
        raise ValueError(
            f"rds: pool representations are {pool.shape[1]} wide, targets {targets.shape[1]}: "
            "embed both with the same model"
        )
    tasks = inputs.target_tasks
    if tasks is not None and len(tasks) != len(targets):
        raise ValueError(f"rds: {len(tasks)} target tasks for {len(targets)} target samples")
    n = inputs.n
    budget = global_budget(inputs, params)
    if params.balance == "tokens":
        depth = most_samples_within(np.asarray(inputs.lengths), budget)
    else:
        depth = budget
    depth = min(depth, n)
    groups = groups_of(tasks, at_least=2)
    index = np.arange(n)
    if knobs.rds_selection == "top_max":
        _, score = candidates(pool, targets, 1)
        order = index[np.lexsort((index, -score))]
        return global_selection("rds", order, inputs, params, budget, score)
    best, score = candidates(pool, targets, depth, groups=groups)
    spend = knobs.rds_selection == "round_robin"
    taken = round_robin(best, n, depth, spend_duplicates=spend)
    rest = np.setdiff1d(index, taken)
    rest = rest[np.lexsort((rest, -score[rest]))]
    order = np.concatenate([taken, rest])
    return global_selection("rds", order, inputs, params, budget, score)


def gather(knobs: RdsKnobs, pool: Pool, runner: PassRunner) -> Gathered:
    """The pool's representations and the target set's, under ``rds_pooling``: RDS+'s
    position-weighted mean from rds's own pass over the pool, or the pool pass's
    ``hidden_mean``; the target set read first (a bad target fails before any model loads),
    embedded under the pool pass's model and settings with the same pooling, cached per
    sample; its samples without a response token within ``max_length`` left out, with their
    tasks.

    Raises:
        PassFailed: no target sample has a response token.
    """
    size = runner.target_set(knobs.target, knobs.target_size)
    weighted = knobs.rds_pooling == "position_weighted"
    passes = []
    if weighted:
        out = runner.forward(
            ForwardPass(
                PASS_RDS_POOL,
                pooling="position_weighted",
                read=("hidden_mean",),
                label="rds pool pass (position-weighted pooling)",
            )
        )
        hidden = l2_normalise(out.values["hidden_mean"].astype(np.float32))
        hidden[~out.ran] = 0.0
        passes.append(out.cost)
    else:
        hidden = runner.pool_vectors("hidden_mean_normalised")
    label = f"rds target set {knobs.target}"
    out = runner.forward(
        ForwardPass(
            PASS_TARGETS,
            over="targets",
            pooling=knobs.rds_pooling,
            read=("hidden_mean",),
            label=label,
        )
    )
    if not out.ran.any():
        raise PassFailed(
            f"no sample of the {label} has a response token within max_length={pool.max_length}"
        )
    vectors = l2_normalise(out.values["hidden_mean"][out.ran].astype(np.float32))
    tasks = runner.target_tasks()[out.ran]
    runner.log(f"{label}: {len(vectors)} of {size} samples embedded ({out.run_now} now)")
    return Gathered(
        inputs={"hidden_mean": hidden, "targets": vectors, "target_tasks": tasks},
        passes=(*passes, out.cost),
        details={"selection_target": knobs.target, "selection_target_samples": len(vectors)},
        reads_pool_pass=not weighted,
    )


SELECTORS = (
    SelectorSpec(
        "rds",
        "RDS+: round-robin over the target set (peripheral_subsets.target) or its tasks, each "
        "taking its next most similar pool sample by the cosine of position-weighted mean "
        "hidden states (peripheral_subsets.rds_*)",
        rds,
        order=30,
        needs=("hidden_mean", "targets"),
        passes=(PASS_EMBEDDING, PASS_RDS_POOL, PASS_TARGETS),
        source="Ivison et al. 2025, Large-Scale Data Selection for Instruction Tuning "
        "(hamishivi/automated-instruction-selection)",
        knobs=RdsKnobs,
        gather=gather,
        rules=target_rules,
        details=TARGET_DETAILS,
    ),
)
