"""ShareGPT: ``conversations``, a list of ``{"from", "value"}`` turns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data.forms.chat import ChatForm


class ShareGPT(ChatForm):
    """The turns of ``conversations`` by the chat rules."""

    name = "sharegpt"
    fields = ("conversations",)
    accepted = "conversations (ShareGPT)"
    listed = 50
    tried = 20
    role_key = "from"
    text_key = "value"
    turns_field = "conversations"

    def matches(self, record: Mapping[str, Any]) -> bool:
        """A ``conversations`` field."""
        return "conversations" in record

    def turns(self, record: Mapping[str, Any]) -> object:
        """``conversations``."""
        return record["conversations"]
