"""``less``: LESS (Xia et al. 2024, *LESS: Selecting Influential Data for Targeted Instruction
Tuning*, ICML 2024, arXiv 2402.04333; the authors' code, princeton-nlp/LESS,
``less/data_selection/collect_grad_reps.py`` and ``matching.py``).

A short LoRA warm-up on a small random share of the pool leaves C checkpoints theta_1..theta_C
with their AdamW moments. At each, every pool sample z gets its Adam-preconditioned LoRA
gradient Gamma(z, theta_i) (the update the sample would make: by default as the authors'
code computes it, ``m' / sqrt(v' + eps)`` without bias correction,
``collect_grad_reps.py:111-127``; ``less_adam: paper`` for eq. (1);
selection/gradient_features.adam_precondition) and every target sample z' its plain gradient
grad l(z'; theta_i); both are randomly projected to d dimensions with the same projection and
L2-normalised (``SelectionInputs.less_gradients``, (N, C, d), and ``less_target_gradients``,
(M, C, d)). The influence of z on z' is the learning-rate-weighted sum of cosines over the
checkpoints (eq. (2)), and a sample's score is its influence on the subtask it helps most
(section 3, "Data selection"; ``matching.py:75-79``: the influences averaged over each
subtask's target samples, then the max over the subtasks):

    Inf(z, z') = sum_{i=1..C} eta_i cos(Gamma(z, theta_i), grad l(z'; theta_i))
    score(z)   = max_{subtask s} (1/|s|) sum_{z' in s} Inf(z, z')

The subtasks are the target set's tasks where it has at least two (MMLU's topics, a folder's
files; ``evaluation/targets.target_tasks``); a set without them (HumanEval, MBPP, for which the
authors' code defines none) has each target sample as its own subtask, so the score is the max
over the target samples. ``less_subtasks: max`` takes that max over single samples whatever the
tasks (this project's rule before issue 41).

eta_i is the mean learning rate of the warm-up's steps since the previous checkpoint (the
paper's eta-bar_i, the epoch's mean), renormalised to sum 1 as the authors' ``matching.py``
does (the order does not change). The top-scoring samples are kept up to the unclustered budget
(``base``: K floor(r m) samples, or K B tokens under token balance, the longest prefix of the
order within them), so ``less`` is compared with ``peripheral`` at equal data; weights are 1 and
the subset is dealt into random balanced shards, as for the paper's other baselines. Ties go to
the lower index.

Departures from the paper, all at our sizes:
- The warm-up is the pool pass's base model with LoRA adapters (``peripheral_subsets.less_*``:
  a seeded random ``less_warmup_fraction`` of the pool, the paper's 5 %; ``less_warmup_steps``
  optimizer steps with a checkpoint every ``less_warmup_steps / less_checkpoints``, not 4 epochs;
  LoRA rank ``less_lora_r``, peft's default target modules (q_proj and v_proj for Llama; the
  paper adapts all four attention projections at rank 128, alpha 512, dropout 0.1); the
  project's batch sizes, AdamW and schedule at ``less_learning_rate``).
- The projection is a hashed Rademacher matrix (+-1 / sqrt(d), selection/gradient_features.
  RademacherProjection), not TRAK's CUDA projector; same distribution, but device-independent
  and rebuilt in blocks. d = ``less_projection_dim`` (>= 1,024; the paper's 8,192).
- The target set is a named benchmark's prompts with reference solutions or a user's folder
  (evaluation/targets.py); subtasks as above.
- The authors hard-code Adam's b1, b2 and eps (0.9, 0.999, 1e-8) in the preconditioning; here
  they are the checkpoint's AdamW settings (the same values by default).

Cost: the warm-up (its sample visits, one forward and one backward pass each), then per
checkpoint one forward and one backward pass per pool sample and per target sample (batched:
per-sample gradients of a padded batch from one backward pass, selection/gradient_features.
per_sample_gradients), each projected (P x d multiply-adds per sample, P the LoRA
parameters, and P x d hashed signs rebuilt once per group of gradients, about once per chunk of
a rank's pass: training/gradient_pass.py); the selection itself is N x M x C dot products of
length d, in blocks of pool rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import polars as pl
from pydantic import Field

from cluster_pipeline.selection.passes import (
    BriefTraining,
    ForwardPass,
    Gathered,
    GradientRequest,
    PassCost,
    PassFailed,
    PassRunner,
    Pool,
    SelectionFacts,
    TargetKnobs,
    TrainedRun,
    checkpoint_rules,
    knob,
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
from cluster_pipeline.selection.selectors.rds import TARGET_DETAILS
from cluster_pipeline.storage.names import LESS_GRADIENTS

BLOCK_ROWS = 4096
# less's own passes: the LoRA warm-up, and per warm-up checkpoint the gradients of the pool and
# of the target set.
PASS_LESS_WARMUP = "less_warmup"
PASS_LESS_GRADIENTS = "less_gradients"
PASS_LESS_TARGETS = "less_targets"
# The seed of the warm-up share's draw: shared by every selection seed, like the warm-up run.
LESS_SEED = 0
GradientKind = Literal["adam_released", "adam_paper", "sgd"]


class LessPassKnobs(TargetKnobs):
    """The knobs of less's passes, which cluster_less shares: the target set (as rds), the
    warm-up, the preconditioning and the projection."""

    less_warmup_fraction: float = Field(
        default=0.05,
        gt=0.0,
        le=1.0,
        description="less only: the seeded random share of the clustered pool its LoRA warm-up "
        "trains on (the paper's 5 %), at least one sample per rank of proxy_embeddings' world "
        "size.",
    )
    less_warmup_steps: int = Field(
        default=8,
        ge=1,
        description="less only: optimizer steps of the LoRA warm-up (under torchrun with "
        "proxy_embeddings' world size, the project's training batch sizes); a multiple of "
        "less_checkpoints. Sized for a CPU: the paper warms up for 4 epochs.",
    )
    less_checkpoints: int = Field(
        default=4,
        ge=1,
        description="less only: C, the warm-up checkpoints (every less_warmup_steps / C steps, "
        "the paper's 4) at which the pool's and the targets' per-sample gradients are taken: "
        "one forward and one backward pass per sample each.",
    )
    less_lora_r: int = Field(
        default=8,
        ge=1,
        description="less only: LoRA rank of the warm-up (peft's default target modules); the "
        "gradients have the adapters' size. The paper's 128 makes them 16x longer.",
    )
    less_learning_rate: float = Field(
        default=1e-4,
        gt=0.0,
        description="less only: peak AdamW learning rate of the warm-up (the paper's 2e-5 at "
        "rank 128 moves a short run's adapters little).",
    )
    less_adam: Literal["released", "paper"] = Field(
        default="released",
        description="less only: the Adam preconditioning of the pool's gradients. released = "
        "the authors' code, m' / sqrt(v' + eps) without bias correction (eps under the root "
        "outweighs every coordinate with sqrt(v') < 1e-4); paper = eq. (1), "
        "m_hat / (sqrt(v_hat) + eps).",
    )
    less_projection_dim: int = Field(
        default=8192,
        ge=1024,
        description="less only: d, the dimension of the gradients' seeded Rademacher random "
        "projection (the paper's 8192; a cosine's error is of order 1 / sqrt(d)).",
    )


class LessKnobs(LessPassKnobs):
    """less's knobs: its passes' and how the influence aggregates over the target's tasks."""

    less_subtasks: Literal["mean_max", "max"] = Field(
        default="mean_max",
        description="less only: mean_max = the authors' matching.py, the influence averaged "
        "over each subtask's target samples, then the max over subtasks (a target set with at "
        "least two tasks: MMLU's topics, a folder's `task` field or files); max = the max over "
        "single target samples whatever the tasks.",
    )


