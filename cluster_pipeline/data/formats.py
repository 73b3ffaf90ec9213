"""Reading instruction datasets in the common public forms into samples.

Accepted record forms (docs/design.md, "Reading datasets"):

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

Conversations keep their turn structure: a record with more than one user/assistant exchange,
or with ``tool`` turns, keeps every turn (system, user, assistant, tool) in
:attr:`Sample.messages`; ``prompt`` then shows the earlier turns flattened for reading and
``response`` the last answer. Roles: ``human``/``user``; ``gpt``/``assistant``/``model``/
``function_call``; ``system``; ``tool``/``function``/``observation``/``ipython`` (context,
never trained). A record's own ``system`` field is a leading system turn (LLaMA-Factory's
ShareGPT and Alpaca columns).

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
* Every other non-null field (``id``, a turn's ``weight``, a tool call's ``id``) is counted
  by name in :attr:`Sample.dropped_fields`; ``raw_instructions`` reports both counts.

Files may be JSONL (one record per line), JSON (one record, an array of records, or several
such values in a row), Parquet (any number of shards) or the Arrow files of a Hugging Face
``datasets`` folder written by ``save_to_disk`` (its ``dataset_info.json``, ``state.json`` and
``dataset_dict.json`` are metadata, not records). JSON text is read strictly
(:mod:`cluster_pipeline.data.json_text`: what ``json.loads`` rejects, ``NaN``, unpaired
surrogates and repeated keys are refused at ``file:line:column``); a file that holds no record
(0 bytes, whitespace, ``[]``, no rows) is refused by name. A ``fields.json`` file in the dataset
folder renames fields before the forms are matched (``{"question": "instruction", "answer":
"output"}``), all at once (a chain ``a -> b, b -> c`` is not followed); a record in which two
fields would end up under one name is refused (:func:`rename_fields`), never one of them
dropped. Every sample keeps the file, the 1-based line (Parquet, Arrow: row) it came from and
its 0-based place among the file's records (``source_index``: records of a one-line JSON array
share a line), so a trained-on sample can be traced back to its source.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster_pipeline.data import json_text

SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet", ".arrow")
# A dataset folder's own settings (its evaluation benchmarks), never read as samples.
EVAL_CONFIG_NAME = "eval.json"
# A dataset folder's field renaming ({source field: accepted field}), never read as samples.
FIELDS_CONFIG_NAME = "fields.json"
# A dataset folder's documentation, never read as samples nor counted as files not read: its
# card, whose YAML front matter may declare the license, and its license file
# (data/datasets.source_license).
CARD_NAME = "README.md"
LICENSE_NAMES = ("LICENSE", "LICENSE.md", "LICENSE.txt")
# What `datasets.Dataset.save_to_disk` writes beside its Arrow files.
HF_METADATA_NAMES = ("dataset_info.json", "state.json", "dataset_dict.json")
FORMS = (
    "alpaca",
    "instruction_response",
    "magicoder",
    "prompt_completion",
    "sharegpt",
    "openai",
    "prompt_completion_chat",
    "text",
)

# Every field some form reads: what fields.json may map onto.
FIELD_NAMES = (
    "instruction",
    "input",
    "output",
    "response",
    "problem",
    "solution",
    "prompt",
    "completion",
    "conversations",
    "messages",
    "text",
    "system",
    "tools",
)

_ROLE_ALIASES = {
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


class DatasetFormatError(ValueError):
    """A record or file that cannot be read; the message names the file, line and remedy."""


@dataclass(frozen=True)
class Sample:
    r"""One normalised instruction sample.

    ``system`` is the system message (``""`` if none); ``prompt`` is the user turn (several
    turns flattened as ``"User: …\n\nAssistant: …"``) and ``response`` the final assistant turn.
    ``messages`` is ``None`` when the record was exactly one exchange (system turns, one user
    turn, the answer), else the kept conversation as JSON (a list of ``{"role", "content"}``,
    roles system/user/assistant/tool), which is what is rendered and trained. ``tools`` is the
    record's function schemas as a JSON list (``{"type": "function", "function": {...}}``
    each), or ``None``. ``text`` records have ``prompt == ""``.

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
        """The content hash (:func:`sample_id`)."""
        return sample_id(self.system, self.prompt, self.response, self.tools)


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


