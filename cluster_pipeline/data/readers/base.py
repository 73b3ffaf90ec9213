"""What a file reader is (:class:`FileReader`) and the two families the readers belong to: JSON
text (:class:`JsonTextReader`, read strictly by :mod:`cluster_pipeline.data.json_text`) and
Arrow-backed tables (:class:`TableReader`: Parquet, Arrow)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cluster_pipeline.data import json_text
from cluster_pipeline.data.samples import DatasetFormatError

if TYPE_CHECKING:  # imported where a table is read: the sensor scans JSON without them
    import polars as pl
    import pyarrow as pa


class FileReader:
    """One file type: the raw records of a file, and why a file holds none.

    A reader is one class in a module of :mod:`cluster_pipeline.data.readers` (found there, no
    list to edit; :mod:`cluster_pipeline.plugins`). It sets ``name`` (the type, in words),
    ``suffix`` (lower case, with the dot; a file's suffix picks its reader) and ``listed`` (its
    place where the types are listed to users), and implements :meth:`records` and
    :meth:`empty_reason`.
    """

    name: ClassVar[str]
    suffix: ClassVar[str]
    listed: ClassVar[int]

    def records(self, path: Path) -> Iterator[tuple[int, Any]]:
        """Yield (1-based line or row number, raw record) for every record of the file.

        Raises:
            DatasetFormatError: the file is unreadable or malformed (the message names the
                file, line and, for JSON, the column).
        """
        raise NotImplementedError

    def empty_reason(self, path: Path) -> str | None:
        """Why the file (not 0 bytes) holds no record, or None when it may hold one; cheap
        enough for the sensor, and None for a file that cannot be read (:meth:`records`
        names what is wrong with it)."""
        raise NotImplementedError


class JsonTextReader(FileReader):
    """A JSON text file: ``parse`` is the :mod:`~cluster_pipeline.data.json_text` reader of
    its layout, ``hint`` what its error messages add about that layout, ``arrays`` whether a
    top-level array of records is allowed."""

    parse: ClassVar[Callable[[Path, str, str], Iterator[tuple[int, Any]]]]
    hint: ClassVar[str]
    arrays: ClassVar[bool]

    def records(self, path: Path) -> Iterator[tuple[int, Any]]:
        """The file's records, read strictly (:mod:`~cluster_pipeline.data.json_text`).

        Raises:
            DatasetFormatError: the text is not strict JSON in this layout
                (``file:line:column`` and the hint).
        """
        try:
            text = json_text.read_text(path)
            yield from type(self).parse(path, text, self.hint)
        except json_text.JsonTextError as e:
            raise DatasetFormatError(str(e)) from None

    def empty_reason(self, path: Path) -> str | None:
        """:func:`text_empty_reason`, with arrays where the layout allows them."""
        return text_empty_reason(path, self.arrays)


_BOM = b"\xef\xbb\xbf"


def text_empty_reason(path: Path, arrays_allowed: bool) -> str | None:
    """Why a JSON text file holds no record (``"only whitespace"``, ``"only a byte-order
    mark"``, ``"only an empty JSON array"``, ...), or None when it may hold one: the file is
    read only up to its first character that is not whitespace (or, with ``arrays_allowed``,
    part of an empty array)."""
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
                elif arrays_allowed and not in_array and byte == ord("["):
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


class TableReader(FileReader):
    """A file of Arrow-typed rows, one record per row: the type reads it as a polars frame
    (:meth:`frame`) and a pyarrow table (:meth:`arrow_table`, used to name a string that is
    not UTF-8), and says whether it has a row (:meth:`has_rows`)."""

    def frame(self, path: Path) -> pl.DataFrame:
        """The file as a polars frame (any exception for an unreadable file)."""
        raise NotImplementedError

    def arrow_table(self, path: Path) -> pa.Table:
        """The file as a pyarrow table, without UTF-8 validation of its strings (any
        exception for an unreadable file)."""
        raise NotImplementedError

    def has_rows(self, path: Path) -> bool:
        """Whether the file has a row, read from as little of it as the type allows (any
        exception for an unreadable file)."""
        raise NotImplementedError

    def records(self, path: Path) -> Iterator[tuple[int, Any]]:
        """Every row as a dict, numbered from 1.

        Raises:
            DatasetFormatError: the file cannot be read; a string that is not UTF-8 is named by
                row and column.
        """
        try:
            frame = self.frame(path)
        except Exception as e:  # polars raises several types for corrupt files
            bad = self._first_invalid_utf8(path)
            if bad:
                raise DatasetFormatError(bad) from None
            raise DatasetFormatError(f"{path}: cannot read {self.name} file ({e}).") from e
        yield from enumerate(frame.iter_rows(named=True), start=1)

    def empty_reason(self, path: Path) -> str | None:
        """``"no rows"``, or None when the file has a row or cannot be read."""
        try:
            has_rows = self.has_rows(path)
        except Exception:
            return None
        return None if has_rows else "no rows"

    def _first_invalid_utf8(self, path: Path) -> str | None:
        """The message for the first top-level string value of the file that is not UTF-8, or
        None (the file is unreadable for another reason)."""
        import pyarrow as pa

        try:
            table = self.arrow_table(path)
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
                        " (the UTF-8 form of an unpaired UTF-16 surrogate, which UTF-8 cannot "
                        "store)"
                        if surrogate
                        else ""
                    )
                    return (
                        f"{path}:{row}: column {name!r} holds a string that is not UTF-8 (bytes "
                        f"{bytes_.hex(' ')} at byte {e.start + 1}{why}). Write the column as UTF-8 "
                        "text (re-encode it from its source) or remove the character."
                    )
        return None
