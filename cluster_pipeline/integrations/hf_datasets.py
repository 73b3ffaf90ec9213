"""The selected subset as a Hugging Face ``datasets`` dataset (``cluster-pipeline export``).

An export is one folder (default ``data/exports/<dataset>/``, :meth:`DataLayout.exports_dir`)::

    README.md                               the dataset card: the Hub's YAML header (configs,
                                            splits and row counts, features, license, task,
                                            size, language) and the selection's provenance
                                            (:mod:`~cluster_pipeline.integrations.
                                            dataset_card` builds it)
    data/<split>/<split>-00000-of-00001.parquet
                                            the Parquet files, one folder per split: a tool
                                            pointed at a folder reads that split alone
    data/dataset_info.json                  LLaMA-Factory's dataset registry for data/
                                            (:func:`llama_factory_info`)
    dataset_dict/                           ``DatasetDict.save_to_disk`` (``load_from_disk``)
    LICENSE                                 the source's license file, where it has one
    export.json                             the marker: ``"exporter": "cluster-pipeline export"``,
                                            what was exported (dataset, manifests, table versions,
                                            the card's facts) and every file above with its
                                            SHA-256

Splits: ``rank_<c>``, rank c's shard in manifest order (the order rank c trains in), and
``train``, every shard entry, rank by rank: the subset as trained, a sample selected with copies
(``uniform``) once per copy. A row is one shard entry (:data:`FEATURES`): the ``sample_id``, its
``rank``, ``position`` and the rank's loss ``weight`` w_c, its ``cluster``, the sample (``system``,
``prompt``, ``response`` as the ``raw_instructions`` table stores them, ``messages`` the whole
conversation as a list of ``{role, content}``, ``tools`` the function schemas as a list and
``tools_json`` as text, ``form``), its ``source_file`` (relative to the dataset's folder),
``source_line`` and ``source_index``, and the manifest's ``manifest_sha256``; ``system`` is
null where the sample has no system prompt. Everything is read at the table versions the
manifests were built from. ``dataset_dict/`` and ``data/`` hold the same rows; ``export.json``'s
hashes pin both, and :func:`verify_export` (what ``ClusterShards.from_export`` calls before it
reads ``dataset_dict/``) refuses a folder where either changed. The saved splits' ``info``
carries the card's description, the method's citation and the license.

A folder is an export only if its ``export.json`` carries this exporter's marker and lists the
files it wrote (:func:`read_export_record`). Nothing else is ever deleted: a destination holding
any other file, or a listed file changed since, is refused (:func:`check_destination`), with
or without ``overwrite``. The new export is written to a fresh folder beside the destination and
swapped in with one ``renameat2(RENAME_EXCHANGE)`` (two renames where the file system lacks it);
only then are the files the earlier export listed deleted, so an export that fails leaves the
earlier one byte for byte as it was. An export of an earlier format (2: ``messages`` as JSON
text, every split's Parquet files in ``data/``) is replaced like any other, but not read:
export again.

This module is the export's file handling; what an export is made of (:class:`ExportSource`,
:data:`FEATURES`, the folder's names) is :mod:`~cluster_pipeline.integrations.export_spec`'s,
imported from here as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from cluster_pipeline.data.datasets import (
    STDLIB_DATASET,
    SourceLicense,
    read_instructions,
    source_license,
)
from cluster_pipeline.data.stdlib_dataset import stdlib_root
from cluster_pipeline.integrations import dataset_card
from cluster_pipeline.integrations.dataset_card import SplitFiles
from cluster_pipeline.integrations.export_spec import (
    CARD,
    DATA_DIR,
    DATASET_DICT,
    FEATURES,
    LLAMA_FACTORY_INFO,
    ExportSource,
    hf_features,
    split_dir,
)
from cluster_pipeline.selection.sharding import (
    ManifestMismatch,
    ShardManifest,
    manifests_frame,
    read_recorded_manifests,
)
from cluster_pipeline.storage import atomic
from cluster_pipeline.storage.disk import (
    DiskFull,
    format_bytes,
    free_bytes,
    is_disk_full,
    require_space,
)
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, RAW_INSTRUCTIONS
from cluster_pipeline.storage.provenance import code_identity, portable, rows_sha256

_SAMPLE_COLUMNS = [
    "sample_id",
    "system",
    "prompt",
    "response",
    "messages",
    "tools",
    "form",
    "source_file",
    "source_line",
    "source_index",
]
_POLARS = {
    "string": pl.String,
    "int64": pl.Int64,
    "float64": pl.Float64,
    "messages": pl.List(pl.Struct({"role": pl.String, "content": pl.String})),
    # Each schema as JSON text; datasets stores them as its Json feature (hf_features).
    "json_list": pl.List(pl.String),
}
IDENTITY = "export.json"
# The marker that makes a folder an export: export.json's "exporter", and the version of its
# layout ("format"; 2 lists every file with its SHA-256; 3: a folder per split under data/,
# messages and tools as lists, LLaMA-Factory's dataset_info.json, the card's facts).
EXPORTER = "cluster-pipeline export"
EXPORT_FORMAT = 3
# Earlier formats of this exporter: replaced like the current one, never read.
_REPLACEABLE_FORMATS = (2, EXPORT_FORMAT)
# The Hub's default Parquet shard size (datasets.config.MAX_SHARD_SIZE, "500MB").
MAX_SHARD_BYTES = 500_000_000
# How many paths a refusal names before it counts the rest.
_NAMED = 5


class ExportError(ValueError):
    """An export that cannot be made or read as asked (a destination holding something else,
    manifests gone or edited, tables out of step, an export folder damaged): the message names
    the file and says what to do."""


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_selection` wrote: the folder, rows per split (``train`` first, then
    the ranks), the Parquet files (relative to the folder), the license it carried (None: none
    declared), whether it replaced an earlier export, and where files that appeared in the
    earlier export while the new one was written were left (None: nothing was)."""

    out: Path
    rows: dict[str, int]
    parquet_files: list[str]
    license: SourceLicense | None
    replaced: bool = False
    left_behind: Path | None = None


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ExportError(
            "exporting needs the `datasets` package (pinned in requirements.lock; `make setup` "
            "installs it): pip install 'datasets>=3'"
        ) from None
    return datasets