def sample_id(system: str, prompt: str, response: str, tools: str | None = None) -> str:
    """Stable content hash of a sample: the first 16 hex digits of sha256 over the
    length-prefixed UTF-8 of system, prompt, response and, when the sample has any, its
    ``tools`` JSON (so the ids of samples without tools are what they were before tools were
    read, and samples that differ only in their tools are not duplicates).

    Identical content gets the same id in any file or run; 64 bits make a collision in a
    10-million-sample pool about a 3e-6 chance.
    """
    h = hashlib.sha256()
    for part in (system, prompt, response, *([] if tools is None else [tools])):
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _text(value: object, field: str, where: str) -> str:
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


def _tools(record: Mapping[Any, Any], where: str) -> str | None:
    """The record's function schemas as a JSON list, or None (absent, null, ``""`` or
    ``[]``). ``tools`` (OpenAI, TRL, LLaMA-Factory; a list, or a string holding one) or the
    legacy OpenAI ``functions``; a bare schema (``{"name", "description", "parameters"}``, as
    Glaive writes) is wrapped as ``{"type": "function", "function": schema}``, the form
    ``apply_chat_template(tools=...)`` documents."""
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


def _tool_calls(turn: Mapping[str, Any], field: str, i: int, where: str, dropped: Counter) -> str:
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


@dataclass(frozen=True)
class _Chat:
    system: str
    prompt: str
    response: str
    messages: str | None
    dropped_turns: dict[str, int]


def _from_turns(
    turns: object,
    role_key: str,
    text_key: str,
    form: str,
    field: str,
    system_field: str,
    where: str,
    dropped: Counter,
) -> _Chat:
    """A conversation record's turns, normalised (docs/design.md, "Reading datasets": chat
    rules). ``system_field`` is the record's own ``system`` field (a leading system turn);
    turn keys the reader does not read are counted into ``dropped`` as ``field[].key``."""
    if not isinstance(turns, list) or not turns:
        raise DatasetFormatError(f"{where}: {form} record needs a non-empty list of turns.")
    normalised: list[tuple[str, str]] = [("system", system_field)] if system_field else []
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
        role = _ROLE_ALIASES.get(str(turn[role_key]).lower())
        if role is None:
            raise DatasetFormatError(
                f"{where}: turn {i} has unknown role {turn[role_key]!r}; "
                f"expected one of {sorted(set(_ROLE_ALIASES))}."
            )
        content = _text(turn.get(text_key), text_key, where)
        read = {role_key, text_key}
        if calls_ok and role == "assistant":
            read |= {"tool_calls", "function_call"}
            calls = _tool_calls(turn, field, i, where, dropped)
            content = f"{content}\n\n{calls}" if calls and content.strip() else calls or content
        for key, value in turn.items():
            if key not in read and value is not None:
                dropped[f"{field}[].{key}"] += 1
        normalised.append((role, content))
    first = next((i for i, (r, _) in enumerate(normalised) if r != "system"), None)
    if (
        first is not None
        and normalised[first][0] == "assistant"
        and any(r == "user" for r, _ in normalised)
    ):
        raise DatasetFormatError(
            f"{where}: the {form} record opens with an assistant turn (turn "
            f"{first - bool(system_field)}), before any user turn: there is no question for it "
            "to answer, and chat templates render an answer only after one. Remove the leading "
            "assistant turn(s), or put the user turn first."
        )
    last_assistant = max((i for i, (r, _) in enumerate(normalised) if r == "assistant"), default=-1)
    if last_assistant < 0:
        raise DatasetFormatError(f"{where}: {form} record has no assistant turn to learn from.")
    kept = normalised[: last_assistant + 1]
    after = len(normalised) - len(kept)
    dropped_turns = {"after_last_assistant": after} if after else {}
    system = "\n\n".join(t for r, t in kept[:last_assistant] if r == "system")
    dialogue = [(r, t) for r, t in kept[:last_assistant] if r != "system"]
    if not any(r == "user" for r, _ in dialogue):
        raise DatasetFormatError(f"{where}: {form} record has no user turn before its answer.")
    as_json = json.dumps([{"role": r, "content": t} for r, t in kept], ensure_ascii=False)
    if len(dialogue) == 1:
        # One exchange: system / prompt / response say it all; a record that had more turns
        # (dropped after the answer) still shows the conversation it was cut to.
        return _Chat(system, dialogue[0][1], kept[-1][1], as_json if after else None, dropped_turns)
    # Earlier turns are context for the last answer; keep them readable in one prompt (the
    # sample id hashes this text, as before turns were kept).
    prompt = "\n\n".join(f"{r.capitalize()}: {t}" for r, t in dialogue)
    return _Chat(system, prompt, kept[-1][1], as_json, dropped_turns)


