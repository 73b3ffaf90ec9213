"""Dataset partitions and the `raw_instructions` table: dedup, held-out split, optional cap.

A dataset partition is either the built-in ``python_stdlib`` or a folder ``data/raw/<name>/``
holding ``.json``, ``.jsonl`` or ``.parquet`` files in one of the forms of
:mod:`cluster_pipeline.data.formats`. The license its source declares: :func:`source_license`.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from cluster_pipeline.data.formats import (
    CARD_NAME,
    FIELDS_CONFIG_NAME,
    LICENSE_NAMES,
    SUPPORTED_SUFFIXES,
    Sample,
    compressed_note,
    data_files,
    empty_file_reason,
    read_dataset_folder,
)
from cluster_pipeline.data.stdlib_dataset import DATASET_NAME as STDLIB_DATASET
from cluster_pipeline.data.stdlib_dataset import iter_stdlib_samples
from cluster_pipeline.storage.layout import storage_name

INSTRUCTION_SCHEMA = {
    "sample_id": pl.String,
    "split": pl.String,
    "system": pl.String,
    "prompt": pl.String,
    "response": pl.String,
    "form": pl.String,
    "source_file": pl.String,
    "source_line": pl.Int64,
    # The record's 0-based place among those of source_file (records of a one-line JSON array
    # share source_line); null where source_line alone locates it (python_stdlib).
    "source_index": pl.Int64,
    # The kept conversation (JSON list of {role, content}) unless the record was one exchange.
    "messages": pl.String,
    # The function schemas (JSON list) the record gives the model; null when it has none.
    "tools": pl.String,
}


# What Dagster refuses in a partition key (dagster/_core/definitions/partitions/utils/base.py).
_INVALID_KEY_PARTS = ("...", "\a", "\b", "\f", "\n", "\r", "\t", "\v", "\0")


def dataset_name_problem(name: str) -> str | None:
    """Why a folder name cannot be a dataset partition, or None if it can. Every name Dagster
    accepts as a partition key is accepted (spaces and accents included), except hidden folders
    and the built-in dataset's name."""
    if name.startswith("."):
        return "hidden folders (name starting with '.') are not datasets"
    if name == STDLIB_DATASET:
        return f"{STDLIB_DATASET!r} is the built-in dataset's name; rename the folder"
    bad = [repr(part) for part in _INVALID_KEY_PARTS if part in name]
    if bad:
        return f"Dagster partition keys cannot contain {', '.join(bad)}; rename the folder"
    return None


def _folder_problem(folder: Path) -> str | None:
    """Why a visible folder holds no dataset, or None: no data file, or every data file holds
    no record (:func:`~cluster_pipeline.data.formats.empty_file_reason`; the check stops at the
    first file that may hold one)."""
    files = data_files(folder)
    if not files:
        note = compressed_note(folder)
        return f"{folder} holds no {', '.join(SUPPORTED_SUFFIXES)} file (eval.json and " + (
            f"fields.json are settings, not data); {note}"
            if note
            else "fields.json are settings, not data); put the dataset's files there"
        )
    empty = []
    for path in files:
        reason = empty_file_reason(path)
        if reason is None:
            return None
        empty.append(f"{path.relative_to(folder)} ({reason})")
    shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
    return f"every data file in {folder} holds no records: {shown}; put the dataset's records there"


def _data_folders(raw_dir: Path) -> list[Path]:
    if not raw_dir.is_dir():
        return []
    return [c for c in sorted(raw_dir.iterdir()) if c.is_dir() and _folder_problem(c) is None]


def discover_datasets(raw_dir: Path) -> list[str]:
    """Names of the dataset partitions: ``python_stdlib`` plus each ``raw_dir/<name>/`` folder
    that holds at least one data file with records (an ``eval.json`` alone, or files that are
    empty or whitespace, do not count) and whose name can be a partition key
    (:func:`dataset_name_problem`). Sorted, built-in first."""
    names = [c.name for c in _data_folders(raw_dir) if dataset_name_problem(c.name) is None]
    return [STDLIB_DATASET, *names]


def refused_datasets(raw_dir: Path) -> dict[str, str]:
    """Folders under ``raw_dir`` that are not partitions, with the reason: data under a name
    that cannot be a partition key, or a (visible) folder without data files or whose data
    files all hold no record."""
    out = {}
    if not raw_dir.is_dir():
        return out
    for c in sorted(raw_dir.iterdir()):
        if not c.is_dir():
            continue
        problem = _folder_problem(c)
        if problem is None:
            problem = dataset_name_problem(c.name)
        elif c.name.startswith("."):
            continue  # a hidden folder without data is nobody's dataset
        if problem is not None:
            out[c.name] = problem
    return dict(sorted(out.items()))


