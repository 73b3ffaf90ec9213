"""What a record form is (:class:`RecordForm`), what it reads out of a record (:class:`Read`),
and the field-level rules every form shares: text fields, the record's ``system`` field and its
function schemas (``tools``)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from cluster_pipeline.data import json_text
from cluster_pipeline.data.samples import DatasetFormatError, json_type

# Read by every form but text beside its own fields: a leading system turn and the record's
# function schemas (``functions``: the legacy OpenAI name of ``tools``).
COMMON_FIELDS = ("system", "tools", "functions")


@dataclass(frozen=True)
class Read:
    """What a form read out of one record: the parts of a :class:`~cluster_pipeline.data.
    samples.Sample` that depend on the record (``messages``, ``tools`` as JSON text, or None;
    ``dropped_turns``: turns not kept, by reason)."""

    system: str
    prompt: str
    response: str
    messages: str | None = None
    tools: str | None = None
    dropped_turns: Mapping[str, int] = field(default_factory=dict)


class RecordForm:
    """One accepted record form: which records it claims and how it reads one.

    A form is one class in a module of :mod:`cluster_pipeline.data.forms` (found there, no list
    to edit; :mod:`cluster_pipeline.plugins`). It sets:

    - ``name``: the ``form`` column's value;
    - ``fields``: the top-level fields it reads beside :data:`COMMON_FIELDS` (``fields.json``
      may map onto them; every other non-null field is counted as dropped);
    - ``accepted``: how the "matches no accepted form" message names it, or None where another
      form's entry names the same fields;
    - ``listed``: its place where forms are listed to users (that message, the fields
      ``fields.json`` may map onto);
    - ``tried``: its place in the order forms are tried on a record: the first that
      :meth:`matches` reads it, so a record with the fields of two forms is read as the one
      tried first;

    and implements :meth:`matches` and :meth:`exchange` (or :meth:`read`, for a form that
    reads no ``system`` or ``tools``).
    """

    name: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]
    accepted: ClassVar[str | None]
    listed: ClassVar[int]
    tried: ClassVar[int]
    common: ClassVar[tuple[str, ...]] = COMMON_FIELDS

    @property
    def reads(self) -> tuple[str, ...]:
        """Every top-level field the form reads (its own, then the common ones)."""
        return (*self.fields, *self.common)

    def matches(self, record: Mapping[str, Any]) -> bool:
        """Whether ``record`` (fields renamed already) is in this form."""
        raise NotImplementedError

    def exchange(
        self, record: Mapping[str, Any], system: str, where: str, dropped: Counter
    ) -> Read:
        """The record's system, prompt and response (and turns, for a conversation).
        ``system`` is the record's own ``system`` field; ``where`` is ``file:line`` for
        messages; fields of turns the form does not read are counted into ``dropped``.

        Raises:
            DatasetFormatError: a field is malformed.
        """
        raise NotImplementedError

    def read(self, record: Mapping[str, Any], where: str, dropped: Counter) -> Read:
        """The record read: its ``system`` field, its ``tools``, then :meth:`exchange`.

        Raises:
            DatasetFormatError: a field is malformed, or the prompt is empty.
        """
        system = field_text(record.get("system"), "system", where)
        tools = tools_json(record, where)
        read = self.exchange(record, system, where, dropped)
        if not read.prompt.strip():
            raise DatasetFormatError(
                f"{where}: the prompt is empty; remove the record or fill it in."
            )
        return replace(read, tools=tools)


def field_text(value: object, field: str, where: str) -> str:
    """A field read as text: a string, ``""`` for null, a finite number as written.

    Raises:
        DatasetFormatError: NaN or infinity, a boolean, an array or an object (named by the
            field, in JSON's words).
    """
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise DatasetFormatError(
            f"{where}: field {field!r} is the number {value}, not text (a missing value written "
            "as NaN?). Write a string, or null for none."
        )
    if isinstance(value, bool):  # before int: a bool is an int to Python
        raise DatasetFormatError(
            f"{where}: field {field!r} is the JSON boolean {str(value).lower()}, not text. "
            f'Write it as a string ("{str(value).lower()}") if that is the text, or fix the record.'
        )
    if isinstance(value, (int, float)):
        return str(value)
    raise DatasetFormatError(
        f"{where}: field {field!r} must be a string, got a JSON {json_type(value)}. "
        "Fix the record or remove it from the file."
    )


def _loads_inner(value: str, field: str, where: str) -> Any:
    """A field that holds JSON as a string (LLaMA-Factory writes ``tools`` so), parsed as
    strictly as a file is (:mod:`cluster_pipeline.data.json_text`)."""
    try:
        return json_text.loads(value)
    except json_text.JsonTextError as e:
        raise DatasetFormatError(
            f"{where}: field {field!r} holds a string that is not strict JSON ({e}). Write the "
            "value as JSON, or as a string holding valid JSON."
        ) from None


def tools_json(record: Mapping[Any, Any], where: str) -> str | None:
    """The record's function schemas as a JSON list, or None (absent, null, ``""`` or
    ``[]``). ``tools`` (OpenAI, TRL, LLaMA-Factory; a list, or a string holding one) or the
    legacy OpenAI ``functions``; a bare schema (``{"name", "description", "parameters"}``, as
    Glaive writes) is wrapped as ``{"type": "function", "function": schema}``, the form
    ``apply_chat_template(tools=...)`` documents.

    Raises:
        DatasetFormatError: both ``tools`` and ``functions``, not a list of objects, or a
            schema with neither ``type`` nor ``name``.
    """
    given = {k: record[k] for k in ("tools", "functions") if record.get(k) not in (None, "", [])}
    if not given:
        return None
    if len(given) == 2:
        raise DatasetFormatError(
            f"{where}: the record has both 'tools' and the legacy 'functions'; keep one."
        )
    [(name, value)] = given.items()
    if isinstance(value, str):
        value = _loads_inner(value, name, where)
    if value in (None, []):
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DatasetFormatError(
            f"{where}: field {name!r} must be a list of function schemas (JSON objects), got "
            f"{json.dumps(value, ensure_ascii=False)[:120]}."
        )
    out = []
    for i, tool in enumerate(value):
        if "type" in tool:
            out.append(tool)
        elif isinstance(tool.get("name"), str):
            out.append({"type": "function", "function": tool})
        else:
            raise DatasetFormatError(
                f"{where}: tool {i} of {name!r} has neither 'type' nor a 'name'; write it as "
                '{"type": "function", "function": {"name": ..., "parameters": ...}} or as a '
                "bare function schema with a name."
            )
    return json.dumps(out, ensure_ascii=False)
