"""MMLU (Hendrycks et al., 2021): four-option questions over 57 topics, from an ``mmlu.jsonl``
file in an evaluation folder."""

from __future__ import annotations

from pathlib import Path

from cluster_pipeline.evaluation.suites.base import file_of
from cluster_pipeline.evaluation.suites.choice import ChoiceSuite, load_mmlu


class Mmlu(ChoiceSuite):
    """Every topic, a seeded sample of ``mmlu_questions`` questions."""

    name = "mmlu"
    listed = 30
    size_knob = "mmlu_questions"
    file = "mmlu.jsonl"

    def load(self, path: Path | None, size: int) -> list:
        """``size`` questions, a seeded sample spanning the topics."""
        return load_mmlu(file_of(path), None, size)