def warmup_share(n: int, fraction: float, seed: int = LESS_SEED) -> np.ndarray:
    """(S,) int64 sorted indices of the warm-up's samples among the pool's N: a seeded draw of
    S = max(1, ceil(fraction x N)) without replacement (ceil of ``fraction x N`` rounded to 9
    decimals)."""
    size = max(1, math.ceil(round(fraction * n, 9)))
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(size, n), replace=False)).astype(np.int64)


def checkpoint_weights(learning_rates: Sequence[float] | np.ndarray) -> np.ndarray:
    """eta_i / sum_i eta_i, (C,) float64 (the authors' ``matching.py`` renormalisation).

    Raises:
        ValueError: a negative learning rate, or none positive.
    """
    eta = np.asarray(learning_rates, dtype=np.float64).reshape(-1)
    if len(eta) == 0 or (eta < 0).any() or eta.sum() <= 0:
        raise ValueError(f"less: checkpoint learning rates {eta.tolist()} must be >= 0, not all 0")
    return eta / eta.sum()


def _per_checkpoint(x: np.ndarray, what: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 2:  # one checkpoint
        x = x[:, None, :]
    if x.ndim != 3:
        raise ValueError(f"less: {what} must be (rows, C, d) or (rows, d), got shape {x.shape}")
    return x


def influence_scores(
    pool: np.ndarray,
    targets: np.ndarray,
    learning_rates: Sequence[float] | np.ndarray,
    block_rows: int = BLOCK_ROWS,
    subtasks: np.ndarray | None = None,
) -> np.ndarray:
    """score(z) = max_s mean_{z' in s} sum_i eta_i cos(Gamma(z, theta_i), grad l(z'; theta_i))
    (module docstring) for every pool sample; every target its own subtask when ``subtasks``
    is None.

    Args:
        pool: (N, C, d) float32 L2-normalised projected Adam gradients of the pool, checkpoint
            i in column i ((N, d) for one checkpoint); zero rows (no gradient) score 0.
        targets: (M, C, d) float32 L2-normalised projected gradients of the target samples.
        learning_rates: (C,) the checkpoints' eta_i (renormalised to sum 1).
        block_rows: pool rows per block (memory: block_rows x M floats).
        subtasks: (M,) int64 each target's subtask in [0, S); None: each target its own.

    Returns:
        (N,) float64 scores, in [-1, 1].

    Raises:
        ValueError: shapes that disagree (checkpoints, d), no target, or bad learning rates.
    """
    x, t = _per_checkpoint(pool, "pool gradients"), _per_checkpoint(targets, "target gradients")
    eta = checkpoint_weights(learning_rates)
    if len(t) == 0:
        raise ValueError("less: the target set has no sample with a gradient")
    if x.shape[1:] != t.shape[1:] or x.shape[1] != len(eta):
        raise ValueError(
            f"less: pool gradients {x.shape[1:]} and target gradients {t.shape[1:]} (C, d) "
            f"for {len(eta)} checkpoint learning rates: compute both at the same checkpoints "
            "with the same projection"
        )
    # Weighting the targets by eta_i makes sum_i eta_i <x_i, t_i> one dot product over (C d).
    weighted = (t.astype(np.float64) * eta[None, :, None]).reshape(len(t), -1)
    if subtasks is not None:
        # The mean of a subtask's dot products is the dot product with its mean target.
        count = np.bincount(subtasks)
        summed = np.zeros((len(count), weighted.shape[1]))
        np.add.at(summed, subtasks, weighted)
        weighted = summed / count[:, None]
    score = np.empty(len(x), dtype=np.float64)
    for start in range(0, len(x), block_rows):
        block = x[start : start + block_rows].astype(np.float64).reshape(-1, weighted.shape[1])
        score[start : start + block_rows] = (block @ weighted.T).max(axis=1)
    return score


def declared_subtasks(tasks: np.ndarray | None) -> np.ndarray | None:
    """(M,) int64 each target's subtask for ``matching.py``'s mean-then-max, or None (each
    target its own subtask, the max over targets) when the target set names no task (a code
    benchmark, a one-file folder without a ``task`` field: every task ""). One named task is
    one subtask: the mean over all targets, as ``matching.py:78-79`` with one subtask gives
    (``.reshape(N, 1, -1).mean(-1).max(-1)``)."""
    if tasks is None or not any(str(t) for t in tasks):
        return None
    return groups_of(tasks)


def subtasks_line(tasks: np.ndarray, rule: str) -> str:
    """The log line saying how the influence aggregates over the target set's M samples:
    over how many named subtasks (:func:`declared_subtasks`), under ``less_subtasks``."""
    groups = declared_subtasks(tasks)
    m = len(tasks)
    if rule == "max":
        return f"less: the max over the {m} target samples (less_subtasks: max)"
    if groups is None:
        return f"less: the target set names no task: the max over its {m} samples"
    t = int(groups.max()) + 1
    return (
        f"less: the mean over each of the target set's {t} task(s), then the max over them "
        f"({m} samples; less_subtasks: mean_max, matching.py)"
    )


def less(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """The highest scores first, up to the global budget (module docstring); score = the
    learning-rate-weighted cosine influence on the target sample it helps most.

    Raises:
        ValueError: gradients not for the pool's N samples, or :func:`influence_scores`'s.
    """
    pool, targets = inputs.less_gradients, inputs.less_target_gradients
    eta = inputs.less_learning_rates
    assert pool is not None and targets is not None and eta is not None  # run_selector checks
    if len(pool) != inputs.n:
        raise ValueError(f"less: gradients of {len(pool)} samples for a pool of {inputs.n}")
    knobs = params.knobs if isinstance(params.knobs, LessKnobs) else LessKnobs()
    tasks = inputs.target_tasks
    if tasks is not None and len(tasks) != len(targets):
        raise ValueError(f"less: {len(tasks)} target tasks for {len(targets)} target samples")
    subtasks = declared_subtasks(tasks) if knobs.less_subtasks == "mean_max" else None
    score = influence_scores(pool, targets, eta, subtasks=subtasks)
    index = np.arange(inputs.n)
    order = index[np.lexsort((index, -score))]
    return global_selection("less", order, inputs, params, global_budget(inputs, params), score)


@dataclass(frozen=True)
class LessGradients:
    """What less's passes gave (:func:`gradient_passes`).

    Attributes:
        pool: (n, C, d) float32 the projected Adam-preconditioned gradients of the pool samples
            asked for, in that order.
        targets: (M', C, d) float32 the target samples' plain ones, those with a gradient at
            every checkpoint.
        tasks: (M',) str their tasks.
        warmup: the warm-up run (its checkpoints and learning rates).
        costs: the passes' cost records, the warm-up first.
    """

    pool: np.ndarray
    targets: np.ndarray
    tasks: np.ndarray
    warmup: TrainedRun
    costs: tuple[PassCost, ...]

    def details(self, knobs: LessPassKnobs) -> dict:
        """The record's details: the target set, the warm-up's checkpoints, steps and eta_i."""
        rates = self.warmup.learning_rates
        return {
            "selection_target": knobs.target,
            "selection_target_samples": len(self.targets),
            "s2l_proxy_checkpoints": [c.path for c in self.warmup.checkpoints],
            "s2l_checkpoint_steps": [c.step for c in self.warmup.checkpoints],
            "less_learning_rates": [round(r, 10) for r in rates],
        }


def gradient_passes(
    knobs: LessPassKnobs,
    pool: Pool,
    runner: PassRunner,
    samples: tuple[int, ...] | None = None,
    who: str = "less",
) -> LessGradients:
    """Less's passes (module docstring): the target set read first (a bad one fails before any
    model loads), the LoRA warm-up on a seeded share of the pool (the same run for every
    selector that asks: reused when finished), then per warm-up checkpoint the Adam-
    preconditioned gradients of the pool samples ``samples`` (None: all) and the targets'
    plain ones, cached per sample under the checkpoint's own key (so cluster_less's
    representatives reuse less's rows and the other way round).

    Raises:
        PassFailed: no target sample has a response token.
    """
    runner.target_set(knobs.target, knobs.target_size)
    warmup = runner.train(
        BriefTraining(
            PASS_LESS_WARMUP,
            "less warm-up",
            knobs.less_warmup_steps,
            knobs.less_checkpoints,
            knobs.less_learning_rate,
            samples=warmup_share(pool.n, knobs.less_warmup_fraction),
            lora_r=knobs.less_lora_r,
            optimizer_states=True,
            learning_rates=True,
        )
    )
    d = knobs.less_projection_dim
    costs = [warmup.cost]
    pool_columns, target_columns, kept = [], [], np.zeros(0, dtype=bool)
    adam: GradientKind = "adam_released" if knobs.less_adam == "released" else "adam_paper"
    for ckpt in warmup.checkpoints:
        passes: tuple[tuple[GradientKind, Literal["pool", "targets"], str], ...] = (
            (adam, "pool", PASS_LESS_GRADIENTS),
            ("sgd", "targets", PASS_LESS_TARGETS),
        )
        for kind, over, name in passes:
            gradients = GradientRequest(ckpt.path, kind, d)
            out = runner.forward(
                ForwardPass(
                    name,
                    over=over,
                    key=f"{name}-{kind}-d{d}-s{gradients.projection_seed}",
                    samples=samples if over == "pool" else None,
                    gradients=gradients,
                    read=("embedding",),
                    label=f"{who} {'pool' if over == 'pool' else 'target'} gradients, step "
                    f"{ckpt.step}",
                )
            )
            costs.append(replace(out.cost, backward=out.cost.samples))
            if over == "pool":
                pool_columns.append(out.values["embedding"])
            else:
                target_columns.append(out.values["embedding"])
                kept = out.ran if not len(kept) else kept & out.ran
    if not kept.any():
        raise PassFailed(
            f"no sample of the {who} target set {knobs.target} has a response token within "
            f"max_length={pool.max_length}"
        )
    targets = np.stack(target_columns, axis=1)[kept]
    tasks = runner.target_tasks()[kept]
    grads = np.stack(pool_columns, axis=1)
    steps = [c.step for c in warmup.checkpoints]
    runner.log(
        f"{who}: {len(grads)} pool and {len(targets)} target gradients at warm-up steps "
        f"{steps} (learning rates {[f'{r:.3g}' for r in warmup.learning_rates]}), projected "
        f"to d = {d}"
    )
    return LessGradients(grads, targets, tasks, warmup, tuple(costs))


def gather(knobs: LessKnobs, pool: Pool, runner: PassRunner) -> Gathered:
    """Less's passes over the whole pool (:func:`gradient_passes`); the pool's gradients written
    as the ``less_gradients`` table.

    Raises:
        PassFailed: no target sample has a response token.
    """
    got = gradient_passes(knobs, pool, runner)
    runner.log(subtasks_line(got.tasks, knobs.less_subtasks))
    runner.write_table(
        LESS_GRADIENTS,
        pl.DataFrame(
            {
                "sample_id": list(pool.sample_ids),
                "gradients": got.pool.reshape(pool.n, -1).tolist(),
            },
            schema={"sample_id": pl.String, "gradients": pl.List(pl.Float32)},
        ),
    )
    return Gathered(
        inputs={
            "less_gradients": got.pool,
            "less_target_gradients": got.targets,
            "less_learning_rates": np.asarray(got.warmup.learning_rates),
            "target_tasks": got.tasks,
        },
        passes=got.costs,
        details=got.details(knobs),
    )


def rules(knobs: LessPassKnobs, facts: SelectionFacts) -> list[str]:
    """A readable target set (as rds), warm-up steps that the checkpoints divide, and a
    warm-up share of at least one sample per rank of the pool pass where N is known."""
    problems = target_rules(knobs, facts) + checkpoint_rules(
        "less_warmup_steps",
        knobs.less_warmup_steps,
        "less_checkpoints",
        knobs.less_checkpoints,
        "warm-up",
    )
    if facts.pool_size is not None:
        share = len(warmup_share(facts.pool_size, knobs.less_warmup_fraction))
        if share < facts.world_size:
            problems.append(
                f"{knob('less_warmup_fraction', knobs.less_warmup_fraction)}: {share} of the "
                f"{facts.pool_size} {facts.pool_is} for the warm-up's {facts.world_size} ranks "
                "(proxy_embeddings.world_size); at least one each"
            )
    return problems


SELECTORS = (
    SelectorSpec(
        "less",
        "LESS: the highest learning-rate-weighted cosine between a sample's "
        "Adam-preconditioned LoRA gradient and its best target's gradient "
        "(peripheral_subsets.target), both randomly projected, at the checkpoints of a short "
        "LoRA warm-up on a random share of the pool (peripheral_subsets.less_*)",
        less,
        order=50,
        needs=("less_gradients", "less_target_gradients", "less_learning_rates"),
        passes=(PASS_LESS_WARMUP, PASS_LESS_GRADIENTS, PASS_LESS_TARGETS),
        source="Xia et al. 2024, LESS: Selecting Influential Data for Targeted Instruction "
        "Tuning, ICML 2024",
        knobs=LessKnobs,
        gather=gather,
        rules=rules,
        # The target set (as rds), the warm-up's checkpoints whose gradients are scored and
        # their steps (under s2l's keys), and each checkpoint's mean learning rate eta_i
        # (before renormalisation).
        details={
            **TARGET_DETAILS,
            "s2l_proxy_checkpoints": [],
            "s2l_checkpoint_steps": [],
            "less_learning_rates": [],
        },
    ),
)
