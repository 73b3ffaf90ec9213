"""Magicoder (OSS-Instruct): ``problem``, ``solution``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.base import Read, RecordForm, field_text


class Magicoder(RecordForm):
    """The prompt is the problem, the response the solution."""

    name = "magicoder"
    fields = ("problem", "solution")
    accepted = "problem/solution (Magicoder)"
    listed = 30
    tried = 70

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``problem`` and a ``solution``."""
        return "problem" in record and "solution" in record

    def exchange(
        self, record: Mapping[str, Any], system: str, where: str, dropped: Counter
    ) -> Read:
        """Problem / solution."""
        prompt = field_text(record["problem"], "problem", where)
        return Read(system, prompt, field_text(record["solution"], "solution", where))