_ACCEPTED = (
    "Use instruction/input/output (Alpaca), instruction/response, problem/solution "
    "(Magicoder), prompt/completion (TRL), conversations (ShareGPT), messages (OpenAI) or "
    f"text; or map your fields onto these in {FIELDS_CONFIG_NAME} in the dataset folder."
)

# The top-level fields each form reads; every other non-null field is counted as dropped.
_COMMON = ("system", "tools", "functions")
_READ = {
    "openai": ("messages", *_COMMON),
    "sharegpt": ("conversations", *_COMMON),
    "prompt_completion_chat": ("prompt", "completion", *_COMMON),
    "prompt_completion": ("prompt", "completion", *_COMMON),
    "alpaca": ("instruction", "input", "output", *_COMMON),
    "instruction_response": ("instruction", "input", "response", *_COMMON),
    "magicoder": ("problem", "solution", *_COMMON),
    "text": ("text",),
}


def normalise_record(
    record: object,
    source_file: str,
    source_line: int,
    fields: dict[str, str] | None = None,
    source_index: int | None = None,
) -> Sample:
    """Turn one raw record into a :class:`Sample`. ``fields`` renames keys first
    (``{"question": "instruction"}``, from the folder's ``fields.json``; :func:`rename_fields`).
    ``source_index``: the record's 0-based place among those of its file.

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
    dropped: Counter = Counter()
    chat: _Chat | None = None
    if "messages" in record:
        form = "openai"
    elif "conversations" in record:
        form = "sharegpt"
    elif "prompt" in record and "completion" in record:
        chat_lists = isinstance(record["prompt"], list) and isinstance(record["completion"], list)
        form = "prompt_completion_chat" if chat_lists else "prompt_completion"
    elif "instruction" in record and ("output" in record or "response" in record):
        form = "alpaca" if "output" in record else "instruction_response"
    elif "problem" in record and "solution" in record:
        form = "magicoder"
    elif "text" in record:
        form = "text"
    else:
        raise DatasetFormatError(
            f"{where}: record with keys {sorted(map(str, record))[:12]}"
            + (f" (after {FIELDS_CONFIG_NAME} renamed {fields})" if fields else "")
            + " matches no accepted form. "
            + _ACCEPTED
        )
    for key, value in record.items():
        if key not in _READ[form] and value is not None:
            dropped[original.get(key, key)] += 1
    if form == "text":
        text = _text(record["text"], "text", where)
        if not text.strip():
            raise DatasetFormatError(
                f"{where}: the text is empty; remove the record or fill it in."
            )
        return Sample(
            "", text, "", "text", source_file, source_line, None, None, {}, dropped, source_index
        )
    system = _text(record.get("system"), "system", where)
    tools = _tools(record, where)
    if form in ("openai", "sharegpt", "prompt_completion_chat"):
        if form == "openai":
            turns, keys, name = record["messages"], ("role", "content"), "messages"
        elif form == "sharegpt":
            turns, keys, name = record["conversations"], ("from", "value"), "conversations"
        else:
            turns, keys = [*record["prompt"], *record["completion"]], ("role", "content")
            name = "prompt/completion"
        chat = _from_turns(turns, *keys, form, name, system, where, dropped)
        system, prompt, response = chat.system, chat.prompt, chat.response
    elif form == "prompt_completion":
        prompt = _text(record["prompt"], "prompt", where)
        response = _text(record["completion"], "completion", where)
    elif form in ("alpaca", "instruction_response"):
        instruction = _text(record["instruction"], "instruction", where)
        extra = _text(record.get("input"), "input", where)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        answer = "output" if form == "alpaca" else "response"
        response = _text(record[answer], answer, where)
    else:
        prompt = _text(record["problem"], "problem", where)
        response = _text(record["solution"], "solution", where)
    if not prompt.strip():
        raise DatasetFormatError(f"{where}: the prompt is empty; remove the record or fill it in.")
    return Sample(
        prompt,
        response,
        system,
        form,
        source_file,
        source_line,
        chat.messages if chat else None,
        tools,
        chat.dropped_turns if chat else {},
        dict(dropped),
        source_index,
    )


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


def _hint(path: Path) -> str:
    if path.suffix.lower() == ".jsonl":
        return (
            "Each line of a .jsonl file must be one JSON object (a pretty-printed JSON array "
            "belongs in a .json file)."
        )
    return (
        "A .json file holds one JSON value (an array of records or one record) or several in "
        "a row separated by whitespace; fix or split the file."
    )


def _read_table(path: Path):
    """A Parquet or Arrow (streaming or file format) file as a polars frame.

    Raises:
        DatasetFormatError: the file cannot be read; a string that is not UTF-8 is named by
            row and column.
    """
    import polars as pl

    kind = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow"
    try:
        if kind == "Parquet":
            return pl.read_parquet(path)
        try:  # `datasets` writes the Arrow streaming format; other tools the file format.
            return pl.read_ipc_stream(path)
        except Exception:
            return pl.read_ipc(path)
    except Exception as e:  # polars raises several types for corrupt files
        bad = _first_invalid_utf8(path)
        if bad:
            raise DatasetFormatError(bad) from None
        raise DatasetFormatError(f"{path}: cannot read {kind} file ({e}).") from e


def _first_invalid_utf8(path: Path) -> str | None:
    """The message for the first top-level string value of a Parquet/Arrow file that is not
    UTF-8, or None (the file is unreadable for another reason)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            table = pq.read_table(path)
        else:
            try:
                table = pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except Exception:
        return None
    for name in table.column_names:
        column = table.column(name)
        if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
            continue
        binary = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
        for row, value in enumerate(column.cast(binary).to_pylist(), start=1):
            if value is None:
                continue
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as e:
                bytes_ = value[e.start : e.start + 3]
                surrogate = bytes_[:1] == b"\xed" and len(bytes_) > 1 and bytes_[1] >= 0xA0
                why = (
                    " (the UTF-8 form of an unpaired UTF-16 surrogate, which UTF-8 cannot store)"
                    if surrogate
                    else ""
                )
                return (
                    f"{path}:{row}: column {name!r} holds a string that is not UTF-8 (bytes "
                    f"{bytes_.hex(' ')} at byte {e.start + 1}{why}). Write the column as UTF-8 "
                    "text (re-encode it from its source) or remove the character."
                )
    return None


