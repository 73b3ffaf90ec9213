"""Multiple choice in MMLU's format: each option is scored by its log-likelihood as the answer to
the question (sum over its tokens); the prediction is the most likely option.
:class:`ChoiceSuite` is what the multiple-choice suites (MMLU, its medical topics) share."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cluster_pipeline.data.tokenization import PackingSettings, encode_sample
from cluster_pipeline.evaluation.likelihood import response_losses
from cluster_pipeline.evaluation.suites.base import ItemScores, Metric, Scored, Suite

if TYPE_CHECKING:
    from cluster_pipeline.evaluation.suites import EvalSettings

ACCURACY = Metric("accuracy", "fraction of questions right", lower_is_better=False)


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


class ChoiceSuite(Suite):
    """A suite of MMLU-format questions, scored by the accuracy of the most likely option."""

    kind = "choice"
    metrics = (ACCURACY,)

    def score(
        self, model, tokenizer, items: list, settings: EvalSettings, log: Callable[[str], None]
    ) -> Scored:
        """Accuracy of the most likely option."""
        score, records = mmlu_accuracy(
            model, tokenizer, items, settings.max_length, settings.batch_size, settings
        )
        log(f"{self.name} {ACCURACY.key}: {score:.4f} ({ACCURACY.unit}, {len(items)} questions)")
        return {ACCURACY.key: (score, mmlu_items(records), records)}
