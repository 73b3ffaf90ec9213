"""MMLU's medical topics (the medical-QA judgement of the CluSTER paper's MedInstruct runs)."""

from __future__ import annotations

from pathlib import Path

from cluster_pipeline.evaluation.suites.base import file_of
from cluster_pipeline.evaluation.suites.choice import ChoiceSuite, load_mmlu

MMLU_MEDICAL_TOPICS = (
    "anatomy",
    "clinical knowledge",
    "college biology",
    "college medicine",
    "medical genetics",
    "professional medicine",
)


class MmluMedical(ChoiceSuite):
    """The questions of :data:`MMLU_MEDICAL_TOPICS`, sized by the same knob as MMLU."""

    name = "mmlu_medical"
    listed = 40
    size_knob = "mmlu_questions"
    file = "mmlu.jsonl"

    def load(self, path: Path | None, size: int) -> list:
        """``size`` questions of the medical topics, a seeded sample."""
        return load_mmlu(file_of(path), MMLU_MEDICAL_TOPICS, size)
