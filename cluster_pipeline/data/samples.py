"""The normalised sample every reader produces, its content hash, and the error every reader
raises (:class:`DatasetFormatError`, whose message names the file, line and remedy).

Record forms (:mod:`cluster_pipeline.data.forms`) turn one raw record into a :class:`Sample`;
file readers (:mod:`cluster_pipeline.data.readers`) yield the raw records of one file; folder
rules (:mod:`cluster_pipeline.data.folders`) say which files of a dataset folder are read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class DatasetFormatError(ValueError):
    """A record or file that cannot be read; the message names the file, line and remedy."""


@dataclass(frozen=True)
class Sample:
    r"""One normalised instruction sample.

    ``system`` is the leading system message (``""`` if none: a system turn later in a
    conversation is not the system prompt, and stays where it stands in ``messages``);
    ``prompt`` is the user turn (several turns flattened as ``"User: …\n\nAssistant: …"``) and
    ``response`` the final assistant turn. ``messages`` is ``None`` when the record was exactly
    one plain exchange (at most one leading system turn, one user turn, the answer), else the
    kept conversation as JSON (a list of ``{"role", "content"}``, plus ``"name"`` where a turn
    had one; roles system/user/assistant/tool), which is what is rendered and trained.
    ``tools`` is the record's function schemas as a JSON list (``{"type": "function",
    "function": {...}}`` each), or ``None``. ``text`` records have ``prompt == ""``.

    ``dropped_turns`` counts the record's turns that were not kept, by reason
    (``after_last_assistant``); ``dropped_fields`` the non-null fields the form does not read,
    by name (``id``, ``conversations[].weight``: one per record or per turn that had it).
    """

    prompt: str
    response: str
    system: str
    form: str
    source_file: str
    source_line: int
    messages: str | None = None
    tools: str | None = None
    dropped_turns: Mapping[str, int] = field(default_factory=dict)
    dropped_fields: Mapping[str, int] = field(default_factory=dict)
    # 0-based place of the record among those read from source_file: tells apart records
    # that share a line (a one-line JSON array); None where source_line alone locates it.
    source_index: int | None = None

    @property
    def sample_id(self) -> str:
        """The content hash of what is trained (:func:`sample_id`)."""
        return sample_id(self.system, self.prompt, self.response, self.tools, self.messages)


def conversation(
    system: str, prompt: str, response: str, messages: str | None
) -> list[dict[str, str]]:
    """The message list a sample is rendered from: ``messages`` when set, else the single
    exchange (system message if any, user ``prompt``, assistant ``response``); a ``text``
    sample (empty prompt) is one assistant message, i.e. plain text."""
    if messages:
        return json.loads(messages)
    out = [{"role": "system", "content": system}] if system else []
    if prompt:
        out.append({"role": "user", "content": prompt})
    out.append({"role": "assistant", "content": response})
    return out


# Tags the structural hash, so that it can never equal a plain sample's.
_STRUCTURE = "cluster_pipeline.sample.messages.v1"


def _hash(parts: list[str]) -> str:
    """The first 16 hex digits of sha256 over the length-prefixed UTF-8 of ``parts``."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def is_plain(turns: list[dict[str, Any]], system: str, prompt: str, response: str) -> bool:
    """Whether a conversation is one plain exchange: at most one leading system turn (holding
    ``system``), one user turn (``prompt``), the answer (``response``); or a ``text`` sample's
    lone answer; every turn only ``role`` and ``content``."""
    expected = conversation(system, prompt, response, None)
    return turns == expected


def sample_id(
    system: str,
    prompt: str,
    response: str,
    tools: str | None = None,
    messages: str | None = None,
) -> str:
    r"""Stable content hash of what a sample trains (16 hex digits of sha256), by structure.

    - A plain exchange (:func:`is_plain`: the conversation rendered from ``messages``, or the
      single exchange when it is None): the length-prefixed UTF-8 of system, prompt, response
      and, when the sample has any, its ``tools`` JSON. These are the ids samples had before
      structure counted (and before tools were read), so tables and caches of plain data keep
      their ids.
    - Any other conversation: a tag, then its turns in order as canonical JSON (every turn's
      role, content and name; sorted keys, no spaces), then ``tools`` ("" for none). Turn
      order, who says what, where a system turn stands, names and tool schemas all count:
      three conversations that differ only in where a system turn sits are three samples
      (issue 43), and text that merely spells another conversation's turns
      (``"User: a\n\nAssistant: b"`` as one user turn) is not that conversation.

    Identical content gets the same id in any file or run; 64 bits make a collision in a
    10-million-sample pool about a 3e-6 chance.
    """
    turns = conversation(system, prompt, response, messages)
    if is_plain(turns, system, prompt, response):
        return _hash([system, prompt, response, *([] if tools is None else [tools])])
    canonical = json.dumps(turns, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return _hash([_STRUCTURE, canonical, tools or ""])


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type: object, array, string, number, boolean, null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
