"""The selected subset as a Hugging Face ``datasets`` dataset (``cluster-pipeline export``).

An export is one folder (default ``data/exports/<dataset>/``, :meth:`DataLayout.exports_dir`)::

    README.md                               the dataset card: the Hub's YAML header (configs,
                                            splits and row counts, features, license) and the
                                            selection's provenance
    data/<split>-00000-of-00001.parquet     the Hub's Parquet layout: one config, a split each
    dataset_dict/                           ``DatasetDict.save_to_disk`` (``load_from_disk``)
    LICENSE                                 the source's license file, where it has one
    export.json                             what was exported: dataset, manifests, table versions

Splits: ``rank_<c>``, rank c's shard in manifest order (the order rank c trains in), and
``train``, every shard entry, rank by rank: the subset as trained, a sample selected with copies
(``uniform``) once per copy. A row is one shard entry (:data:`FEATURES`): the ``sample_id``, its
``rank``, ``position`` and the rank's loss ``weight`` w_c, its ``cluster``, the sample as the
``raw_instructions`` table stores it (``system``, ``prompt``, ``response``, ``messages`` and
``tools`` as JSON text, ``form``), its ``source_file`` and ``source_line``, and the manifest's
``manifest_sha256``. Everything is read at the table versions the manifests were built from.

The folder is written beside its destination and renamed into place, so an export that fails
leaves the earlier one as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
    "system": ("string", "system prompt, or null"),
    "prompt": ("string", "the normalised prompt"),
    "response": ("string", "the normalised response"),
    "messages": ("string", "the kept conversation as JSON, or null for one exchange"),
    "tools": ("string", "function schemas as JSON, or null"),
    "form": ("string", "the input form the record was read in"),
    "source_file": ("string", "the file the record was read from"),
    "source_line": ("int64", "its line (record number for Parquet and Arrow)"),
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
]
_POLARS = {"string": pl.String, "int64": pl.Int64, "float64": pl.Float64}
DATASET_DICT = "dataset_dict"
DATA_DIR = "data"
CARD = "README.md"
IDENTITY = "export.json"
# The Hub's default Parquet shard size (datasets.config.MAX_SHARD_SIZE, "500MB").
MAX_SHARD_BYTES = 500_000_000


class ExportError(Exception):
    """An export that cannot be made as asked (a destination holding something else, manifests
    gone or edited, tables out of step): the message says what and what to do."""


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
    declared) and whether it replaced an earlier export."""

    out: Path
    rows: dict[str, int]
    parquet_files: list[str]
    license: SourceLicense | None
    replaced: bool = False


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
    )
    return rows.select([pl.col(name).cast(_POLARS[dtype]) for name, (dtype, _) in FEATURES.items()])


def split_rows(rows: pl.DataFrame, world_size: int) -> dict[str, pl.DataFrame]:
    """``train`` (every row) and ``rank_<c>`` (rank c's rows, in position order) for c < K."""
    out = {"train": rows}
    for c in range(world_size):
        out[f"rank_{c}"] = rows.filter(pl.col("rank") == c)
    return out


def export_identity(source: ExportSource) -> dict[str, Any]:
    """What names an export (``export.json``): two exports are the same when dataset and
    manifest set are."""
    return {
        "dataset": source.dataset,
        "manifest_set_sha256": source.manifest_set_sha256,
        "manifest_sha256": source.manifest_sha256,
        "tables": {s: {"uri": t.uri, "version": t.version} for s, t in source.tables.items()},
    }


def check_destination(out: Path, source: ExportSource, overwrite: bool) -> bool:
    """Whether ``out`` may receive this export; True if it holds an earlier one (replaced).

    A missing or empty folder, or an export of the same dataset and manifest set, may be
    written; an export of anything else only with ``overwrite``; anything else never.

    Raises:
        ExportError: ``out`` is a file, a folder that is not an export, or (without
            ``overwrite``) a different export.
    """
    if not out.exists():
        return False
    if not out.is_dir():
        raise ExportError(f"{out} is a file; choose a folder with --out")
    if not any(out.iterdir()):
        return False
    identity = out / IDENTITY
    if not identity.is_file():
        raise ExportError(
            f"{out} is not empty and holds no {IDENTITY}, so it is not an export; choose a new "
            "or empty folder with --out (--overwrite replaces only an earlier export)"
        )
    try:
        earlier = json.loads(identity.read_text())
        same = (earlier["dataset"], earlier["manifest_set_sha256"]) == (
            source.dataset,
            source.manifest_set_sha256,
        )
        what = f"dataset {earlier['dataset']!r}, manifest set {earlier['manifest_set_sha256'][:12]}"
    except (ValueError, KeyError, TypeError):
        same, what = False, f"an unreadable {IDENTITY}"
    if not same and not overwrite:
        raise ExportError(
            f"{out} holds another export ({what}), not dataset {source.dataset!r} manifest set "
            f"{source.manifest_set_sha256[:12]}; pass --overwrite to replace it, or --out "
            "another folder"
        )
    return True


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
        ("cluster weights w_c = n_c K / N", _weights(source.cluster_weights)),
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
`dataset_dict/` and `export.json` serve this machine.

## License

{license_text}
"""


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an earlier ``out`` is set aside first, restored if the rename
    fails, and deleted once the new folder is in place."""
    if not out.exists():
        tmp.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old)


def export_selection(
    source: ExportSource, out: Path, raw_dir: Path, overwrite: bool = False
) -> ExportSummary:
    """Write the export of ``source`` to ``out`` (module docstring).

    Args:
        source: the manifests and facts to export (the CLI reads them from the Dagster records).
        out: the export folder; its parent is created.
        raw_dir: the data folder's ``raw/``, where the source's license is declared
            (:func:`~cluster_pipeline.data.datasets.source_license`).
        overwrite: replace an export of other manifests (never a folder that is not an export).

    Raises:
        ExportError: the destination may not be written (:func:`check_destination`), the
            manifests are gone or edited, or the tables lack their samples; ``out`` is left as
            it was; or the source folder's card declares its license in a malformed way.
    """
    out = Path(out).absolute()
    replaced = check_destination(out, source, overwrite)
    manifests = read_manifests(source)
    try:
        license = source_license(source.dataset, raw_dir)
    except ValueError as e:
        raise ExportError(str(e)) from None
    frames = split_rows(selection_rows(source, manifests), len(manifests))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        splits, files = _write_splits(frames, tmp)
        if license is not None and license.file is not None:
            shutil.copyfile(license.file, tmp / license.file.name)
        import yaml

        header = yaml.safe_dump(
            card_header(source, splits, license, tmp), sort_keys=False, allow_unicode=True
        )
        body = card_body(source, manifests, splits, license)
        (tmp / CARD).write_text(f"---\n{header}---\n\n{body}", encoding="utf-8")
        identity = {**export_identity(source), "splits": {n: s["rows"] for n, s in splits.items()}}
        (tmp / IDENTITY).write_text(json.dumps(identity, indent=1) + "\n")
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportSummary(
        out=out,
        rows={n: s["rows"] for n, s in splits.items()},
        parquet_files=files,
        license=license,
        replaced=replaced,
    )