def read_manifests(source: ExportSource) -> list[ShardManifest]:
    """The recorded shard manifests, each checked against its content hash and the hash the
    record names (:func:`~cluster_pipeline.selection.sharding.read_recorded_manifests`, as
    training's pre-flight checks them).

    Raises:
        ExportError: a manifest file is gone, edited, or not the one recorded for its rank.
    """
    try:
        return read_recorded_manifests(
            source.manifest_paths, source.manifest_sha256, source.dataset
        )
    except ManifestMismatch as e:
        raise ExportError(str(e)) from None


def source_folder(dataset: str, raw_dir: Path) -> Path:
    """The folder the export's ``source_file`` paths are relative to: the dataset's folder
    under ``raw_dir``, the standard library's folder for the built-in ``python_stdlib``."""
    return stdlib_root() if dataset == STDLIB_DATASET else raw_dir / dataset


def _relative_to(column: str, folder: Path) -> pl.Expr:
    """``column`` (paths) relative to ``folder`` (given or resolved) where it lies inside it;
    other paths as they are."""
    expr = pl.col(column)
    for base in dict.fromkeys((str(folder), str(folder.resolve()))):
        prefix = f"{base.rstrip('/')}/"
        expr = (
            pl.when(expr.str.starts_with(prefix))
            .then(expr.str.strip_prefix(prefix))
            .otherwise(expr)
        )
    return expr.alias(column)


def _messages() -> pl.Expr:
    """The conversation as a list of {role, content} (:func:`~cluster_pipeline.data.formats.
    conversation`, in polars): the stored ``messages`` JSON where there is one, else the
    system message (if any), the user's ``prompt`` (if any) and the assistant's
    ``response``."""
    dtype = _POLARS["messages"]

    def turn(role: str, content: pl.Expr) -> pl.Expr:
        return pl.struct(pl.lit(role).alias("role"), content.alias("content"))

    system = pl.when(pl.col("system") != "").then(pl.col("system"))
    prompt = pl.when(pl.col("prompt") != "").then(pl.col("prompt"))
    single = pl.concat_list(
        turn("system", system), turn("user", prompt), turn("assistant", pl.col("response"))
    ).list.eval(pl.element().filter(pl.element().struct.field("content").is_not_null()))
    stored = pl.col("messages").str.json_decode(dtype)
    return pl.when(pl.col("messages").is_not_null()).then(stored).otherwise(single).cast(dtype)


