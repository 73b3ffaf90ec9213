"""Record forms: one class per accepted form of a raw record, one module each, found in this
package (:mod:`cluster_pipeline.plugins`) and tried in their declared order.

=============================  =========================================================
form                           fields
=============================  =========================================================
``alpaca``                     ``instruction``, optional ``input``, ``output``
``instruction_response``       ``instruction``, optional ``input``, ``response``
``magicoder``                  ``problem``, ``solution``
``prompt_completion``          ``prompt``, ``completion`` (TRL), both strings
``sharegpt``                   ``conversations``: list of ``{"from": ..., "value": ...}``
``openai``                     ``messages``: list of ``{"role": ..., "content": ...}``
``prompt_completion_chat``     ``prompt``, ``completion`` (TRL), both message lists
``text``                       ``text`` (language modelling: the whole text is trained)
=============================  =========================================================

A record is read by the first form, in :data:`REGISTRY` order (each form's ``tried``), whose
``matches`` claims it: ``openai``, ``sharegpt``, ``prompt_completion_chat``,
``prompt_completion``, ``alpaca``, ``instruction_response``, ``magicoder``, ``text``
(docs/design.md, "Reading datasets"). Every form but ``text`` also reads the record's
``system`` and ``tools`` (or legacy ``functions``) fields (:mod:`.base`); the conversation forms
share the chat rules (:mod:`.chat`). Every other non-null field is counted by name in
:attr:`~cluster_pipeline.data.samples.Sample.dropped_fields`.

A ``fields.json`` file in the dataset folder renames fields before the forms are tried
(``{"question": "instruction", "answer": "output"}``; :func:`rename_fields`).

Adding a form is one module here with one :class:`~.base.RecordForm` subclass (its name, the
fields it reads, how it is named to users, its places in the two orders, ``matches`` and
``exchange``) and its test; nothing else lists forms.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping

from cluster_pipeline.data.forms.base import RecordForm
from cluster_pipeline.data.samples import DatasetFormatError, Sample, json_type
from cluster_pipeline.plugins import discover

# A dataset folder's field renaming ({source field: accepted field}), never read as samples.
FIELDS_CONFIG_NAME = "fields.json"

# Every form, in the order they are tried on a record.
REGISTRY: tuple[RecordForm, ...] = tuple(
    sorted(discover(sys.modules[__name__], RecordForm), key=lambda f: f.tried)
)
_LISTED = sorted(REGISTRY, key=lambda f: f.listed)

# The forms' names, in the order users see them listed.
FORMS: tuple[str, ...] = tuple(f.name for f in _LISTED)

# Every field some form reads: what fields.json may map onto (the legacy OpenAI "functions"
# is read, but is no target).
FIELD_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys([*(name for f in _LISTED for name in f.fields), "system", "tools"])
)

_NAMED = [f.accepted for f in _LISTED if f.accepted]
_ACCEPTED = (
    f"Use {', '.join(_NAMED[:-1])} or {_NAMED[-1]}; or map your fields onto these in "
    f"{FIELDS_CONFIG_NAME} in the dataset folder."
)


def form_of(record: Mapping[str, object]) -> RecordForm | None:
    """The form that reads ``record`` (fields renamed already): the first of :data:`REGISTRY`
    that claims it, or None."""
    return next((f for f in REGISTRY if f.matches(record)), None)


def rename_fields(record: dict, fields: Mapping[str, str], where: str) -> dict:
    """``record`` with its keys renamed by ``fields`` (``fields.json``), all at once: a chain
    ``{"a": "b", "b": "c"}`` moves a to b and b to c; a field renamed to itself stays.

    Raises:
        DatasetFormatError: two of the record's fields would end up under one name (a field
            renamed onto one the record already has, or two renamed onto one target), which
            would drop one silently; the message names ``where``, both fields and what to do.
    """
    out: dict = {}
    source: dict[str, str] = {}
    for key, value in record.items():
        name = fields.get(key, key)
        if name in out:
            first, second = source[name], key
            renamed = [k for k in (first, second) if k in fields and fields[k] != k]
            how = " and ".join(f"{k!r} -> {fields[k]!r}" for k in renamed)
            raise DatasetFormatError(
                f"{where}: {FIELDS_CONFIG_NAME} renames {how}, but the record has both "
                f"{first!r} and {second!r}, so one would be lost. Remove one of them from the "
                f"records, or change {FIELDS_CONFIG_NAME} so that each lands on a field of its "
                "own (or drop the rename where the records already have the field)."
            )
        out[name] = value
        source[name] = key
    return out


def normalise_record(
    record: object,
    source_file: str,
    source_line: int,
    fields: dict[str, str] | None = None,
    source_index: int | None = None,
) -> Sample:
    """Turn one raw record into a :class:`~cluster_pipeline.data.samples.Sample`. ``fields``
    renames keys first (``{"question": "instruction"}``, from the folder's ``fields.json``;
    :func:`rename_fields`). ``source_index``: the record's 0-based place among those of its
    file.

    Raises:
        DatasetFormatError: the record is not an object, matches none of :data:`FORMS`, breaks
            a chat rule (no user or assistant turn, an assistant turn first, malformed
            ``tools`` or tool calls), or a rename would overwrite one of its fields; the
            message gives ``file:line`` and what to do.
    """
    where = f"{source_file}:{source_line}"
    if not isinstance(record, dict):
        raise DatasetFormatError(
            f"{where}: expected a JSON object per sample, got a JSON {json_type(record)}. "
            'Write each sample as an object (e.g. {"instruction": ..., "output": ...}), '
            "or remove the value from the file."
        )
    original = {fields.get(k, k): k for k in record} if fields else {}
    if fields:
        record = rename_fields(record, fields, where)
    form = form_of(record)
    if form is None:
        raise DatasetFormatError(
            f"{where}: record with keys {sorted(map(str, record))[:12]}"
            + (f" (after {FIELDS_CONFIG_NAME} renamed {fields})" if fields else "")
            + " matches no accepted form. "
            + _ACCEPTED
        )
    dropped: Counter = Counter()
    for key, value in record.items():
        if key not in form.reads and value is not None:
            dropped[original.get(key, key)] += 1
    read = form.read(record, where, dropped)
    return Sample(
        read.prompt,
        read.response,
        read.system,
        form.name,
        source_file,
        source_line,
        read.messages,
        read.tools,
        read.dropped_turns,
        dict(dropped),
        source_index,
    )
