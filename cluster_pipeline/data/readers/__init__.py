"""File readers: one class per file type, one module each, found in this package
(:mod:`cluster_pipeline.plugins`); a file's suffix picks its reader.

Files may be JSONL (one record per line), JSON (one record, an array of records, or several
such values in a row), Parquet (any number of shards) or the Arrow files of a Hugging Face
``datasets`` folder written by ``save_to_disk``. JSON text is read strictly
(:mod:`cluster_pipeline.data.json_text`: what ``json.loads`` rejects, ``NaN``, unpaired
surrogates and repeated keys are refused at ``file:line:column``); a Parquet or Arrow string
that is not UTF-8 is refused at ``file:row`` with its column; a file that holds no record
(0 bytes, whitespace, ``[]``, no rows) is refused by name (:func:`empty_file_reason`).

Adding a file type is one module here with one :class:`~.base.FileReader` subclass (its
suffix, its place in the listing, ``records`` and ``empty_reason``; a JSON text or table
layout subclasses :class:`~.base.JsonTextReader` or :class:`~.base.TableReader`) and its test;
nothing else lists file types.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster_pipeline.data.readers.base import FileReader, text_empty_reason
from cluster_pipeline.data.samples import DatasetFormatError
from cluster_pipeline.plugins import discover

# Suffix -> reader, in the order the file types are listed to users.
REGISTRY: dict[str, FileReader] = {
    r.suffix: r for r in sorted(discover(sys.modules[__name__], FileReader), key=lambda r: r.listed)
}
SUPPORTED_SUFFIXES: tuple[str, ...] = tuple(REGISTRY)


def iter_file_records(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based line or row number, raw record) from a file of any supported type
    (:data:`SUPPORTED_SUFFIXES`); JSON text is read strictly
    (:mod:`cluster_pipeline.data.json_text`).

    Raises:
        DatasetFormatError: unsupported suffix, or an unreadable or malformed file (message
            names the file, line and, for JSON, the column).
    """
    reader = REGISTRY.get(path.suffix.lower())
    if reader is None:
        raise DatasetFormatError(f"{path}: unsupported suffix; use one of {SUPPORTED_SUFFIXES}.")
    yield from reader.records(path)


def empty_file_reason(path: Path) -> str | None:
    """Why a data file holds no record (``"0 bytes"``, ``"only whitespace"``, ``"only a
    byte-order mark"``, ``"only an empty JSON array"``, ``"no rows"``, ...), or None when it may
    hold one. Cheap enough for the sensor: JSON text is read only up to its first character
    that is not whitespace or an empty array; Parquet by its footer; Arrow batch by batch up
    to the first non-empty one. A file that cannot be read gives None (the reader names what
    is wrong with it); a suffix no reader has is scanned as JSON Lines would be."""
    try:
        if path.stat().st_size == 0:
            return "0 bytes"
    except OSError:
        return None
    reader = REGISTRY.get(path.suffix.lower())
    if reader is None:
        return text_empty_reason(path, arrays_allowed=False)
    return reader.empty_reason(path)