def load_samples(dataset: str, raw_dir: Path) -> Iterable[Sample]:
    """The samples of a dataset partition, in source order.

    Raises:
        FileNotFoundError: no built-in dataset and no folder ``raw_dir/<dataset>``.
        DatasetFormatError: a file or record is malformed.
    """
    if dataset == STDLIB_DATASET:
        return iter_stdlib_samples()
    folder = raw_dir / dataset
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no folder {folder}. Create it and put .json/.jsonl/.parquet "
            f"files in it, or use the built-in {STDLIB_DATASET!r}."
        )
    return read_dataset_folder(folder)


@dataclass(frozen=True)
class SplitStats:
    """Counts of one ``raw_instructions`` build; ``records_per_file`` maps each source file
    (relative to the dataset folder where possible) to the records read from it.
    ``dropped_turns`` (turns, by reason) and ``dropped_fields`` (occurrences, by field name)
    sum :attr:`Sample.dropped_turns` / :attr:`Sample.dropped_fields` over every record read,
    duplicates included: what the reader did not keep."""

    records: int
    duplicates: int
    train: int
    heldout: int
    train_available: int
    records_per_file: dict[str, int] = field(default_factory=dict)
    dropped_turns: dict[str, int] = field(default_factory=dict)
    dropped_fields: dict[str, int] = field(default_factory=dict)


def _order_key(seed: int, sid: str) -> str:
    return hashlib.sha256(f"{seed}:{sid}".encode()).hexdigest()


def build_instruction_table(
    samples: Iterable[Sample],
    heldout_fraction: float,
    max_heldout: int | None,
    max_train: int | None,
    seed: int,
) -> tuple[pl.DataFrame, SplitStats]:
    """Deduplicate samples by ``sample_id`` and set aside the held-out split.

    Samples are ordered by ``sha256(f"{seed}:{sample_id}")``, which is independent of file
    order; the first ``ceil(heldout_fraction * N)`` (at most ``max_heldout``) are held out, the
    next ``max_train`` (all if None) form the training pool. Samples past both caps are dropped:
    the caps exist to size quick runs.

    Returns:
        The table (columns :data:`INSTRUCTION_SCHEMA`, rows in source order) and counts.

    Raises:
        ValueError: ``heldout_fraction`` outside [0, 1), or no sample left for training.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    rows: dict[str, Sample] = {}
    records = 0
    per_file: dict[str, int] = {}
    turns: Counter[str] = Counter()
    fields: Counter[str] = Counter()
    for s in samples:
        records += 1
        per_file[s.source_file] = per_file.get(s.source_file, 0) + 1
        turns.update(s.dropped_turns)
        fields.update(s.dropped_fields)
        rows.setdefault(s.sample_id, s)
    n = len(rows)
    if n == 0:
        raise ValueError("the dataset holds no samples")
    order = sorted(rows, key=lambda sid: _order_key(seed, sid))
    n_heldout = math.ceil(heldout_fraction * n)
    if max_heldout is not None:
        n_heldout = min(n_heldout, max_heldout)
    train_available = n - n_heldout
    if train_available <= 0:
        raise ValueError(
            f"no training samples left: {n} distinct sample(s), all {n_heldout} held out "
            f"(heldout_fraction {heldout_fraction} of {n}, rounded up); add samples, or set "
            "raw_instructions.heldout_fraction: 0 (or a smaller max_heldout)"
        )
    n_train = train_available if max_train is None else min(max_train, train_available)
    split = {sid: "heldout" for sid in order[:n_heldout]}
    split.update({sid: "train" for sid in order[n_heldout : n_heldout + n_train]})
    kept = [(sid, s) for sid, s in rows.items() if sid in split]
    frame = pl.DataFrame(
        {
            "sample_id": [sid for sid, _ in kept],
            "split": [split[sid] for sid, _ in kept],
            "system": [s.system for _, s in kept],
            "prompt": [s.prompt for _, s in kept],
            "response": [s.response for _, s in kept],
            "form": [s.form for _, s in kept],
            "source_file": [s.source_file for _, s in kept],
            "source_line": [s.source_line for _, s in kept],
            "source_index": [s.source_index for _, s in kept],
            "messages": [s.messages for _, s in kept],
            "tools": [s.tools for _, s in kept],
        },
        schema=INSTRUCTION_SCHEMA,
    )
    stats = SplitStats(
        records,
        records - n,
        n_train,
        n_heldout,
        train_available,
        per_file,
        dict(sorted(turns.items())),
        dict(sorted(fields.items())),
    )
    return frame, stats


def source_fingerprint(dataset: str, raw_dir: Path) -> str:
    """sha256 over the dataset's files (relative path and content, in sorted order): changes
    exactly when the source content changes, not when files are merely touched.

    For ``python_stdlib`` it is the interpreter's version and stdlib path.
    """
    h = hashlib.sha256()
    if dataset == STDLIB_DATASET:
        import sys

        h.update(f"{sys.version}|{sys.prefix}".encode())
        return h.hexdigest()[:16]
    folder = raw_dir / dataset
    fields = folder / FIELDS_CONFIG_NAME
    for p in [*data_files(folder), *([fields] if fields.exists() else [])]:
        h.update(f"{p.relative_to(folder)}\0".encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


# Columns added after the first tables were written, with their types; older versions read
# them as null (single exchanges, no tools, no record index).
_LATER_COLUMNS = {"messages": pl.String, "tools": pl.String, "source_index": pl.Int64}


def read_instructions(uri: str, version: int, columns: list[str]) -> pl.DataFrame:
    """``columns`` of a ``raw_instructions`` table version. Versions written before the
    ``messages``, ``tools`` or ``source_index`` column existed read it as null."""
    scan = pl.scan_delta(uri, version=version)
    have = set(scan.collect_schema().names())
    missing = [c for c in _LATER_COLUMNS if c in columns and c not in have]
    return (
        scan.with_columns([pl.lit(None, dtype=_LATER_COLUMNS[c]).alias(c) for c in missing])
        .select(columns)
        .collect()
    )


# What a sample is rendered from (tokenization.encode_rows).
TRAINING_COLUMNS = ["sample_id", "system", "prompt", "response", "messages", "tools"]
# ... plus where it came from, so an error rendering it names its source file and line.
EMBEDDING_COLUMNS = [*TRAINING_COLUMNS, "source_file", "source_line"]


def read_train_split(uri: str, version: int) -> pl.DataFrame:
    """The training split of a raw_instructions version, in table order: the columns a sample
    is rendered from and its source file and line (named when it cannot be rendered)."""
    frame = read_instructions(uri, version, ["split", *EMBEDDING_COLUMNS])
    return frame.filter(pl.col("split") == "train").drop("split")


def samples_fingerprint(uri: str, version: int, sample_ids: set[str]) -> str:
    """A content hash of the samples ``sample_ids`` (sorted, every column training reads) in a
    ``raw_instructions`` table version: equal across table versions that hold the same samples,
    so a re-materialized table with unchanged data keys the same checkpoint."""
    from cluster_pipeline.storage.cache import stable_hash

    rows = (
        read_instructions(uri, version, TRAINING_COLUMNS)
        .filter(pl.col("sample_id").is_in(sorted(sample_ids)))
        .sort("sample_id")
    )
    # A sample without tools hashes as it did before the tools column existed.
    return stable_hash([row[:-1] if row[-1] is None else row for row in rows.rows()])


@dataclass(frozen=True)
class SourceLicense:
    """The license a dataset's source declares, in the terms of a Hugging Face dataset card's
    YAML header: ``license`` (a Hub license id, ``other``, or a list), and for ``other`` the
    ``license_name`` (an id) and ``license_link`` (a URL, or the name of a file shipped with the
    data). ``file``: a file of the dataset folder to ship beside the data (None: nothing to
    ship); ``declared_by``: where the declaration was found, for the card's text."""

    license: str | list[str]
    license_name: str | None
    license_link: str | None
    file: Path | None
    declared_by: str


