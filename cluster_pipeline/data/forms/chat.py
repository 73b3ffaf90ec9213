"""Conversation forms (ShareGPT ``conversations``, OpenAI ``messages``, TRL's chat
``prompt``/``completion``): one shared reading of turns (:class:`ChatForm`), each form naming
where its turns are and what their keys are.

Conversations keep their turn structure: a record that is more than one plain exchange (more
than one user/assistant exchange, ``tool`` turns, a system turn after the first non-system
turn, more than one leading system turn, a turn with a ``name``) keeps every turn (system,
user, assistant, tool; each ``{"role", "content"}`` plus ``"name"`` where it had one) in
:attr:`~cluster_pipeline.data.samples.Sample.messages`, as it stands; ``prompt`` then shows the
earlier turns flattened for reading (system turns after the first question included) and
``response`` the last answer. ``system`` holds only the leading system turn(s): a system turn
later in the conversation is not the system prompt. The sample id hashes that structure
(:func:`~cluster_pipeline.data.samples.sample_id`). Roles: ``human``/``user``;
``gpt``/``assistant``/``model``/``function_call``; ``system``;
``tool``/``function``/``observation``/``ipython`` (context, never trained). A record's own
``system`` field is a leading system turn (LLaMA-Factory's ShareGPT and Alpaca columns).

Chat rules, and why:

* Turns after the last assistant turn (a trailing user, tool or system turn) are not kept:
  nothing in them is trained, and in a causal LM no trained token attends to them, so the loss
  and the proxy embedding are exactly those of the whole record (TRL keeps such turns in the
  sequence, untrained: the same numbers; LLaMA-Factory skips the whole record as "invalid
  message count"). They are counted in ``Sample.dropped_turns`` (``after_last_assistant``),
  and such a record keeps its ``messages`` even when one exchange is left.
* A conversation whose first non-system turn is an assistant turn is refused: no question
  precedes the answer, and chat templates cannot render it (LLaMA-Factory also rejects it).
* Tools: ``tools`` (or the legacy OpenAI ``functions``) is kept as a JSON list of function
  schemas in :attr:`Sample.tools`, passed to the chat template and hashed into the sample id.
  An OpenAI assistant message's ``tool_calls`` (or legacy ``function_call``) is trained as the
  call's JSON ``{"name", "arguments"}``, the text a ShareGPT ``function_call`` turn holds.
* A turn's ``name`` (OpenAI's speaker name, or the function a legacy ``function`` turn answers
  for) is kept in ``messages`` (chat templates that know it render it) and counts in the id.
* Every other non-null field (``id``, a turn's ``weight``, a tool call's ``id``) is counted
  by name in :attr:`Sample.dropped_fields`; ``raw_instructions`` reports both counts.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster_pipeline.data import json_text
from cluster_pipeline.data.forms.base import Read, RecordForm, field_text
from cluster_pipeline.data.samples import DatasetFormatError, json_type

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "function_call": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}


class ChatForm(RecordForm):
    """A form whose record is a list of turns; a subclass says where they are
    (:meth:`turns`), under which keys a turn holds its role and text (``role_key``,
    ``text_key``) and how messages name the list (``turns_field``)."""

    role_key: str = "role"
    text_key: str = "content"
    turns_field: str

    def turns(self, record: Mapping[str, Any]) -> object:
        """The record's turns, as they are (checked by :func:`from_turns`)."""
        raise NotImplementedError

    def exchange(
        self, record: Mapping[str, Any], system: str, where: str, dropped: Counter
    ) -> Read:
        """The turns normalised by the chat rules (module docstring; :func:`from_turns`).

        Raises:
            DatasetFormatError: a chat rule is broken or a turn is malformed.
        """
        return from_turns(
            self.turns(record),
            self.role_key,
            self.text_key,
            self.name,
            self.turns_field,
            system,
            where,
            dropped,
        )


def tool_calls_text(
    turn: Mapping[str, Any], field: str, i: int, where: str, dropped: Counter
) -> str:
    """The tool calls of an OpenAI assistant message (``tool_calls``, or the legacy
    ``function_call``) as the text the assistant turn trains: ``{"name", "arguments"}`` as JSON
    (a list for several calls), arguments parsed when they are a JSON string, which is the text
    a ShareGPT ``function_call`` turn holds (LLaMA-Factory's OpenAI converter does the same).
    ``""`` when there is none."""
    calls = turn.get("tool_calls")
    legacy = turn.get("function_call")
    if calls in (None, []) and legacy is None:
        return ""
    if calls not in (None, []) and legacy is not None:
        raise DatasetFormatError(
            f"{where}: turn {i} has both 'tool_calls' and the legacy 'function_call'; keep one."
        )
    if legacy is not None:
        calls = [{"type": "function", "function": legacy}]
    if not isinstance(calls, list):
        raise DatasetFormatError(f"{where}: turn {i}: 'tool_calls' must be a list of calls.")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
        ):
            raise DatasetFormatError(
                f"{where}: turn {i}, tool call {j} must be "
                '{"type": "function", "function": {"name": ..., "arguments": ...}}; got '
                f"{json.dumps(call, ensure_ascii=False)[:120]}."
            )
        for key, value in call.items():
            if key not in ("type", "function") and value is not None:
                dropped[f"{field}[].tool_calls[].{key}"] += 1
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json_text.loads(arguments)
            except json_text.JsonTextError:
                pass  # not JSON: trained as the text it is
        out.append({"name": fn["name"], "arguments": arguments})
    return json.dumps(out[0] if len(out) == 1 else out, ensure_ascii=False)


