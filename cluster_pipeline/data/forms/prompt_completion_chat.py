"""TRL's conversational prompt-completion form: ``prompt`` and ``completion``, both message
lists (``{"role", "content"}``), read as one conversation by the chat rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.chat import ChatForm


class PromptCompletionChat(ChatForm):
    """The prompt's messages, then the completion's, as one conversation."""

    name = "prompt_completion_chat"
    fields = ("prompt", "completion")
    accepted = None  # the same fields as prompt/completion (TRL)
    listed = 70
    tried = 30
    turns_field = "prompt/completion"

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``prompt`` and a ``completion`` that are both lists."""
        return (
            "prompt" in record
            and "completion" in record
            and isinstance(record["prompt"], list)
            and isinstance(record["completion"], list)
        )

    def turns(self, record: Mapping[str, Any]) -> object:
        """The prompt's messages, then the completion's."""
        return [*record["prompt"], *record["completion"]]