# CPython's standard library is under the PSF License Agreement, which is not among the Hub's
# license ids.
STDLIB_LICENSE = SourceLicense(
    license="other",
    license_name="psf-2.0",
    license_link="https://docs.python.org/3/license.html",
    file=None,
    declared_by="the built-in dataset: functions of CPython's standard library",
)


def _front_matter(card: Path) -> tuple[dict, dict[str, int]]:
    """The YAML front matter of a Markdown file (between a first line ``---`` and the next line
    ``---``), or ``{}`` when it has none, and the file's 1-based line of each top-level key.

    Raises:
        ValueError: the front matter is never closed, is not YAML, or is not a mapping (names
            the file and, for YAML errors, the line of the file).
    """
    lines = card.read_text(encoding="utf-8-sig").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}, {}
    end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
    if end is None:
        raise ValueError(
            f"{card}: the YAML front matter opened by '---' on line 1 is never closed; end it "
            "with a line '---'"
        )
    import yaml

    text = "\n".join(lines[1:end])
    try:
        meta = yaml.safe_load(text)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        # The parser counts from the front matter's first line; the file has '---' above it.
        for mark in (getattr(e, "context_mark", None), getattr(e, "problem_mark", None)):
            if mark is not None:
                mark.line += 1
                mark.name = str(card)
        raise ValueError(f"{card}: the YAML front matter is not valid YAML: {e}") from None
    if meta is None:
        return {}, {}
    if not isinstance(meta, dict):
        raise ValueError(
            f"{card}: the YAML front matter must be a mapping (key: value lines), got a "
            f"{type(meta).__name__}"
        )
    where = {}
    if isinstance(node, yaml.MappingNode):
        for key, _ in node.value:
            where.setdefault(str(key.value), key.start_mark.line + 2)
    return meta, where