def _sample_columns(rows: pl.DataFrame, folder: Path | None) -> pl.DataFrame:
    """``messages`` (the conversation as a list of {role, content}), ``tools`` (each schema
    as JSON text), ``tools_json`` and ``source_file`` (relative to ``folder``; as stored where
    ``folder`` is None) from the stored columns (``system`` still ``""`` for none)."""
    tools = [
        None if t is None else [json.dumps(x, ensure_ascii=False) for x in json.loads(t)]
        for t in rows["tools"]
    ]
    out = rows.with_columns(
        _messages().alias("messages"),
        pl.Series("tools", tools, dtype=_POLARS["json_list"]),
        pl.col("tools").alias("tools_json"),
    )
    return out if folder is None else out.with_columns(_relative_to("source_file", folder))


def selection_rows(
    source: ExportSource, manifests: list[ShardManifest], folder: Path | None = None
) -> pl.DataFrame:
    """Every shard entry as an export row (:data:`FEATURES`), ordered by rank then position;
    ``source_file`` relative to ``folder`` (:func:`source_folder`; None: as stored).

    Raises:
        ExportError: a sample of a shard is missing from the pinned ``raw_instructions`` or
            ``balanced_clusters`` version (the tables and manifests are out of step).
    """
    shards = manifests_frame(manifests)
    ids = shards["sample_id"].unique()
    raw = source.tables[RAW_INSTRUCTIONS]
    samples = read_instructions(raw.uri, raw.version, _SAMPLE_COLUMNS).filter(
        pl.col("sample_id").is_in(ids.implode())
    )
    clusters_table = source.tables[BALANCED_CLUSTERS]
    clusters = clusters_table.read(["sample_id", "cluster"]).filter(
        pl.col("sample_id").is_in(ids.implode())
    )
    for name, ref, frame in (
        (RAW_INSTRUCTIONS, raw, samples),
        (BALANCED_CLUSTERS, clusters_table, clusters),
    ):
        missing = ids.filter(~ids.is_in(frame["sample_id"].implode()))
        if len(missing):
            raise ExportError(
                f"{len(missing)} sample(s) of the shard manifests (e.g. {missing[0]!r}) are not "
                f"in {name} {ref.uri} v{ref.version}; materialize the selection chain again"
            )
    rows = (
        shards.join(samples, on="sample_id", how="left")
        .join(clusters, on="sample_id", how="left")
        .sort("rank", "position")
    )
    # raw_instructions stores "" for "no system prompt"; the export says null (FEATURES).
    rows = _sample_columns(rows, folder).with_columns(
        pl.when(pl.col("system") != "").then(pl.col("system")).alias("system")
    )
    return rows.select([pl.col(name).cast(_POLARS[dtype]) for name, (dtype, _) in FEATURES.items()])


def split_rows(rows: pl.DataFrame, world_size: int) -> dict[str, pl.DataFrame]:
    """``train`` (every row) and ``rank_<c>`` (rank c's rows, in position order) for c < K."""
    out = {"train": rows}
    for c in range(world_size):
        out[f"rank_{c}"] = rows.filter(pl.col("rank") == c)
    return out


def export_identity(source: ExportSource) -> dict[str, Any]:
    """What names an export (``export.json``, beside the marker and the file list): two exports
    are the same when dataset and manifest set are."""
    return {
        "dataset": source.dataset,
        "manifest_set_sha256": source.manifest_set_sha256,
        "manifest_sha256": source.manifest_sha256,
        "tables": {s: {"uri": t.uri, "version": t.version} for s, t in source.tables.items()},
    }