def iter_file_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line or row number, raw record) from a JSONL, JSON, Parquet or Arrow
    file; JSON text is read strictly (:mod:`cluster_pipeline.data.json_text`).

    Raises:
        DatasetFormatError: unreadable or malformed file (message names the file, line and,
            for JSON, the column).
    """
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".arrow"):
        yield from enumerate(_read_table(path).iter_rows(named=True), start=1)
        return
    if suffix not in (".json", ".jsonl"):
        raise DatasetFormatError(f"{path}: unsupported suffix; use one of {SUPPORTED_SUFFIXES}.")
    try:
        text = json_text.read_text(path)
        read = json_text.iter_lines if suffix == ".jsonl" else json_text.iter_values
        yield from read(path, text, _hint(path))
    except json_text.JsonTextError as e:
        raise DatasetFormatError(str(e)) from None


_BOM = b"\xef\xbb\xbf"


def empty_file_reason(path: Path) -> str | None:
    """Why a data file holds no record (``"0 bytes"``, ``"only whitespace"``, ``"only a
    byte-order mark"``, ``"only an empty JSON array"``, ``"no rows"``, ...), or None when it may
    hold one. Cheap enough for the sensor: JSON text is read only up to its first character
    that is not whitespace or an empty array; Parquet by its footer; Arrow batch by batch up
    to the first non-empty one. A file that cannot be read gives None (the reader names what
    is wrong with it)."""
    try:
        if path.stat().st_size == 0:
            return "0 bytes"
    except OSError:
        return None
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".arrow"):
        return None if _has_rows(path) is not False else "no rows"
    bom, whitespace, arrays, in_array = False, False, 0, False
    with path.open("rb") as f:
        head = f.read(len(_BOM))
        if head == _BOM:
            bom, head = True, b""
        block = head
        while True:
            for byte in block:
                if byte in b" \t\r\n":
                    whitespace = True
                elif suffix == ".json" and not in_array and byte == ord("["):
                    in_array = True
                elif in_array and byte == ord("]"):
                    in_array, arrays = False, arrays + 1
                else:
                    return None
            block = f.read(1 << 16)
            if not block:
                break
    if in_array:
        return None  # an unclosed array: the reader names it
    if arrays:
        return "only an empty JSON array" if arrays == 1 else "only empty JSON arrays"
    if whitespace:
        return "only a byte-order mark and whitespace" if bom else "only whitespace"
    return "only a byte-order mark"


def _has_rows(path: Path) -> bool | None:
    """Whether a Parquet/Arrow file has a row; None if it cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_metadata(path).num_rows > 0
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
            return any(batch.num_rows for batch in reader)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            return any(file.get_batch(i).num_rows for i in range(file.num_record_batches))
    except Exception:
        return None


def data_files(folder: Path) -> list[Path]:
    """The dataset's sample files under ``folder``, sorted: every .json/.jsonl/.parquet/.arrow
    file except the folder's own settings (``eval.json``, ``fields.json``) and the metadata
    files of a ``datasets.save_to_disk`` folder."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix.lower() in SUPPORTED_SUFFIXES
        and p not in (folder / EVAL_CONFIG_NAME, folder / FIELDS_CONFIG_NAME)
        and not (p.name in HF_METADATA_NAMES and _is_hf_folder(p.parent))
    )


def ignored_files(folder: Path) -> list[Path]:
    """The files under ``folder`` the reader does not read, sorted: everything but
    :func:`data_files`, the folder's settings, its card and license file (:data:`CARD_NAME`,
    :data:`LICENSE_NAMES`) and a ``datasets.save_to_disk`` folder's metadata (hidden files and
    folders are skipped). ``raw_instructions`` counts them, so a CSV or text file beside the
    data is never silently passed over."""
    read = set(data_files(folder))
    documentation = {folder / name for name in (CARD_NAME, *LICENSE_NAMES)}
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p not in read
        and p not in documentation
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and p not in (folder / EVAL_CONFIG_NAME, folder / FIELDS_CONFIG_NAME)
        and not (p.name in HF_METADATA_NAMES and _is_hf_folder(p.parent))
    )


def _is_hf_folder(folder: Path) -> bool:
    return any(folder.glob("*.arrow")) or (folder / "dataset_dict.json").exists()


def read_fields(folder: Path) -> dict[str, str]:
    """The folder's field renaming (``fields.json``), or ``{}``.

    Raises:
        DatasetFormatError: the file is not a JSON object of string -> string.
    """
    path = folder / FIELDS_CONFIG_NAME
    if not path.exists():
        return {}
    try:
        fields = json_text.load(path, 'It must be one object, e.g. {"question": "instruction"}.')
    except json_text.JsonTextError as e:
        raise DatasetFormatError(str(e)) from None
    if not isinstance(fields, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in fields.items()
    ):
        raise DatasetFormatError(
            f"{path}: must map each of your field names to an accepted one, e.g. "
            '{"question": "instruction", "answer": "output"}.'
        )
    unknown = {k: v for k, v in fields.items() if v not in FIELD_NAMES}
    if unknown:
        bad = ", ".join(f"{k!r} -> {v!r}" for k, v in unknown.items())
        raise DatasetFormatError(
            f"{path}: {bad}: no accepted form has such a field; map onto one of "
            f"{', '.join(FIELD_NAMES)}."
        )
    return fields


def read_dataset_folder(folder: Path) -> Iterator[Sample]:
    """Yield every sample of every data file (:func:`data_files`) under ``folder``, in sorted
    path order, after the folder's field renaming (:func:`read_fields`).

    Raises:
        DatasetFormatError: the folder holds no data file, a data file holds no record
            (:func:`empty_file_reason`), or a file or record is malformed.
    """
    files = data_files(folder)
    if not files:
        raise DatasetFormatError(
            f"{folder}: no {', '.join(SUPPORTED_SUFFIXES)} files found; put the dataset's files "
            "in this folder."
        )
    fields = read_fields(folder)
    for path in files:
        # Checked first: a 0-byte Parquet file is not even readable as Parquet.
        empty = empty_file_reason(path)
        n = 0
        if empty is None:
            for line, record in iter_file_records(path):
                yield normalise_record(record, str(path), line, fields, source_index=n)
                n += 1
        if n == 0:
            raise DatasetFormatError(
                f"{path}: holds no records ({empty or 'none read'}); remove the file or put the "
                "dataset's records in it."
            )