def from_turns(
    turns: object,
    role_key: str,
    text_key: str,
    form: str,
    field: str,
    system_field: str,
    where: str,
    dropped: Counter,
) -> Read:
    """A conversation record's turns, normalised (docs/design.md, "Reading datasets": chat
    rules). ``system_field`` is the record's own ``system`` field (a leading system turn);
    turn keys the reader does not read are counted into ``dropped`` as ``field[].key``."""
    if not isinstance(turns, list) or not turns:
        raise DatasetFormatError(f"{where}: {form} record needs a non-empty list of turns.")
    normalised: list[dict[str, str]] = (
        [{"role": "system", "content": system_field}] if system_field else []
    )
    for i, turn in enumerate(turns):
        calls_ok = role_key == "role" and isinstance(turn, dict)
        has_calls = calls_ok and any(turn.get(k) for k in ("tool_calls", "function_call"))
        if (
            not isinstance(turn, dict)
            or role_key not in turn
            or (text_key not in turn and not has_calls)
        ):
            raise DatasetFormatError(
                f"{where}: turn {i} of the {form} record must be an object with "
                f"{role_key!r} and {text_key!r}; got {turn!r:.120}."
            )
        role = ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise DatasetFormatError(
                f"{where}: turn {i} has unknown role {turn[role_key]!r}; "
                f"expected one of {sorted(set(ROLE_ALIASES))}."
            )
        content = field_text(turn.get(text_key), text_key, where)
        read = {role_key, text_key, "name"}
        if calls_ok and role == "assistant":
            read |= {"tool_calls", "function_call"}
            calls = tool_calls_text(turn, field, i, where, dropped)
            content = f"{content}\n\n{calls}" if calls and content.strip() else calls or content
        for key, value in turn.items():
            if key not in read and value is not None:
                dropped[f"{field}[].{key}"] += 1
        entry = {"role": role, "content": content}
        name = turn.get("name")
        if name is not None and not isinstance(name, str):
            raise DatasetFormatError(
                f"{where}: turn {i} has a 'name' that is not a string ({json_type(name)}); "
                "give the speaker's or the function's name as text, or leave it out."
            )
        if name:  # the speaker (OpenAI's user/assistant name) or the function a tool turn is of
            entry["name"] = name
        normalised.append(entry)
    roles = [t["role"] for t in normalised]
    first = next((i for i, r in enumerate(roles) if r != "system"), None)
    if first is not None and roles[first] == "assistant" and "user" in roles:
        raise DatasetFormatError(
            f"{where}: the {form} record opens with an assistant turn (turn "
            f"{first - bool(system_field)}), before any user turn: there is no question for it "
            "to answer, and chat templates render an answer only after one. Remove the leading "
            "assistant turn(s), or put the user turn first."
        )
    last_assistant = max((i for i, r in enumerate(roles) if r == "assistant"), default=-1)
    if last_assistant < 0:
        raise DatasetFormatError(f"{where}: {form} record has no assistant turn to learn from.")
    kept = normalised[: last_assistant + 1]
    after = len(normalised) - len(kept)
    dropped_turns = {"after_last_assistant": after} if after else {}
    # The system prompt is what leads the conversation; a system turn later on stays where it
    # stands, in messages (and in the flattened prompt), never in the system column.
    lead = first if first is not None else len(kept)
    leading, dialogue = kept[:lead], kept[lead:last_assistant]
    system = "\n\n".join(t["content"] for t in leading)
    if not any(t["role"] == "user" for t in dialogue):
        raise DatasetFormatError(f"{where}: {form} record has no user turn before its answer.")
    as_json = json.dumps(kept, ensure_ascii=False)
    plain = len(leading) <= 1 and len(dialogue) == 1 and all(len(t) == 2 for t in kept)
    if plain:
        # One exchange: system / prompt / response say it all; a record that had more turns
        # (dropped after the answer) still shows the conversation it was cut to.
        return Read(
            system,
            dialogue[0]["content"],
            kept[-1]["content"],
            as_json if after else None,
            None,
            dropped_turns,
        )
    # Otherwise the conversation is kept as it stands (messages: what is rendered, trained and
    # hashed into the sample id); the prompt shows the turns before the answer for reading.
    if len(dialogue) == 1:
        prompt = dialogue[0]["content"]
    else:
        prompt = "\n\n".join(f"{t['role'].capitalize()}: {t['content']}" for t in dialogue)
    return Read(system, prompt, kept[-1]["content"], as_json, None, dropped_turns)
