"""OpenAI chat: ``messages``, a list of ``{"role", "content"}`` messages (assistant messages may
carry ``tool_calls``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.chat import ChatForm


class OpenAI(ChatForm):
    """The messages by the chat rules; tried first of all forms."""

    name = "openai"
    fields = ("messages",)
    accepted = "messages (OpenAI)"
    listed = 60
    tried = 10
    turns_field = "messages"

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``messages`` field."""
        return "messages" in record

    def turns(self, record: Mapping[str, Any]) -> object:
        """``messages``."""
        return record["messages"]
