"""``less``: LESS (Xia et al. 2024, *LESS: Selecting Influential Data for Targeted Instruction
Tuning*, ICML 2024, arXiv 2402.04333; the authors' code, princeton-nlp/LESS,
``less/data_selection/collect_grad_reps.py`` and ``matching.py``).

A short LoRA warm-up on a small random share of the pool leaves C checkpoints theta_1..theta_C
with their AdamW moments. At each, every pool sample z gets its Adam-preconditioned LoRA
gradient Gamma(z, theta_i) (the update the sample would make, eq. (1):
selection/gradient_features.adam_precondition) and every target sample z' its plain gradient
grad l(z'; theta_i); both are randomly projected to d dimensions with the same projection and
L2-normalised (``SelectionInputs.less_gradients``, (N, C, d), and ``less_target_gradients``,
(M, C, d)). The influence of z on z' is the learning-rate-weighted sum of cosines over the
checkpoints (eq. (2)), and a sample's score is its influence on the target it helps most
(section 3, "Data selection": the max over the target set's subtasks):

    Inf(z, z') = sum_{i=1..C} eta_i cos(Gamma(z, theta_i), grad l(z'; theta_i))
    score(z)   = max_{z' in target set} Inf(z, z')

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
  (evaluation/targets.py), without subtasks: each target sample is its own subtask, so the max
  runs over target samples (the authors average each subtask's influences first).
- Gamma uses the bias-corrected moments of eq. (1); the authors' code uses the uncorrected
  ones with eps under the square root.

Cost: the warm-up (its sample visits, one forward and one backward pass each), then per
checkpoint one forward and one backward pass per pool sample and per target sample (batched:
per-sample gradients of a padded batch from one backward pass, selection/gradient_features.
per_sample_gradients), each projected (P x d multiply-adds per sample, P the LoRA
parameters, and P x d hashed signs rebuilt once per group of gradients, about once per chunk of
a rank's pass: training/gradient_pass.py); the selection itself is N x M x C dot products of
length d, in blocks of pool rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    global_budget,
    global_selection,
)

BLOCK_ROWS = 4096


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
) -> np.ndarray:
    """score(z) = max_{z'} sum_i eta_i cos(Gamma(z, theta_i), grad l(z'; theta_i)) (module
    docstring) for every pool sample.

    Args:
        pool: (N, C, d) float32 L2-normalised projected Adam gradients of the pool, checkpoint
            i in column i ((N, d) for one checkpoint); zero rows (no gradient) score 0.
        targets: (M, C, d) float32 L2-normalised projected gradients of the target samples.
        learning_rates: (C,) the checkpoints' eta_i (renormalised to sum 1).
        block_rows: pool rows per block (memory: block_rows x M floats).

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
    score = np.empty(len(x), dtype=np.float64)
    for start in range(0, len(x), block_rows):
        block = x[start : start + block_rows].astype(np.float64).reshape(-1, weighted.shape[1])
        score[start : start + block_rows] = (block @ weighted.T).max(axis=1)
    return score


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
    score = influence_scores(pool, targets, eta)
    index = np.arange(inputs.n)
    order = index[np.lexsort((index, -score))]
    return global_selection("less", order, inputs, params, global_budget(inputs, params), score)
