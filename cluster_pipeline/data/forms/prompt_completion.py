"""TRL's prompt-completion form with strings: ``prompt``, ``completion``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.base import Read, RecordForm, field_text


class PromptCompletion(RecordForm):
    """The prompt is ``prompt``, the response ``completion``; both lists of messages is the
    chat form (:mod:`~cluster_pipeline.data.forms.prompt_completion_chat`, tried first)."""

    name = "prompt_completion"
    fields = ("prompt", "completion")
    accepted = "prompt/completion (TRL)"
    listed = 40
    tried = 40

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``prompt`` and a ``completion``."""
        return "prompt" in record and "completion" in record

    def exchange(
        self, record: Mapping[str, Any], system: str, where: str, dropped: Counter
    ) -> Read:
        """Prompt / completion."""
        prompt = field_text(record["prompt"], "prompt", where)
        return Read(system, prompt, field_text(record["completion"], "completion", where))
