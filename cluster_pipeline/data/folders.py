"""A dataset folder's rules: which files are its samples, which are its own settings or
documentation, and how every sample of it is read.

The data files are every file under the folder, recursively, whose suffix a reader has
(:data:`~cluster_pipeline.data.readers.SUPPORTED_SUFFIXES`), in sorted path order, except the
folder's settings (``eval.json``: its benchmarks; ``fields.json``: field renaming, applied to
every record before the forms are tried) and the metadata a ``datasets.save_to_disk`` folder
keeps beside its Arrow files (``dataset_info.json``, ``state.json``, ``dataset_dict.json``).
The folder's card and license file are documentation: never read as samples, never counted
among the files not read. Every sample keeps the file, the 1-based line (Parquet, Arrow: row)
it came from and its 0-based place among the file's records (``source_index``: records of a
one-line JSON array share a line), so a trained-on sample can be traced back to its source.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path

from cluster_pipeline.data import json_text
from cluster_pipeline.data.forms import FIELD_NAMES, FIELDS_CONFIG_NAME, normalise_record
from cluster_pipeline.data.readers import (
    SUPPORTED_SUFFIXES,
    empty_file_reason,
    iter_file_records,
)
from cluster_pipeline.data.samples import DatasetFormatError, Sample

# A dataset folder's own settings (its evaluation benchmarks), never read as samples.
EVAL_CONFIG_NAME = "eval.json"
# A dataset folder's documentation, never read as samples nor counted as files not read: its
# card, whose YAML front matter may declare the license, and its license file
# (data/datasets.source_license).
CARD_NAME = "README.md"
LICENSE_NAMES = ("LICENSE", "LICENSE.md", "LICENSE.txt")
# What `datasets.Dataset.save_to_disk` writes beside its Arrow files.
HF_METADATA_NAMES = ("dataset_info.json", "state.json", "dataset_dict.json")


def data_files(folder: Path) -> list[Path]:
    """The dataset's sample files under ``folder``, sorted: every file with a supported suffix
    (.json/.jsonl/.parquet/.arrow) except the folder's own settings (``eval.json``,
    ``fields.json``) and the metadata files of a ``datasets.save_to_disk`` folder."""
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


# Compressed files are not read (no reader decompresses): each suffix with the command that
# decompresses a file of it in place, and the archives, which a user extracts into the folder.
DECOMPRESS = {".gz": "gunzip", ".bz2": "bunzip2", ".xz": "unxz", ".zst": "unzstd --rm"}
ARCHIVES = {".zip": "unzip", ".tgz": "tar -xzf", ".tar": "tar -xf", ".7z": "7z x"}


def compressed_files(folder: Path) -> list[Path]:
    """The files of ``folder`` the reader passes over because they are compressed: a data
    file compressed whole (``data.jsonl.gz``, ``.bz2``, ``.xz``, ``.zst``) or an archive
    (``.zip``, ``.tgz``, ``.tar``, ``.7z``), sorted."""
    out = []
    for p in ignored_files(folder):
        suffix = p.suffix.lower()
        inner = Path(p.stem).suffix.lower()
        if (suffix in DECOMPRESS and inner in SUPPORTED_SUFFIXES) or suffix in ARCHIVES:
            out.append(p)
    return out


def compressed_note(folder: Path) -> str | None:
    """``compressed files are not read: data.jsonl.gz; decompress them in the folder first
    (`gunzip '<path>'`)``, naming up to three of :func:`compressed_files` and the command for
    the first (archives: extract them into the folder); None when there is none."""
    files = compressed_files(folder)
    if not files:
        return None
    shown = ", ".join(str(p.relative_to(folder)) for p in files[:3])
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    first = files[0]
    suffix = first.suffix.lower()
    if suffix in ARCHIVES:
        how = f"extract them into {folder} first (`cd {shlex.quote(str(first.parent))} && "
        how += f"{ARCHIVES[suffix]} {shlex.quote(first.name)}`)"
    else:
        how = f"decompress them in place first (`{DECOMPRESS[suffix]} {shlex.quote(str(first))}`)"
    return f"compressed files are not read: {shown}{more}; {how}"


def not_read_warning(dataset: str, folder: Path) -> tuple[list[str], str | None]:
    """The files of a dataset folder the reader does not read (:func:`ignored_files`, relative
    to ``folder``; none when it is not a folder), and the warning that names them (up to five,
    then ``...``) with :func:`compressed_note`; None when every file is read."""
    if not folder.is_dir():
        return [], None
    not_read = [str(p.relative_to(folder)) for p in ignored_files(folder)]
    if not not_read:
        return [], None
    compressed = compressed_note(folder)
    return not_read, (
        f"{dataset}: {len(not_read)} file(s) not read (not .json, .jsonl, .parquet or "
        f".arrow): {', '.join(not_read[:5])}{' ...' if len(not_read) > 5 else ''}"
        + (f"; {compressed}" if compressed else "")
    )


def _is_hf_folder(folder: Path) -> bool:
    return any(folder.glob("*.arrow")) or (folder / "dataset_dict.json").exists()


def read_fields(folder: Path) -> dict[str, str]:
    """The folder's field renaming (``fields.json``), or ``{}``.

    Raises:
        DatasetFormatError: the file is not a JSON object of string -> string, or maps onto a
            field no form reads (:data:`~cluster_pipeline.data.forms.FIELD_NAMES`).
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
            (:func:`~cluster_pipeline.data.readers.empty_file_reason`), or a file or record is
            malformed.
    """
    files = data_files(folder)
    if not files:
        note = compressed_note(folder)
        raise DatasetFormatError(
            f"{folder}: no {', '.join(SUPPORTED_SUFFIXES)} files found; "
            + (f"{note}." if note else "put the dataset's files in this folder.")
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


def _same_sample(
    record: object,
    file: str,
    line: int,
    index: int,
    renames: dict[str, str] | None,
    sample_id: str,
    used_for: str,
    remedy: str,
) -> None:
    """Raise when ``record`` (record ``index`` of ``file``, at ``line``) is not the sample
    ``sample_id`` that was read there (:func:`record_field_values`' ``identity``)."""
    try:
        found = normalise_record(record, file, line, renames, source_index=index).sample_id
    except DatasetFormatError:
        found = None
    if found != sample_id:
        raise ValueError(
            f"{file}:{line}: record {index} is not the sample read there (sample {sample_id}), "
            f"so {used_for} cannot be read from it: the file changed since it was read; " + remedy
        )


# What to do when a file changed since it was read: a pool is the raw_instructions version it
# was clustered from, so the chain from raw_instructions runs again; a target set is read anew by
# the selection step.
POOL_REMEDY = (
    "materialize raw_instructions, proxy_embeddings, balanced_clusters and peripheral_subsets "
    "again (the pool is the raw_instructions version it was clustered from)"
)
TARGET_REMEDY = "run peripheral_subsets again (it reads the target set anew)"


# A shard's place in its file name, as the Hub's datasets write them (``train-00000-of-00002
# .parquet``; ``save_to_disk``'s ``data-00000-of-00001.arrow``).
_SHARD = re.compile(r"-\d{5}-of-\d{5}(?=\.[^./]+$)")


def file_group(file: str) -> str:
    """The file a sample's source or task is named by when its record names none: the file
    itself, a shard of a sharded file being the whole file (``code/train-00001-of-00002.parquet``
    -> ``code/train.parquet``), so a dataset saved in shards is one source, not one per shard."""
    return _SHARD.sub("", file)


def record_field_values(
    files: list[str],
    indices: list[int | None],
    fields: tuple[str, ...],
    used_for: str,
    identity: tuple[Path, list[str]] | None = None,
    remedy: str = POOL_REMEDY,
) -> list[str | None]:
    """Each sample's first non-empty field of ``fields`` in the record it was read from (a
    string or number, not a bool; a number as its ``str``): the record's ``source`` for S2L's
    per-source split, a target record's ``task`` for LESS's and RDS+'s subtasks. The files are
    read again, each once.

    Args:
        files: (N,) each sample's ``source_file`` ("" for none).
        indices: (N,) each sample's ``source_index`` (0-based place among the file's records;
            None for a table written before that column).
        fields: the field names, first found wins.
        used_for: what the values are for, named in the errors ("the pool's sources").
        identity: (the dataset folder, (N,) each sample's ``sample_id``): each record read is
            turned into its sample again, under the folder's field renaming, and must be that
            sample (a file rewritten in another order, same length, would otherwise give each
            sample another record's field).
        remedy: what to do when a file changed, in the errors (:data:`POOL_REMEDY` for a pool,
            :data:`TARGET_REMEDY` for a target set).

    Returns:
        (N,) the value, or None where the sample has no file or index, or its record none of
        ``fields``.

    Raises:
        ValueError: a file is gone, holds fewer records than an index names, or (with
            ``identity``) holds another sample at an index: it changed since it was read;
            naming the file and record and what to do.
    """
    out: list[str | None] = [None] * len(files)
    wanted: dict[str, dict[int, list[int]]] = {}
    for row, (file, index) in enumerate(zip(files, indices, strict=True)):
        if file and index is not None:
            wanted.setdefault(file, {}).setdefault(int(index), []).append(row)
    renames = read_fields(identity[0]) if identity is not None else None
    for file, places in wanted.items():
        path = Path(file)
        if not path.is_file():
            raise ValueError(
                f"{file}: the file is gone, so {used_for} (its records' {'/'.join(fields)} "
                f"field) cannot be read; put it back, or {remedy}"
            )
        n = -1
        for n, (line, record) in enumerate(iter_file_records(path)):
            if n in places and identity is not None:
                sample_id = identity[1][places[n][0]]
                _same_sample(record, file, line, n, renames, sample_id, used_for, remedy)
            if n in places and isinstance(record, dict):
                for name in fields:
                    value = record.get(name)
                    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                        if str(value) == "":
                            continue
                        for row in places[n]:
                            out[row] = str(value)
                        break
        if max(places) > n:
            raise ValueError(
                f"{file}: holds {n + 1} records, but {used_for} name record {max(places)} of "
                f"it: the file changed since it was read; {remedy}"
            )
    return out
