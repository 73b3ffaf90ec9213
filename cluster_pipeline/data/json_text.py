r"""Strict reading of JSON text: what the dataset reader, ``fields.json`` and ``eval.json`` parse.

Every JSON value is parsed by the standard library's ``json`` decoder, so anything
``json.loads`` rejects is refused, and three things it accepts are refused as well, because each
would change a sample without a word (docs/design.md, "Reading datasets"):

* ``NaN``, ``Infinity`` and ``-Infinity``: not JSON (RFC 8259); read as text they would become
  the words ``nan``/``inf``.
* an unpaired UTF-16 surrogate escape (``"\ud800"``, ``"\udfff"``, a high surrogate followed
  by anything but a low one), in a key or a value: UTF-8 cannot store it, so it could never be
  hashed, tokenized or written to a table.
* the same key twice in one object: the decoder keeps only the last value.

A file of records may hold several top-level values in a row (``cat a.json b.json``; also JSON
Lines in a ``.json`` file), separated by whitespace only; the elements of a top-level array are
yielded one by one with the line each starts on. Inside an array the grammar is JSON's: a comma
between two elements, none before ``]``.

Every error is a :class:`JsonTextError` whose message starts ``file:line:column:`` (1-based;
columns count characters, as ``json.JSONDecodeError.colno`` does) and ends with what to do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

_WHITESPACE = " \t\r\n"
# A JSON string token, or a non-finite constant outside strings (group 1).
_CONSTANT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)', re.S)
# Every backslash escape, left to right: in JSON text backslashes occur only inside strings, so
# scanning escapes from any token boundary stays in step (``\\\\`` is one escape).
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.S)
# A quick filter: could the span hold a surrogate escape at all?
_MAYBE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonTextError(ValueError):
    """Text that is not strict JSON (module docstring). ``str()`` is
    ``"file:line:column: problem. remedy"``."""


class _NonFinite(ValueError):
    def __init__(self, name: str):
        self.name = name


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        self.key = key


def _parse_constant(name: str):
    raise _NonFinite(name)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


_DECODER = json.JSONDecoder(parse_constant=_parse_constant, object_pairs_hook=_object)


def position(text: str, pos: int) -> tuple[int, int]:
    """(line, column) of character ``pos`` of ``text``, both 1-based."""
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def read_text(path: Path) -> str:
    """The file as text; a UTF-8 byte-order mark is dropped.

    Raises:
        JsonTextError: the bytes are not UTF-8 (names the line, column and byte).
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise JsonTextError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column}). "
            "Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 in.jsonl > out.jsonl`."
        ) from None