@dataclass(frozen=True)
class ExportRecord:
    """An export folder's ``export.json``, checked: the marker was this exporter's.

    ``files``: every file the export wrote (path relative to the folder, ``/``-separated) ->
    its SHA-256 (hex), ``export.json`` itself excepted; ``splits``: rows per split;
    ``format``: the layout's version (:data:`EXPORT_FORMAT`, or an earlier one being
    replaced); ``selection``: the card's facts (:func:`~cluster_pipeline.integrations.
    dataset_card.card_fields`; empty in an earlier format).
    """

    path: Path
    dataset: str
    manifest_set_sha256: str
    manifest_sha256: list[str]
    splits: dict[str, int]
    files: dict[str, str]
    format: int = EXPORT_FORMAT
    selection: dict[str, Any] = field(default_factory=dict)


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes (``hashlib.file_digest``, streamed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _safe_relative(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def read_export_record(folder: Path, formats: tuple[int, ...] = (EXPORT_FORMAT,)) -> ExportRecord:
    """The checked ``export.json`` of ``folder``.

    An ``export.json`` is this exporter's when it is a JSON object with ``"exporter":``
    :data:`EXPORTER`, a ``"format"`` among ``formats`` (default: the current
    :data:`EXPORT_FORMAT`, what can be read) and well-typed ``dataset``,
    ``manifest_set_sha256``, ``manifest_sha256`` (list), ``splits`` (name -> rows) and ``files``
    (relative path -> SHA-256, none leaving the folder).

    Raises:
        ExportError: the file is missing, not JSON (names line and column), not this exporter's
            (another tool's, or an export of an older cluster-pipeline without a file list), of
            another format (an earlier one: export again), or lacks a key; the message names
            the file and the key.
    """
    path = folder / IDENTITY
    if not path.is_file():
        raise ExportError(f"{folder} holds no {IDENTITY}, so it is not an export")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ExportError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ExportError(
            f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(data, dict) or data.get("exporter") != EXPORTER:
        raise ExportError(f'{path} has no "exporter": "{EXPORTER}", so it is not an export')
    if data.get("format") not in formats:
        earlier = (
            " (written by an earlier cluster-pipeline: messages as JSON text, every split's "
            "Parquet files in one folder); export it again"
            if data.get("format") in _REPLACEABLE_FORMATS
            else ""
        )
        raise ExportError(
            f"{path} is format {data.get('format')!r}, not {EXPORT_FORMAT} (the one this "
            f"cluster-pipeline writes and reads){earlier}"
        )
    checks = {
        "dataset": lambda v: isinstance(v, str),
        "manifest_set_sha256": lambda v: isinstance(v, str),
        "manifest_sha256": lambda v: _is_str_list(v) and len(v) > 0,
        "splits": lambda v: (
            isinstance(v, dict)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in v.values())
        ),
        "files": lambda v: (
            isinstance(v, dict)
            and all(_safe_relative(k) and isinstance(h, str) for k, h in v.items())
        ),
    }
    for key, ok in checks.items():
        if key not in data:
            raise ExportError(f'{path} lacks the key "{key}"')
        if not ok(data[key]):
            raise ExportError(f'{path}: "{key}" is malformed ({str(data[key])[:80]})')
    return ExportRecord(
        path=path,
        dataset=data["dataset"],
        manifest_set_sha256=data["manifest_set_sha256"],
        manifest_sha256=list(data["manifest_sha256"]),
        splits=dict(data["splits"]),
        files=dict(data["files"]),
        format=int(data["format"]),
        selection=dict(data.get("selection") or {}),
    )


def _entries(folder: Path) -> tuple[set[str], set[str]]:
    """Everything under ``folder``, symlinks not followed: (files: regular files, symlinks and
    anything else that is not a folder; folders), as ``/``-separated relative paths."""
    files: set[str] = set()
    dirs: set[str] = set()
    stack = [("", folder)]
    while stack:
        prefix, here = stack.pop()
        with os.scandir(here) as it:
            for entry in it:
                rel = f"{prefix}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    dirs.add(rel)
                    stack.append((f"{rel}/", Path(entry.path)))
                else:
                    files.add(rel)
    return files, dirs


def _listed_and_unchanged(folder: Path, record: ExportRecord) -> tuple[list[str], list[str]]:
    """(listed files that are gone, listed files that are not the regular file with the bytes
    the export wrote)."""
    gone, changed = [], []
    for rel, sha in record.files.items():
        path = folder / rel
        if not path.exists() and not path.is_symlink():
            gone.append(rel)
        elif path.is_symlink() or not path.is_file() or file_sha256(path) != sha:
            changed.append(rel)
    return gone, changed


def _some(paths: list[str]) -> str:
    named = ", ".join(sorted(paths)[:_NAMED])
    more = len(paths) - _NAMED
    return f"{named} and {more} more" if more > 0 else named


def foreign_paths(folder: Path, record: ExportRecord) -> list[str]:
    """What in ``folder`` the export did not write, or changed since: files and symlinks it
    does not list, listed files whose bytes differ or that became a symlink or folder, and
    folders that hold no listed file (a folder is named once, with a trailing ``/``, not its
    contents). ``export.json`` is the export's."""
    files, dirs = _entries(folder)
    _, changed = _listed_and_unchanged(folder, record)
    ours = {IDENTITY} | (set(record.files) - set(changed))
    # A folder of a listed file is the export's, whether that file changed or not.
    listed = set(record.files)
    ours_dirs = {"/".join(p.split("/")[:i]) for p in listed for i in range(1, p.count("/") + 1)}
    foreign_dirs = sorted(d for d in dirs if d not in ours_dirs)
    tops = [d for d in foreign_dirs if not any(d.startswith(f"{o}/") for o in foreign_dirs)]

    def inside(p: str) -> bool:
        return any(p.startswith(f"{d}/") for d in tops)

    return sorted(
        [f"{d}/" for d in tops]
        + [f for f in files if f not in ours and not inside(f)]
        + [c for c in changed if (folder / c).is_dir() and not inside(c) and f"{c}/" not in tops]
    )


def check_destination(out: Path, source: ExportSource, overwrite: bool) -> ExportRecord | None:
    """Whether ``out`` may receive this export; the earlier export's record if it holds one
    (it is replaced), None if ``out`` is missing or empty.

    ``out`` may be written when it is missing or empty, or when it is an export
    (:func:`read_export_record`) holding only the files it lists: unchanged and of the same
    dataset and manifest set, or, with ``overwrite``, of others or with some of its own files
    changed since (they are replaced). A path the export did not write is refused with or
    without ``overwrite``, naming a few of them and what to do.

    Raises:
        ExportError: ``out`` is a file, a folder that is not an export, an export holding files
            it did not write, or (without ``overwrite``) a different export or one whose own
            files changed since it wrote them.
    """
    if not out.exists():
        return None
    if not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder with --out")
    if not any(out.iterdir()):
        return None
    try:
        record = read_export_record(out, _REPLACEABLE_FORMATS)
    except ExportError as e:
        tops = [
            f"{p.name}/" if p.is_dir() and not p.is_symlink() else p.name for p in out.iterdir()
        ]
        raise ExportError(
            f"{e}; --out {out} is not empty, and what it holds ({_some(tops)}) is not this "
            f"command's to replace, with or without --overwrite: move those out of {out}, or "
            "choose a new or empty folder with --out"
        ) from None
    # The export's own files whose bytes changed (still regular files) are its to replace,
    # with --overwrite; anything else it did not write is never touched.
    _, changed = _listed_and_unchanged(out, record)
    edited = [c for c in changed if (out / c).is_file() and not (out / c).is_symlink()]
    foreign = [p for p in foreign_paths(out, record) if p not in edited]
    if foreign:
        raise ExportError(
            f"--out {out} holds an export, and besides it {len(foreign)} path(s) the export did "
            f"not write: {_some(foreign)}. Nothing but the export's own files is replaced, with "
            f"or without --overwrite: move those out of {out} (or delete them), or choose "
            "another folder with --out"
        )
    if edited and not overwrite:
        raise ExportError(
            f"--out {out} holds an export, {len(edited)} of whose own files changed since it "
            f"wrote them: {_some(edited)}. Pass --overwrite to replace them with a fresh export "
            "(nothing else in the folder is touched), or copy them elsewhere first"
        )
    same = (record.dataset, record.manifest_set_sha256) == (
        source.dataset,
        source.manifest_set_sha256,
    )
    if not same and not overwrite:
        raise ExportError(
            f"{out} holds another export (dataset {record.dataset!r}, manifest set "
            f"{record.manifest_set_sha256[:12]}), not dataset {source.dataset!r} manifest set "
            f"{source.manifest_set_sha256[:12]}; pass --overwrite to replace it, or --out "
            "another folder"
        )
    return record


def verify_export(folder: str | Path) -> ExportRecord:
    """The record of the export in ``folder``, after checking that every file it lists is
    there with the bytes the export wrote (``dataset_dict/`` and the Parquet files alike, so
    the two cannot drift apart unnoticed).

    Raises:
        ExportError: ``folder`` is not an export (:func:`read_export_record`), or a listed file
            is gone or changed; the message names the files and says to export again.
    """
    folder = Path(folder)
    try:
        record = read_export_record(folder, _REPLACEABLE_FORMATS)
    except ExportError as e:
        # Without a readable record the folder is not provably an export, so the advice never
        # says to delete it (it may hold the user's files; export refuses to write there too).
        raise ExportError(
            f"{e}: give the folder an export wrote, or export to a new folder: "
            "`cluster-pipeline export <dataset> --out <new folder>`"
        ) from None
    again = ["cluster-pipeline", "export", record.dataset, "--out", str(folder), "--overwrite"]
    redo = f"export it again: `{shlex.join(again)}`"
    if record.format != EXPORT_FORMAT:
        raise ExportError(
            f"{record.path} is format {record.format}, written by an earlier cluster-pipeline "
            f"(messages as JSON text, every split's Parquet files in one folder), which this "
            f"one does not read; {redo}"
        )
    gone, changed = _listed_and_unchanged(folder, record)
    if gone:
        # A folder gone whole is named as the folder (its highest missing one), not file by file.
        named: list[str] = []
        for g in gone:
            parts = g.split("/")
            i = next(
                i for i in range(1, len(parts) + 1) if not (folder / "/".join(parts[:i])).exists()
            )
            name = "/".join(parts[:i]) + ("/" if i < len(parts) else "")
            if name not in named:
                named.append(name)
        raise ExportError(
            f"{folder}: {_some(named)}, listed in {record.path}, "
            f"{'is' if len(named) == 1 else 'are'} gone; the export is incomplete: {redo}"
        )
    if changed:
        raise ExportError(
            f"{folder}: {len(changed)} file(s) changed since the export wrote them "
            f"({_some(changed)}: their SHA-256 is not the one {record.path} records); {redo}"
        )
    return record


@contextlib.contextmanager
def _no_progress_bars(datasets: Any) -> Iterator[None]:
    """``datasets``' progress bars off for the block (a command prints one line of its own,
    which they would bury), restored after."""
    were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_off:
            datasets.enable_progress_bars()


def _write_splits(
    frames: dict[str, pl.DataFrame], tmp: Path, info_fields: dict[str, str]
) -> dict[str, SplitFiles]:
    """The ``save_to_disk`` folder (each split's ``DatasetInfo`` with ``info_fields``:
    description, citation, license) and the Parquet files, a folder per split (the Hub's shard
    size); returns per split its rows, bytes and Parquet files (paths relative to ``tmp``)."""
    datasets = _datasets()
    features = hf_features(datasets)
    info: dict[str, SplitFiles] = {}
    with _no_progress_bars(datasets):
        splits = {
            name: datasets.Dataset.from_polars(
                frame,
                info=datasets.DatasetInfo(
                    description=info_fields["description"],
                    citation=info_fields["citation"],
                    license=info_fields["license"],
                    features=features.copy(),
                ),
            )
            for name, frame in frames.items()
        }
        datasets.DatasetDict(list(splits.items())).save_to_disk(str(tmp / DATASET_DICT))
        for name, ds in splits.items():
            folder = split_dir(name)
            (tmp / folder).mkdir(parents=True)
            nbytes = int(ds.data.nbytes)
            n = max(1, -(-nbytes // MAX_SHARD_BYTES))
            names = []
            for i in range(n):
                rel = f"{folder}/{name}-{i:05d}-of-{n:05d}.parquet"
                ds.shard(num_shards=n, index=i, contiguous=True).to_parquet(str(tmp / rel))
                names.append(rel)
            info[name] = SplitFiles(rows=len(ds), num_bytes=nbytes, files=names)
    return info


def llama_factory_info(dataset: str) -> dict[str, Any]:
    """LLaMA-Factory's ``dataset_info.json`` for the export's ``data/`` folder (its
    ``dataset_dir``): the ``train`` split (``file_name: train``, the folder of its Parquet
    files) as ``<dataset>`` in the sharegpt form (``messages``, roles as written; a leading
    system message is the system prompt) and as ``<dataset>_alpaca`` in the alpaca form
    (``prompt``, ``response``, ``system``); ``tools_json`` as ``tools`` in both. The field
    names are LLaMA-Factory's (src/llamafactory/data/parser.py ``DatasetAttr``, data/README.md).
    """
    tools = {"tools": "tools_json"}
    return {
        dataset: {
            "file_name": "train",
            "formatting": "sharegpt",
            "columns": {"messages": "messages", **tools},
            "tags": {
                "role_tag": "role",
                "content_tag": "content",
                "user_tag": "user",
                "assistant_tag": "assistant",
                "observation_tag": "tool",
                "system_tag": "system",
            },
        },
        f"{dataset}_alpaca": {
            "file_name": "train",
            "formatting": "alpaca",
            "columns": {"prompt": "prompt", "response": "response", "system": "system", **tools},
        },
    }


# Per stage, the columns a table's content hash leaves out: the vectors (identified by the
# embedding pass's cache key, which the card's settings name; hashing them costs a pass over
# N x d floats).
_UNHASHED_KINDS = (pl.List, pl.Array)


def table_hashes(source: ExportSource) -> dict[str, str]:
    """Stage -> SHA-256 of its table version's rows (every column but vectors, sorted,
    :func:`~cluster_pipeline.storage.provenance.rows_sha256`): what names the version off this
    machine, where its URI means nothing."""
    out = {}
    for stage, ref in source.tables.items():
        schema = pl.scan_delta(ref.uri, version=ref.version).collect_schema()
        columns = [c for c, t in schema.items() if not isinstance(t, _UNHASHED_KINDS)]
        frame = pl.read_delta(ref.uri, version=ref.version, columns=columns)
        out[stage] = rows_sha256(frame, columns)
    return out


def _source_metadata(dataset: str, raw_dir: Path) -> dict[str, Any]:
    """The Hub keys (:data:`~cluster_pipeline.integrations.dataset_card.CARRIED_METADATA`)
    that the source folder's card declares in its front matter (``huggingface_hub.
    metadata_load``); the built-in dataset's own."""
    if dataset == STDLIB_DATASET:
        return dict(dataset_card.STDLIB_METADATA)
    card = raw_dir / dataset / CARD
    if not card.is_file():
        return {}
    from huggingface_hub import metadata_load

    meta = metadata_load(card) or {}
    return {k: meta[k] for k in dataset_card.CARRIED_METADATA if meta.get(k) is not None}


def _remove_listed(folder: Path, listed: list[str]) -> list[str]:
    """Delete the files ``listed`` (relative paths) in ``folder``, then the folders left empty,
    ``folder`` last; returns what stayed (anything not listed, e.g. a file that appeared while
    the export was written)."""
    for rel in listed:
        path = folder / rel
        if path.is_file() and not path.is_symlink():
            path.unlink()
    _, dirs = _entries(folder)
    for d in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
        with contextlib.suppress(OSError):
            (folder / d).rmdir()  # only if empty
    files, dirs = _entries(folder)
    if not files and not dirs:
        folder.rmdir()
        return []
    return sorted(files | dirs)


def _make_tmp(out: Path) -> Path:
    """A new, empty folder beside ``out`` (``.<name>.tmp-<random>``) to write the export in.

    Raises:
        ExportError: ``out``'s parent cannot be created or written; names ``--out``.
    """
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return atomic.temp_beside(out, folder=True)
    except OSError as e:
        why = e.strerror or str(e)
        raise ExportError(
            f"--out {out} cannot be created: its parent folder {out.parent} cannot be "
            f"{'created' if not out.parent.is_dir() else 'written'} ({why}); choose a folder "
            "you can write with --out"
        ) from None


def export_selection(
    source: ExportSource, out: Path, raw_dir: Path, overwrite: bool = False
) -> ExportSummary:
    """Write the export of ``source`` to ``out`` (module docstring).

    Args:
        source: the manifests and facts to export (the CLI reads them from the Dagster records).
        out: the export folder (a symlink to a folder: that folder); its parent is created.
        raw_dir: the data folder's ``raw/``, where the source's license is declared
            (:func:`~cluster_pipeline.data.datasets.source_license`).
        overwrite: replace an export of other manifests (never anything else: see
            :func:`check_destination`).

    Raises:
        ExportError: the destination may not be written (:func:`check_destination`) or
            created, the manifests are gone or edited, the tables lack their samples, the
            source folder's card declares its license in a malformed way, or writing failed
            (disk full); in every case ``out`` is left as it was.
    """
    out = Path(out).absolute()
    if out.is_symlink():
        out = out.resolve()  # write where the link points; the link stays
    earlier = check_destination(out, source, overwrite)
    manifests = read_manifests(source)
    try:
        license = source_license(source.dataset, raw_dir)
    except ValueError as e:
        raise ExportError(str(e)) from None
    # What is published names no folder of this machine: paths relative to the data folder.
    roots = {raw_dir.parent: "data", Path.home(): "~"}
    if license is not None:
        license = replace(license, declared_by=portable(license.declared_by, roots))
    frames = split_rows(
        selection_rows(source, manifests, source_folder(source.dataset, raw_dir)), len(manifests)
    )
    hashes = table_hashes(source)
    metadata = _source_metadata(source.dataset, raw_dir)
    what = f"export dataset {source.dataset!r} to --out {out}"
    needed = int(sum(f.estimated_size() for f in frames.values()))
    tmp = _make_tmp(out)  # first: an --out that cannot be created is named as such
    try:
        # Room for dataset_dict/ at least (Arrow, uncompressed: the rows' size), before writing.
        require_space(out.parent, needed, what)  # tmp lies beside out: the same disk
    except DiskFull as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(str(e)) from None
    try:
        splits = _write_splits(frames, tmp, dataset_card.dataset_info_fields(source, license))
        (tmp / LLAMA_FACTORY_INFO).write_text(
            json.dumps(llama_factory_info(source.dataset), indent=2) + "\n"
        )
        if license is not None and license.file is not None:
            shutil.copyfile(license.file, tmp / license.file.name)
        parquet_bytes = sum((tmp / f).stat().st_size for s in splits.values() for f in s.files)
        card = dataset_card.CardFacts(
            source,
            manifests,
            splits,
            license,
            parquet_bytes,
            table_hashes=hashes,
            manifest_files=[portable(p, roots) for p in source.manifest_paths],
            metadata=metadata,
            exporter=code_identity(),
        )
        (tmp / CARD).write_text(dataset_card.build_card(card), encoding="utf-8")
        written, _ = _entries(tmp)
        identity = {
            "exporter": EXPORTER,
            "format": EXPORT_FORMAT,
            **export_identity(source),
            "selection": dataset_card.card_fields(card),
            "splits": {n: s.rows for n, s in splits.items()},
            "files": {rel: file_sha256(tmp / rel) for rel in sorted(written)},
        }
        (tmp / IDENTITY).write_text(json.dumps(identity, indent=1) + "\n")
        # The destination again, just before the swap: a file put there meanwhile is refused.
        earlier = check_destination(out, source, overwrite)
        atomic.swap_in(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            room = (
                f"; the export needs at least {format_bytes(needed)} on the disk holding "
                f"{out.parent}, {format_bytes(free_bytes(out.parent))} are free there"
                if is_disk_full(e)
                else ""
            )
            raise ExportError(
                f"writing the export to --out {out} failed ({e}{room}); the folder is as it was. "
                "Free space or fix the cause, then export again, or choose another --out"
            ) from e
        raise
    left: list[str] = []
    if out.exists() and tmp.exists():  # the earlier folder, now at tmp
        listed = [IDENTITY, *earlier.files] if earlier is not None else []
        left = _remove_listed(tmp, listed)
    return ExportSummary(
        out=out,
        rows={n: s.rows for n, s in splits.items()},
        parquet_files=sorted(f for f in identity["files"] if f.startswith(f"{DATA_DIR}/")),
        license=license,
        replaced=earlier is not None,
        left_behind=tmp if left else None,
    )
