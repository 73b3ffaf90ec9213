"""Alpaca: ``instruction``, optional ``input``, ``output``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.base import Read, RecordForm, field_text


class Alpaca(RecordForm):
    r"""The prompt is the instruction, followed by ``"\n\n"`` and the input where the input is
    not blank; the response is the output."""

    name = "alpaca"
    fields = ("instruction", "input", "output")
    accepted = "instruction/input/output (Alpaca)"
    listed = 10
    tried = 50
    answer = "output"

    def matches(self, record: Mapping[str, Any]) -> bool:
        """An ``instruction`` and an answer field."""
        return "instruction" in record and self.answer in record

    def exchange(
        self, record: Mapping[str, Any], system: str, where: str, dropped: Counter
    ) -> Read:
        """Instruction (+ input) / answer."""
        instruction = field_text(record["instruction"], "instruction", where)
        extra = field_text(record.get("input"), "input", where)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return Read(system, prompt, field_text(record[self.answer], self.answer, where))