class _Text:
    """One file's text, its path, the line a position is on (relative to ``line0``) and the
    remedy that ends every error."""

    def __init__(self, path: Path | None, text: str, hint: str, line0: int = 1):
        self.path, self.text, self.hint, self.line0 = path, text, hint, line0
        self._pos, self._line = 0, 1

    def line_at(self, pos: int) -> int:
        """1-based line of ``pos`` (counted on from the last call's position, so reading a file
        front to back counts each newline once)."""
        if pos < self._pos:
            self._pos, self._line = 0, 1
        self._line += self.text.count("\n", self._pos, pos)
        self._pos = pos
        return self._line + self.line0 - 1

    def where(self, pos: int) -> str:
        line, column = position(self.text, pos)
        if self.path is None:
            return f"line {line} column {column}"
        return f"{self.path}:{line + self.line0 - 1}:{column}"

    def error(self, pos: int, problem: str) -> JsonTextError:
        return JsonTextError(
            f"{self.where(pos)}: {problem}" + (f". {self.hint}" if self.hint else "")
        )

    def invalid(self, e: json.JSONDecodeError) -> JsonTextError:
        return self.error(e.pos, f"invalid JSON ({e.msg})")

    def value(self, pos: int) -> tuple[Any, int]:
        """The JSON value starting at ``text[pos]`` and the position after it."""
        try:
            value, end = _DECODER.raw_decode(self.text, pos)
        except json.JSONDecodeError as e:
            raise self.invalid(e) from None
        except _NonFinite as e:
            found = (m.start(1) for m in _CONSTANT.finditer(self.text, pos) if m.group(1))
            raise JsonTextError(
                f"{self.where(next(found, pos))}: invalid JSON ({e.name} is not a JSON value; "
                "Python's json writes it for a float NaN or infinity). Write null for a missing "
                "value, or quote it as a string."
            ) from None
        except _DuplicateKey as e:
            raise JsonTextError(
                f"{self.where(pos)}: the value starting here has the key {e.key!r} twice in one "
                "object; JSON readers keep only the last, so the first would vanish. Remove or "
                "rename one of them."
            ) from None
        self.check_surrogates(pos, end)
        return value, end

    def check_surrogates(self, start: int, end: int) -> None:
        """Refuse an unpaired surrogate escape in ``text[start:end]``."""
        if not _MAYBE_SURROGATE.search(self.text, start, end):
            return
        high: re.Match | None = None  # a high surrogate waiting for its low half
        bad: re.Match | None = None
        for m in _ESCAPE.finditer(self.text, start, end):
            code = int(m.group(1), 16) if m.group(1) else -1
            if high is not None:
                if 0xDC00 <= code <= 0xDFFF and m.start() == high.end():
                    high = None
                    continue
                bad = high
                break
            if 0xD800 <= code <= 0xDBFF:
                high = m
            elif 0xDC00 <= code <= 0xDFFF:
                bad = m
                break
        bad = bad or high
        if bad is not None:
            raise JsonTextError(
                f"{self.where(bad.start())}: the string holds {bad.group(0)}, an unpaired UTF-16 "
                "surrogate that UTF-8 cannot store (half of a character outside the Basic "
                "Multilingual Plane, such as an emoji cut in two). Re-encode the file from its "
                "source, or replace the escape with the whole character (a high surrogate "
                "\\ud800-\\udbff followed by a low one \\udc00-\\udfff) or delete it."
            )

    def skip_whitespace(self, pos: int) -> int:
        text, n = self.text, len(self.text)
        while pos < n and text[pos] in _WHITESPACE:
            pos += 1
        return pos

    def structure_error(self, start: int) -> JsonTextError:
        """The standard library's own message for the malformed value opening at ``start``."""
        try:
            _DECODER.raw_decode(self.text, start)
        except json.JSONDecodeError as e:
            return self.invalid(e)
        return self.error(start, "invalid JSON")  # unreachable: the loop follows JSON's grammar

    def array(self, start: int) -> Generator[tuple[int, Any], None, int]:
        """(position, element) of each element of the array opening at ``text[start]``; the
        generator's return value is the position after its ``]``."""
        text, n = self.text, len(self.text)
        pos = self.skip_whitespace(start + 1)
        if pos < n and text[pos] == "]":
            return pos + 1
        while True:
            if pos >= n or text[pos] == "]":  # end of file, or a comma before "]"
                raise self.structure_error(start)
            element_start = pos
            element, pos = self.value(pos)
            yield element_start, element
            pos = self.skip_whitespace(pos)
            if pos < n and text[pos] == "]":
                return pos + 1
            if pos >= n or text[pos] != ",":  # e.g. a missing comma between two elements
                raise self.structure_error(start)
            pos = self.skip_whitespace(pos + 1)


def load(path: Path, hint: str) -> Any:
    """The one JSON value of a settings file (``fields.json``, ``eval.json``), strictly
    (module docstring).

    Raises:
        JsonTextError: not UTF-8, not exactly one strict JSON value; ``hint`` ends the message.
    """
    return _one(_Text(path, read_text(path), hint))


def loads(s: str) -> Any:
    """One strict JSON value from a string (a field that holds JSON text); errors name the
    line and column inside the string.

    Raises:
        JsonTextError: as :func:`load`.
    """
    return _one(_Text(None, s, ""))


def _one(doc: _Text) -> Any:
    start = doc.skip_whitespace(0)
    if start >= len(doc.text):
        raise doc.error(start, "invalid JSON (no value)")
    value, end = doc.value(start)
    end = doc.skip_whitespace(end)
    if end < len(doc.text):
        raise doc.error(end, "invalid JSON (Extra data)")
    return value


def iter_values(path: Path, text: str, hint: str) -> Iterator[tuple[int, Any]]:
    """(1-based line, value) of a ``.json`` file's records: each top-level value in turn,
    whitespace between them; a top-level array yields its elements, each with the line it
    starts on.

    Raises:
        JsonTextError: see the module docstring.
    """
    doc = _Text(path, text, hint)
    pos, n = 0, len(text)
    while True:
        pos = doc.skip_whitespace(pos)
        if pos >= n:
            return
        if text[pos] == "[":
            elements = doc.array(pos)
            while True:
                try:
                    start, element = next(elements)
                except StopIteration as stop:
                    pos = stop.value
                    break
                yield doc.line_at(start), element
            continue
        value, end = doc.value(pos)
        yield doc.line_at(pos), value
        pos = end


def iter_lines(path: Path, text: str, hint: str) -> Iterator[tuple[int, Any]]:
    r"""(1-based line, value) of each non-blank line of a JSON Lines file. Lines end at ``\n``
    only: U+2028 and friends may sit inside JSON strings.

    Raises:
        JsonTextError: a line is not exactly one strict JSON value (module docstring).
    """
    for lineno, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        line = _Text(path, raw, hint, line0=lineno)
        yield lineno, _one(line)
