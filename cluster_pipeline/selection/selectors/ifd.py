"""``ifd``: Instruction-Following Difficulty (Li et al. 2024, *From Quantity to Quality:
Boosting LLM Performance with Self-Guided Data Selection for Instruction Tuning*, NAACL 2024:
the IFD score of its method; the authors' Cherry LLM code, ``data_analysis.py`` and
``data_by_IFD.py``).

For a sample with question Q and answer A = (w_1 .. w_T), the model's mean token losses are

    s(A | Q) = (1/T) sum_t -log P(w_t | Q, w_1 .. w_{t-1})       conditioned answer score
    s(A)     = (1/T) sum_t -log P(w_t | w_1 .. w_{t-1})          direct answer score
    IFD(Q, A) = s(A | Q) / s(A)

A high IFD means the question helps little in producing the answer: the sample is hard to
follow, and informative to train on. IFD >= 1 means the question does not help at all (or
hurts): the paper discards such samples as misaligned. ``ifd`` keeps, among the samples with
IFD < 1, the highest IFD first, up to the unclustered budget (``base``: K floor(r m) samples,
or K B tokens under token balance), so it is compared with ``peripheral`` at equal data; when
fewer samples have IFD < 1 than the budget holds, it keeps all of them (``per_cluster`` says
how many). Weights are 1 and the subset is dealt into random balanced shards. The score is IFD
(nan where it cannot be computed: a non-finite loss or s(A) = 0); the samples not eligible are
ranked after the eligible ones, by IFD where it exists.

Inputs, both from the embedding pass (docs/design.md, step 1; ``recipes/embed.py``):
s(A | Q) is ``mean_loss`` of the pool pass, over the response tokens as trained; s(A) is the
``mean_loss`` of a second, unconditioned pass over the same response tokens with the prompt
removed (``data/tokenization.response_only``: the sample's BOS if it opens with one, then the
chat template's assistant opening, e.g. ``<|im_start|>assistant``, then the response as
trained; without a template, BOS and the plain response text and EOS, which is what Cherry
LLM's ``tokenizer.encode(output)`` gives a Llama model). The template's assistant part is kept
so that both losses score the same T tokens in the same format and differ only by the question.

Departure from the paper: it scores IFD with a "pre-experienced" model, the base model briefly
fine-tuned on a clustered sample of the data first; this project scores it with the base model
itself (the model the embedding pass already ran), leaving out that fine-tuning run, which
would cost more than the whole selection here.

Cost: the pool pass (N forwards, shared with the cluster selectors) plus the unconditioned
pass, N forwards over sequences shorter by the prompt; no backward pass.
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


def ifd_scores(conditioned: np.ndarray, unconditioned: np.ndarray) -> np.ndarray:
    """IFD = s(A | Q) / s(A) per sample, (N,) float64; nan where either loss is not finite or
    s(A) <= 0.

    Args:
        conditioned: (N,) mean token loss of the answer given the question (nats).
        unconditioned: (N,) mean token loss of the answer alone (nats), same tokens.
    """
    cond = np.asarray(conditioned, dtype=np.float64)
    alone = np.asarray(unconditioned, dtype=np.float64)
    ok = np.isfinite(cond) & np.isfinite(alone) & (alone > 0)
    out = np.full(len(cond), np.nan)
    out[ok] = cond[ok] / alone[ok]
    return out


def ifd(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Among the samples with IFD < 1, the highest IFD first, up to the global budget (module
    docstring); score = IFD.

    Raises:
        ValueError: no sample has IFD < 1 (nothing to select).
    """
    assert inputs.mean_loss is not None and inputs.unconditioned_loss is not None
    score = ifd_scores(inputs.mean_loss, inputs.unconditioned_loss)
    n = inputs.n
    index = np.arange(n)
    eligible = np.flatnonzero(np.isfinite(score) & (score < 1.0))
    if len(eligible) == 0:
        finite = score[np.isfinite(score)]
        lowest = f"{finite.min():.4f}" if len(finite) else "none computable"
        raise ValueError(f"ifd: no sample has IFD < 1 (lowest IFD {lowest}); nothing to select")
    eligible = eligible[np.lexsort((eligible, -score[eligible]))]
    rest = np.setdiff1d(index, eligible)
    # Not eligible: IFD >= 1 by IFD (highest first), then those without an IFD.
    rest_key = np.where(np.isfinite(score[rest]), -score[rest], np.inf)
    rest = rest[np.lexsort((rest, rest_key))]
    budget = global_budget(inputs, params)
    result = global_selection("ifd", eligible, inputs, params, budget, score)
    rank = result.selection_rank.copy()
    rank[rest] = len(eligible) + np.arange(len(rest))
    return SelectionResult(
        result.selector,
        result.selected,
        result.copies,
        rank,
        result.weight,
        result.cluster_weights,
        result.per_cluster,
        result.balance,
        result.token_budget,
        score=score,
    )
