"""``instruction``, optional ``input``, ``response``: Alpaca with another name for the answer."""

from __future__ import annotations

from cluster_pipeline.data.forms.alpaca import Alpaca


class InstructionResponse(Alpaca):
    """As :class:`~cluster_pipeline.data.forms.alpaca.Alpaca`, the answer in ``response``; a
    record with both ``output`` and ``response`` is Alpaca (tried first)."""

    name = "instruction_response"
    fields = ("instruction", "input", "response")
    accepted = "instruction/response"
    listed = 20
    tried = 60
    answer = "response"
