"""The selected subset as a Hugging Face ``datasets`` dataset (``cluster-pipeline export``).

An export is one folder (default ``data/exports/<dataset>/``, :meth:`DataLayout.exports_dir`)::

    README.md                               the dataset card: the Hub's YAML header (configs,
                                            splits and row counts, features, license) and the
                                            selection's provenance
    data/<split>-00000-of-00001.parquet     the Hub's Parquet layout: one config, a split each
    dataset_dict/                           ``DatasetDict.save_to_disk`` (``load_from_disk``)
    LICENSE                                 the source's license file, where it has one
    export.json                             the marker: ``"exporter": "cluster-pipeline export"``,
                                            what was exported (dataset, manifests, table versions)
                                            and every file above with its SHA-256

Splits: ``rank_<c>``, rank c's shard in manifest order (the order rank c trains in), and
``train``, every shard entry, rank by rank: the subset as trained, a sample selected with copies
(``uniform``) once per copy. A row is one shard entry (:data:`FEATURES`): the ``sample_id``, its
``rank``, ``position`` and the rank's loss ``weight`` w_c, its ``cluster``, the sample as the
``raw_instructions`` table stores it (``system``, ``prompt``, ``response``, ``messages`` and
``tools`` as JSON text, ``form``), its ``source_file``, ``source_line`` and ``source_index``,
and the manifest's ``manifest_sha256``; ``system`` is null where the sample has no system
prompt. Everything is
read at the table versions the manifests were built from. ``dataset_dict/`` and ``data/`` hold
the same rows; ``export.json``'s hashes pin both, and :func:`verify_export` (what
``ClusterShards.from_export`` calls before it reads ``dataset_dict/``) refuses a folder where
either changed.

A folder is an export only if its ``export.json`` carries this exporter's marker and lists the
files it wrote (:func:`read_export_record`). Nothing else is ever deleted: a destination holding
any other file, or a listed file changed since, is refused (:func:`check_destination`), with
or without ``overwrite``. The new export is written to a fresh folder beside the destination and
swapped in with one ``renameat2(RENAME_EXCHANGE)`` (two renames where the file system lacks it);
only then are the files the earlier export listed deleted, so an export that fails leaves the
earlier one byte for byte as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from cluster_pipeline.data.datasets import SourceLicense, read_instructions, source_license
from cluster_pipeline.selection.sharding import (
    ManifestMismatch,
    ShardManifest,
    manifests_frame,
    read_recorded_manifests,
)
from cluster_pipeline.storage.names import BALANCED_CLUSTERS, RAW_INSTRUCTIONS
from cluster_pipeline.storage.tables import TableRef, markdown_table

# One row of an export: name -> (dtype of datasets.Value, what it holds).
FEATURES: dict[str, tuple[str, str]] = {
    "sample_id": ("string", "content hash of the sample (raw_instructions)"),
    "rank": ("int64", "data-parallel rank whose shard holds the entry"),
    "position": ("int64", "0-based position in that rank's shard: the order it trains in"),
    "weight": ("float64", "the rank's loss weight w_c (docs/design.md, step 5)"),
    "cluster": ("int64", "the sample's balanced cluster (balanced_clusters)"),
    "system": ("string", "the system prompt; null where the sample has none"),
    "prompt": ("string", "the normalised prompt"),
    "response": ("string", "the normalised response"),
    "messages": ("string", "the kept conversation as JSON, or null for one exchange"),
    "tools": ("string", "function schemas as JSON, or null"),
    "form": ("string", "the input form the record was read in"),
    "source_file": ("string", "the file the record was read from"),
    "source_line": ("int64", "its line (record number for Parquet and Arrow)"),
    "source_index": ("int64", "0-based place among its file's records; null for python_stdlib"),
    "manifest_sha256": ("string", "content hash of the rank's shard manifest"),
}
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
_POLARS = {"string": pl.String, "int64": pl.Int64, "float64": pl.Float64}
DATASET_DICT = "dataset_dict"
DATA_DIR = "data"
CARD = "README.md"
IDENTITY = "export.json"
# The marker that makes a folder an export: export.json's "exporter", and the version of its
# layout ("format"; 2 lists every file with its SHA-256).
EXPORTER = "cluster-pipeline export"
EXPORT_FORMAT = 2
# The Hub's default Parquet shard size (datasets.config.MAX_SHARD_SIZE, "500MB").
MAX_SHARD_BYTES = 500_000_000
# How many paths a refusal names before it counts the rest.
_NAMED = 5


class ExportError(ValueError):
    """An export that cannot be made or read as asked (a destination holding something else,
    manifests gone or edited, tables out of step, an export folder damaged): the message names
    the file and says what to do."""


@dataclass(frozen=True)
class ExportSource:
    """What an export is made of: the shard manifests as recorded and the facts of the
    selection that made them, with every table at the version the manifests were built from.

    ``tables``: stage -> Delta table version, in pipeline order; must hold ``raw_instructions``
    and ``balanced_clusters`` (rows are read from them); the card lists them all.
    ``lineage_table``: the ``sample_lineage`` version built from these manifests, or None if
    none was. ``cluster_weights``: w_c per cluster; ``manifest_sha256`` and ``manifest_paths``
    per rank, in rank order.
    """

    dataset: str
    selector: str
    ratio: float
    selection_seed: int
    num_clusters: int
    alpha: float
    cluster_weights: list[float]
    balance: str
    token_budget: int | None
    pool_size: int
    selected_samples: int
    base_model: str
    manifest_paths: list[str]
    manifest_sha256: list[str]
    manifest_set_sha256: str
    dropped_for_equal_shards: int
    tables: dict[str, TableRef]
    lineage_table: TableRef | None = None


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


def selection_rows(source: ExportSource, manifests: list[ShardManifest]) -> pl.DataFrame:
    """Every shard entry as an export row (:data:`FEATURES`), ordered by rank then position.

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
        # raw_instructions stores "" for "no system prompt"; the export says null (FEATURES).
        .with_columns(pl.when(pl.col("system") != "").then(pl.col("system")).alias("system"))
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
    its SHA-256 (hex), ``export.json`` itself excepted; ``splits``: rows per split.
    """

    path: Path
    dataset: str
    manifest_set_sha256: str
    manifest_sha256: list[str]
    splits: dict[str, int]
    files: dict[str, str]


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes (``hashlib.file_digest``, streamed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _safe_relative(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def read_export_record(folder: Path) -> ExportRecord:
    """The checked ``export.json`` of ``folder``.

    An ``export.json`` is this exporter's when it is a JSON object with ``"exporter":``
    :data:`EXPORTER`, ``"format":`` :data:`EXPORT_FORMAT` and well-typed ``dataset``,
    ``manifest_set_sha256``, ``manifest_sha256`` (list), ``splits`` (name -> rows) and ``files``
    (relative path -> SHA-256, none leaving the folder).

    Raises:
        ExportError: the file is missing, not JSON (names line and column), not this exporter's
            (another tool's, or an export of an older cluster-pipeline without a file list), or
            lacks a key; the message names the file and the key.
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
    if data.get("format") != EXPORT_FORMAT:
        raise ExportError(
            f"{path} is format {data.get('format')!r}, not {EXPORT_FORMAT} (the one this "
            "cluster-pipeline writes and reads)"
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
    ours_dirs = {"/".join(p.split("/")[:i]) for p in ours for i in range(1, p.count("/") + 1)}
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
        record = read_export_record(out)
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
        record = read_export_record(folder)
    except ExportError as e:
        # Without a readable record the folder is not provably an export, so the advice never
        # says to delete it (it may hold the user's files; export refuses to write there too).
        raise ExportError(
            f"{e}: give the folder an export wrote, or export to a new folder: "
            "`cluster-pipeline export <dataset> --out <new folder>`"
        ) from None
    redo = f"export it again: `cluster-pipeline export <dataset> --out {folder} --overwrite`"
    gone, changed = _listed_and_unchanged(folder, record)
    redo = redo.replace("<dataset>", record.dataset)
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


def _write_splits(frames: dict[str, pl.DataFrame], tmp: Path) -> tuple[dict, list[str]]:
    """The ``save_to_disk`` folder and the Parquet files (the Hub's shard size); returns (per
    split: rows, bytes and Parquet files; every Parquet path), paths relative to ``tmp``."""
    datasets = _datasets()
    features = datasets.Features({n: datasets.Value(d) for n, (d, _) in FEATURES.items()})
    info: dict[str, dict[str, Any]] = {}
    files: list[str] = []
    with _no_progress_bars(datasets):
        splits = {
            name: datasets.Dataset.from_polars(frame, features=features)
            for name, frame in frames.items()
        }
        datasets.DatasetDict(list(splits.items())).save_to_disk(str(tmp / DATASET_DICT))
        (tmp / DATA_DIR).mkdir()
        for name, ds in splits.items():
            nbytes = int(ds.data.nbytes)
            n = max(1, -(-nbytes // MAX_SHARD_BYTES))
            names = []
            for i in range(n):
                rel = f"{DATA_DIR}/{name}-{i:05d}-of-{n:05d}.parquet"
                ds.shard(num_shards=n, index=i, contiguous=True).to_parquet(str(tmp / rel))
                names.append(rel)
            files += names
            info[name] = {"rows": len(ds), "num_bytes": nbytes, "files": names}
    return info, files


def card_header(
    source: ExportSource,
    splits: dict[str, dict[str, Any]],
    license: SourceLicense | None,
    tmp: Path,
) -> dict[str, Any]:
    """The card's YAML header, in the Hub's keys (``license``, ``configs`` with ``data_files``
    per split, ``dataset_info`` with features and splits' ``num_examples``)."""
    header: dict[str, Any] = {}
    if license is not None:
        header["license"] = license.license
        if license.license_name:
            header["license_name"] = license.license_name
        if license.license_link:
            header["license_link"] = license.license_link
    header["pretty_name"] = (
        f"{source.dataset}: {source.selector} selection, K = {source.num_clusters}"
    )
    header["tags"] = ["cluster-pipeline", "data-selection"]
    header["configs"] = [
        {
            "config_name": "default",
            "data_files": [{"split": name, "path": f"{DATA_DIR}/{name}-*"} for name in splits],
        }
    ]
    header["dataset_info"] = {
        "features": [{"name": n, "dtype": d} for n, (d, _) in FEATURES.items()],
        "splits": [
            {"name": name, "num_bytes": s["num_bytes"], "num_examples": s["rows"]}
            for name, s in splits.items()
        ],
        "download_size": sum((tmp / f).stat().st_size for s in splits.values() for f in s["files"]),
        "dataset_size": sum(s["num_bytes"] for s in splits.values()),
    }
    return header


def _weights(values: list[float]) -> str:
    return ", ".join(f"{w:.4f}" for w in values)


def card_body(
    source: ExportSource,
    manifests: list[ShardManifest],
    splits: dict[str, dict[str, Any]],
    license: SourceLicense | None,
) -> str:
    """The card's Markdown: the selection's knobs and facts, the splits, the columns, the table
    versions and manifest hashes it came from, how to load it, and the license."""
    d, k = source.dataset, source.num_clusters
    budget = f" (budget {source.token_budget:,} tokens per cluster)" if source.token_budget else ""
    facts = [
        ("selector", f"`{source.selector}`"),
        ("ratio r", f"{source.ratio:g}"),
        ("balance", f"{source.balance}{budget}"),
        ("K (clusters = data-parallel ranks)", str(source.num_clusters)),
        ("capacity alpha", f"{source.alpha:g}"),
        (
            "cluster weights w_c = K R_c / R (R_c: the cluster's response tokens)"
            if source.balance == "tokens"
            else "cluster weights w_c = n_c K / N",
            _weights(source.cluster_weights),
        ),
        ("rank weights (loss multipliers)", _weights([m.weight for m in manifests])),
        (
            "selected",
            f"{source.selected_samples:,} of a pool of {source.pool_size:,} training samples",
        ),
        ("base model (proxy embeddings)", f"`{source.base_model}`"),
        ("selection seed, shard order seed", f"{source.selection_seed}, {manifests[0].seed}"),
    ]
    if source.dropped_for_equal_shards:
        facts.append(("dropped to make shards equal", str(source.dropped_for_equal_shards)))
    known = any(m.tokens for m in manifests)

    def tokens(n: int) -> str:
        return f"{n:,}" if known else "-"

    split_rows_ = [
        (
            "train",
            f"{splits['train']['rows']:,}",
            tokens(sum(m.tokens for m in manifests)),
            "per row",
            f"set `{source.manifest_set_sha256}`",
        )
    ] + [
        (
            f"rank_{m.rank}",
            f"{splits[f'rank_{m.rank}']['rows']:,}",
            tokens(m.tokens),
            f"{m.weight:.4f}",
            f"`{m.sha256}`",
        )
        for m in manifests
    ]
    tables = [(stage, f"`{t.uri}`", str(t.version)) for stage, t in source.tables.items()]
    if source.lineage_table is not None:
        tables.append(
            ("sample_lineage", f"`{source.lineage_table.uri}`", str(source.lineage_table.version))
        )
    else:
        tables.append(("sample_lineage", "not built from these manifests", "-"))
    if license is None:
        license_text = (
            f"The source declares no license (no `license:` in the front matter of "
            f"`data/raw/{d}/README.md`, no `LICENSE` file there). Check the source's terms "
            "before sharing this dataset."
        )
    else:
        shipped = f" Its text is in `{license.file.name}` beside this card." if license.file else ""
        license_text = (
            f"`{license.license}`"
            + (f" ({license.license_name})" if license.license_name else "")
            + f", as declared by {license.declared_by}.{shipped}"
        )
    splits_doc = ", ".join(f"`{name}`" for name in splits)
    title = f"{d}: the selected subset ({source.selector}, r = {source.ratio:g}, K = {k})"
    load_rank = f'load_dataset("parquet", data_files=f"{{export}}/{DATA_DIR}/rank_0-*.parquet")'
    return f"""# {title}

The samples of dataset `{d}` that cluster_pipeline selected with CluSTER (*Clustering-Based
Balanced Sampling and Allocation with Data Parallelism for High-Performance Fine-Tuning*, Kim et
al.) and allocated to {k} data-parallel ranks, exported by `cluster-pipeline export {d}` from
its shard manifests.

Splits: {splits_doc}. `rank_<c>` is rank c's shard in the order rank c trains on it;
`train` is every shard entry, rank by rank (a sample selected with copies appears once per
copy). To train the way the pipeline does, rank c trains on `rank_<c>` in order with its loss
multiplied by the rank's `weight` w_c: under data-parallel averaging the update is then the
stratified estimate of the whole pool's gradient (docs/design.md, steps 4 and 5).

## Selection

{markdown_table(["", ""], facts)}

## Splits

{markdown_table(["split", "rows", "tokens", "weight", "manifest sha256"], split_rows_)}

Tokens: each sample as the embedding pass encoded it (chat template included, after
truncation), summed; `-` where the manifests do not record them.

## Columns

{markdown_table(["column", "type", "what"], [(f"`{n}`", t, w) for n, (t, w) in FEATURES.items()])}

## Provenance

Every row was read at these Delta table versions (the ones the shard manifests were built from):

{markdown_table(["stage", "table", "version"], tables)}

Manifest files: {", ".join(f"`{p}`" for p in source.manifest_paths)}.

## Load it

```python
from datasets import load_dataset, load_from_disk

export = "path/to/this/folder"
splits = load_from_disk(f"{{export}}/{DATASET_DICT}")  # a DatasetDict: {splits_doc}
splits = load_dataset(export)  # the same, from the Parquet files this card's header names
rank_0 = {load_rank}["train"]  # one split's files
```

To publish it on the Hub, upload `README.md`, `data/` and the license file, if any;
`dataset_dict/` and `export.json` serve this machine. `dataset_dict/` and `data/` hold the same
rows, and `export.json` records the SHA-256 of every file; `ClusterShards.from_export` trains
from `dataset_dict/` after checking them all. `system` is null where a sample has no system
prompt.

## License

{license_text}
"""


# renameat2's flag that swaps two paths in one step (linux/fs.h); AT_FDCWD: paths as given.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders at ``a`` and ``b`` in one step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the C library or the file system lacks it.

    Raises:
        OSError: the swap was refused for another reason (permissions, a mount point).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the folder ``tmp`` at ``out``; an earlier ``out`` ends up at ``tmp``. One atomic
    exchange where the system has it; else ``out`` is renamed aside, ``tmp`` into place, and
    the earlier folder renamed back if that fails."""
    if not out.exists():
        tmp.rename(out)
        return
    if _exchange(tmp, out):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    aside.rmdir()
    out.rename(aside)
    try:
        tmp.rename(out)
    except BaseException:
        aside.rename(out)
        raise
    aside.rename(tmp)


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
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        umask = os.umask(0o022)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700 would become the export's mode
        return tmp
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
    frames = split_rows(selection_rows(source, manifests), len(manifests))
    tmp = _make_tmp(out)
    try:
        splits, _ = _write_splits(frames, tmp)
        if license is not None and license.file is not None:
            shutil.copyfile(license.file, tmp / license.file.name)
        import yaml

        header = yaml.safe_dump(
            card_header(source, splits, license, tmp), sort_keys=False, allow_unicode=True
        )
        body = card_body(source, manifests, splits, license)
        (tmp / CARD).write_text(f"---\n{header}---\n\n{body}", encoding="utf-8")
        written, _ = _entries(tmp)
        identity = {
            "exporter": EXPORTER,
            "format": EXPORT_FORMAT,
            **export_identity(source),
            "splits": {n: s["rows"] for n, s in splits.items()},
            "files": {rel: file_sha256(tmp / rel) for rel in sorted(written)},
        }
        (tmp / IDENTITY).write_text(json.dumps(identity, indent=1) + "\n")
        # The destination again, just before the swap: a file put there meanwhile is refused.
        earlier = check_destination(out, source, overwrite)
        _swap_in(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ExportError(
                f"writing the export to --out {out} failed ({e}); the folder is as it was. "
                "Free space or fix the cause, then export again, or choose another --out"
            ) from e
        raise
    left: list[str] = []
    if out.exists() and tmp.exists():  # the earlier folder, now at tmp
        listed = [IDENTITY, *earlier.files] if earlier is not None else []
        left = _remove_listed(tmp, listed)
    return ExportSummary(
        out=out,
        rows={n: s["rows"] for n, s in splits.items()},
        parquet_files=sorted(f for f in identity["files"] if f.startswith(f"{DATA_DIR}/")),
        license=license,
        replaced=earlier is not None,
        left_behind=tmp if left else None,
    )
