"""``ifd``: Instruction-Following Difficulty (Li et al. 2024, *From Quantity to Quality:
Boosting LLM Performance with Self-Guided Data Selection for Instruction Tuning*, NAACL 2024:
the IFD score of its method; the authors' Cherry LLM code, ``data_analysis.py`` and
``data_by_IFD.py``).

For a sample with question Q and answer A = (w_1 .. w_T), the model's mean token losses are

    s(A | Q) = (1/T) sum_t -log P(w_t | Q, w_1 .. w_{t-1})       conditioned answer score
    s(A)     = (1/T) sum_t -log P(w_t | w_1 .. w_{t-1})          direct answer score
    IFD(Q, A) = s(A | Q) / s(A)

A high IFD means the question helps little in producing the answer: the sample is hard to
follow, and informative to train on. IFD > 1 means the question hurts: the authors discard
such samples as misaligned (``cherry_seletion/data_by_IFD.py:106``, ``if mean_rate > 1:
continue``; IFD = 1 is kept). ``ifd`` keeps, among the samples with IFD <= 1, the highest IFD
first, up to the unclustered budget (``base``: K floor(r m) samples,
or K B tokens under token balance), so it is compared with ``peripheral`` at equal data; when
fewer samples have IFD <= 1 than the budget holds, it keeps all of them (``per_cluster`` says
how many). Weights are 1 and the subset is dealt into random balanced shards. The score is IFD
(nan where it is not computed: a non-finite loss, s(A) = 0, or a sample truncation cut, which
Cherry drops: ``data_by_IFD.py:92,100`` skips a sample whose prompt leaves no room and one
whose prompt and answer exceed ``max_length``; ``ifd_truncated: true`` keeps them); the samples
not eligible are ranked after the eligible ones, by IFD where it exists.

The answer's tokens are the answer text alone, as Cherry scores them: ``tokenizer.encode`` of
the output, which for the Llama tokenizer it uses adds BOS but no EOS
(``data_analysis.py:59-84``), so the template's end-of-turn marker (ChatML's ``<|im_end|>``
and newline) or the plain format's EOS, which training scores, is left out of both losses
(``data/tokenization.without_end_of_turn``); both are then this selector's own passes.
``ifd_end_of_turn: true`` scores them, and s(A | Q) is then the pool pass's ``mean_loss``
(one pass fewer: this project's rule before issue 41; it moved IFD by 0.027 on average on
SmolLM2, at most 0.072).

Inputs, both from the embedding recipe (docs/design.md, step 1; ``recipes/embed.py``):
s(A | Q) is the ``mean_loss`` of a pass over the samples as trained (or the pool pass's, under
``ifd_end_of_turn``); s(A) is the ``mean_loss`` of an unconditioned pass over the same
response tokens with the prompt removed (``data/tokenization.response_only``: the sample's
BOS if it opens with one, then the chat template's assistant opening, e.g.
``<|im_start|>assistant``, then the response as trained; without a template, BOS and the plain
response text, as Cherry LLM's ``tokenizer.encode(output)`` gives a Llama model). The
template's assistant part is kept so that both losses score the same T tokens in the same
format and differ only by the question.

Departure from the paper: it scores IFD with a "pre-experienced" model, the base model briefly
fine-tuned on a clustered sample of the data first; this project scores it with the base model
itself (the model the embedding pass already ran), leaving out that fine-tuning run, which
would cost more than the whole selection here.

Departures from the authors' code: Cherry's direct-answer input is ``'### Response:' +
output`` and its conditioned input its own Alpaca prompt; here both are the chat template's (the
assistant opening, and the sample's prompt as trained), so the two losses score the same
tokens in the format the model is trained in. The budget is the unclustered one (equal data
with the other selectors), not Cherry's share of the eligible samples.

Cost: two forward passes over the pool, the conditioned one (N forwards) and the
unconditioned one (N forwards over sequences shorter by the prompt); under
``ifd_end_of_turn`` the conditioned one is the pool pass's (shared with the cluster
selectors). No backward pass.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    ForwardPass,
    Gathered,
    PassRunner,
    Pool,
)
from cluster_pipeline.selection.selectors.base import (
    SelectionInputs,
    SelectionParams,
    SelectionResult,
    SelectorSpec,
    global_budget,
    global_selection,
)

# ifd's own passes: the pool as trained and the pool's responses without their prompts, both
# without the end-of-turn tokens (or the unconditioned one alone, with them).
PASS_CONDITIONED = "conditioned"
PASS_UNCONDITIONED = "unconditioned"


class IfdKnobs(BaseModel):
    """The knobs of the IFD selectors (ifd, cluster_ifd): what the two losses score and which
    samples are scored (module docstring)."""

    ifd_end_of_turn: bool = Field(
        default=False,
        description="ifd and cluster_ifd only: score the template's end-of-turn tokens (or EOS) "
        "in both losses and reuse the pool pass's loss for s(A | Q) (one pass fewer); false = "
        "the answer text alone, as Cherry LLM's code.",
    )
    ifd_truncated: bool = Field(
        default=False,
        description="ifd and cluster_ifd only: score the samples that truncation to max_length "
        "cut; false = leave them unscored, as Cherry LLM's code drops them.",
    )


def ifd_scores(
    conditioned: np.ndarray, unconditioned: np.ndarray, excluded: np.ndarray | None = None
) -> np.ndarray:
    """IFD = s(A | Q) / s(A) per sample, (N,) float64; nan where either loss is not finite,
    s(A) <= 0, or the sample is ``excluded``.

    Args:
        conditioned: (N,) mean token loss of the answer given the question (nats).
        unconditioned: (N,) mean token loss of the answer alone (nats), same tokens.
        excluded: (N,) bool samples left unscored (truncated ones, as Cherry); None: none.
    """
    cond = np.asarray(conditioned, dtype=np.float64)
    alone = np.asarray(unconditioned, dtype=np.float64)
    ok = np.isfinite(cond) & np.isfinite(alone) & (alone > 0)
    if excluded is not None:
        ok &= ~np.asarray(excluded, dtype=bool)
    out = np.full(len(cond), np.nan)
    out[ok] = cond[ok] / alone[ok]
    return out


def scores_of(inputs: SelectionInputs) -> np.ndarray:
    """The IFD of every sample of ``inputs`` (its ``mean_loss`` and ``unconditioned_loss``, and
    the ``ifd_excluded`` its gather gave), (N,) float64."""
    assert inputs.mean_loss is not None and inputs.unconditioned_loss is not None
    return ifd_scores(inputs.mean_loss, inputs.unconditioned_loss, inputs.get("ifd_excluded"))


def ifd(inputs: SelectionInputs, params: SelectionParams) -> SelectionResult:
    """Among the samples with IFD <= 1, the highest IFD first, up to the global budget (module
    docstring); score = IFD.

    Raises:
        ValueError: no sample has IFD <= 1 (nothing to select).
    """
    score = scores_of(inputs)
    n = inputs.n
    index = np.arange(n)
    eligible = np.flatnonzero(np.isfinite(score) & (score <= 1.0))
    if len(eligible) == 0:
        finite = score[np.isfinite(score)]
        lowest = f"{finite.min():.4f}" if len(finite) else "none computable"
        raise ValueError(f"ifd: no sample has IFD <= 1 (lowest IFD {lowest}); nothing to select")
    eligible = eligible[np.lexsort((eligible, -score[eligible]))]
    rest = np.setdiff1d(index, eligible)
    # Not eligible: IFD > 1 by IFD (highest first), then those without an IFD.
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
        notes=short_of_budget(eligible, inputs, params, budget),
    )


def short_of_budget(
    eligible: np.ndarray, inputs: SelectionInputs, params: SelectionParams, budget: int
) -> tuple[str, ...]:
    """The warning when the samples with IFD <= 1 hold less than the budget (all of them are
    then kept, a smaller subset than ``ratio`` asks); () otherwise.

    Args:
        eligible: (S,) int64 the samples with IFD <= 1.
        inputs: the pool (its lengths under token balance).
        params: the balance.
        budget: samples, or tokens under token balance (:func:`global_budget`).
    """
    n, s = inputs.n, len(eligible)
    if params.balance == "tokens":
        held = int(np.asarray(inputs.lengths, dtype=np.int64)[eligible].sum())
        unit = "tokens"
    else:
        held, unit = s, "samples"
    if held >= budget:
        return ()
    return (
        f"ifd: only {s} of the {n} samples have IFD <= 1, the only ones Cherry keeps "
        f"(data_by_IFD.py:106), holding {held} {unit}, fewer than the budget of {budget} "
        f"{unit} that ratio {params.r} gives; all {s} are kept, a data fraction of "
        f"{s / n:.3f}",
    )


def gather(knobs: IfdKnobs, pool: Pool, runner: PassRunner) -> Gathered:
    """s(A | Q) and s(A) (module docstring): without the end-of-turn tokens, a conditioned pass
    over the pool as trained and an unconditioned one over each sample's response without its
    prompt, both under the pool pass's model and settings and cached per sample; under
    ``ifd_end_of_turn`` the pool pass's ``mean_loss`` and the unconditioned pass with them.
    The truncated samples (the pool pass's ``truncated``) are excluded unless
    ``ifd_truncated``."""
    eot = knobs.ifd_end_of_turn
    passes = []
    if eot:
        conditioned = runner.pool_column("mean_loss")
    else:
        out = runner.forward(
            ForwardPass(PASS_CONDITIONED, end_of_turn=False, label="ifd conditioned pass")
        )
        conditioned = out.values["mean_loss"]
        passes.append(out.cost)
    alone = runner.forward(
        ForwardPass(
            PASS_UNCONDITIONED,
            response_only=True,
            end_of_turn=eot,
            label="ifd unconditioned pass",
        )
    )
    passes.append(alone.cost)
    inputs = {"mean_loss": conditioned, "unconditioned_loss": alone.values["mean_loss"]}
    if not knobs.ifd_truncated:
        truncated = np.nan_to_num(runner.pool_column("truncated"), nan=0.0) > 0
        inputs["ifd_excluded"] = truncated
        if truncated.any():
            runner.log(f"ifd: {int(truncated.sum())} truncated samples left unscored, as Cherry")
    return Gathered(inputs=inputs, passes=tuple(passes), reads_pool_pass=eot)


SELECTORS = (
    SelectorSpec(
        "ifd",
        "Cherry LLM's instruction-following difficulty, loss(response | prompt) / "
        "loss(response alone) over the answer text, highest first among samples up to 1 "
        "(peripheral_subsets.ifd_*)",
        ifd,
        order=20,
        needs=("mean_loss", "unconditioned_loss"),
        passes=(PASS_EMBEDDING, PASS_CONDITIONED, PASS_UNCONDITIONED),
        source="Li et al. 2024, From Quantity to Quality (Cherry LLM, tianyi-lab/Cherry_LLM)",
        knobs=IfdKnobs,
        gather=gather,
    ),
)