def check_license(
    value: object, name: object, link: object, card: Path, line: int
) -> str | list[str]:
    """A card's ``license`` as the Hub accepts it: one of its ids
    (:data:`~cluster_pipeline.data.licenses.HUB_LICENSES`) or a non-empty list of them, and for
    ``other`` a ``license_name`` and a ``license_link`` (the Hub asks for both).

    Args:
        value: the front matter's ``license``.
        name: its ``license_name`` (None if absent).
        link: its ``license_link`` (None if absent).
        card: the card, for the message.
        line: the file's 1-based line of the ``license:`` key, for the message.

    Returns:
        ``value``, checked.

    Raises:
        ValueError: anything else; names the file and line and the accepted forms.
    """
    from cluster_pipeline.data.licenses import HUB_LICENSES

    at = f"{card}, line {line}"
    forms = (
        "write a Hub license id (e.g. mit, apache-2.0, cc-by-4.0; the Hub's list is in "
        "cluster_pipeline/data/licenses.py), a list of them, or `license: other` with "
        "`license_name:` (an id of your own, e.g. acme-1.0) and `license_link:` (a URL, or a "
        "file of the dataset folder such as LICENSE)"
    )
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(v, str) for v in ids):
        raise ValueError(f"{at}: 'license' must be a Hub license id, got {value!r}; {forms}")
    unknown = [v for v in ids if v not in HUB_LICENSES]
    if unknown:
        close = [h for v in unknown for h in HUB_LICENSES if h == str(v).strip().lower()]
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"{at}: license {unknown[0]!r} is not a license id the Hub accepts{hint}; {forms}"
        )
    if "other" in ids:
        lacking = [
            key
            for key, v in (("license_name", name), ("license_link", link))
            if not isinstance(v, str) or not v.strip()
        ]
        if lacking:
            raise ValueError(
                f"{at}: `license: other` needs {' and '.join(lacking)} beside it (the Hub "
                f"refuses it without them); {forms}"
            )
    return value  # type: ignore[return-value]  # checked: str or list[str]


def source_license(dataset: str, raw_dir: Path) -> SourceLicense | None:
    """The license the dataset's source declares, or None where it declares none.

    The rule (docs/design.md, "Reading datasets"), first match wins:

    1. ``raw_dir/<dataset>/README.md`` whose YAML front matter has ``license:``, a Hub license
       id (``mit``, ``cc-by-4.0``, ``other``) or a list of them (:func:`check_license`): that
       value, with the front matter's ``license_name`` and ``license_link``.
    2. A license file ``LICENSE``, ``LICENSE.md`` or ``LICENSE.txt`` in the folder: ``license:
       other``, ``license_name: <dataset>-license`` (lower case, ASCII), ``license_link`` the
       file.
    3. The built-in ``python_stdlib``: :data:`STDLIB_LICENSE`.

    The file to ship beside the data (many licenses ask that their text travel with the data):
    the file of the folder that ``license_link`` names, else the folder's license file, if any.

    Neither file is ever read as samples or counted as a file not read
    (:func:`~cluster_pipeline.data.formats.ignored_files`).

    Raises:
        ValueError: the card's front matter is malformed, or its ``license`` is not one the
            Hub accepts (:func:`check_license`); names the file and line.
    """
    if dataset == STDLIB_DATASET:
        return STDLIB_LICENSE
    folder = raw_dir / dataset
    card = folder / CARD_NAME
    meta, lines = _front_matter(card) if card.is_file() else ({}, {})
    license_file = next((folder / n for n in LICENSE_NAMES if (folder / n).is_file()), None)
    if meta.get("license") is not None:
        name, link = meta.get("license_name"), meta.get("license_link")
        value = check_license(meta["license"], name, link, card, lines.get("license", 2))
        linked = folder / str(link) if link else None
        if (
            linked is not None
            and linked.is_file()
            and linked.resolve().is_relative_to(folder.resolve())
        ):
            license_file = linked
        return SourceLicense(
            license=value,
            license_name=None if name is None else str(name),
            license_link=None if link is None else str(link),
            file=license_file,
            declared_by=f"the front matter of {card}",
        )
    if license_file is not None:
        slug = re.sub(r"[^a-z0-9]+", "-", storage_name(dataset).lower()).strip("-")
        return SourceLicense(
            license="other",
            license_name=f"{slug or 'dataset'}-license",
            license_link=license_file.name,
            file=license_file,
            declared_by=f"the license file {license_file}",
        )
    return None
