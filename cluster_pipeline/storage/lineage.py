"""Per-sample lineage: one row per sample, from its source line to the checkpoints trained on it.

Joins, by ``sample_id``, the tables of every stage (raw_instructions, proxy_embeddings,
balanced_clusters, peripheral_subsets, shard_manifests) and the checkpoints trained on them
(the caller passes the catalogue's ``checkpoints_by_manifest``: which checkpoints name each
shard manifest's content hash, read by :mod:`cluster_pipeline.training.checkpointing`).

One rule for which versions are joined, so a row never contradicts itself (``selected: False``
beside a shard rank): every table at the version the latest shard manifests were built from
(the ``inputs`` each stage's commit records, :func:`~cluster_pipeline.storage.tables.
table_inputs`); where shard_manifests has no table yet, the furthest stage that has one plays
its part. A newer version of an upstream table (a stage re-run since) is not joined: it is
named, with the columns it would change (:func:`version_notes`).
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import polars as pl
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)
from cluster_pipeline.storage.tables import table_inputs

# The stages whose tables the lineage joins, in pipeline order.
LINEAGE_STAGES = (
    RAW_INSTRUCTIONS,
    PROXY_EMBEDDINGS,
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    SHARD_MANIFESTS,
)

LINEAGE_COLUMNS = [
    "sample_id",
    "split",
    "source_file",
    "source_line",
    "source_index",
    "n_response_tokens",
    "mean_loss",
    "skip_reason",
    "cluster",
    "sq_distance",
    "selection_rank",
    "selected",
    "copies",
    "weight",
    "rank",
    "shard_positions",
    "manifest_sha256",
    "checkpoints",
]


def build_lineage(
    tables: Mapping[str, pl.DataFrame | None], checkpoints: dict[str, list[str]]
) -> pl.DataFrame:
    """The lineage table (:data:`LINEAGE_COLUMNS`), one row per sample of the raw_instructions
    table (held-out samples included, with nulls past ``raw_instructions``).

    Args:
        tables: stage (:data:`LINEAGE_STAGES`) -> its table; stages not yet materialized may be
            None or absent, and their columns are null. ``raw_instructions`` is required.
        checkpoints: manifest sha256 -> checkpoint paths (see
            :func:`~cluster_pipeline.training.checkpointing.checkpoints_by_manifest`).
    """
    raw = tables[RAW_INSTRUCTIONS]
    if raw is None:
        raise ValueError("the raw_instructions table is required")
    embeddings, clusters, subsets, shards = (tables.get(s) for s in LINEAGE_STAGES[1:])
    if "source_index" not in raw.columns:  # a table written before the column existed
        raw = raw.with_columns(pl.lit(None, dtype=pl.Int64).alias("source_index"))
    frame = raw.select("sample_id", "split", "source_file", "source_line", "source_index")
    if embeddings is not None:
        frame = frame.join(
            embeddings.select("sample_id", "n_response_tokens", "mean_loss", "skip_reason"),
            on="sample_id",
            how="left",
        )
    if clusters is not None:
        frame = frame.join(
            clusters.select("sample_id", "cluster", "sq_distance"), on="sample_id", how="left"
        )
    if subsets is not None:
        frame = frame.join(
            subsets.select("sample_id", "selection_rank", "selected", "copies", "weight"),
            on="sample_id",
            how="left",
        )
    if shards is not None:
        per_sample = shards.group_by("sample_id").agg(
            pl.col("rank").first(),
            pl.col("position").sort().alias("shard_positions"),
            pl.col("manifest_sha256").first(),
        )
        frame = frame.join(per_sample, on="sample_id", how="left")
        by_hash = pl.DataFrame(
            {"manifest_sha256": list(checkpoints), "checkpoints": list(checkpoints.values())},
            schema={"manifest_sha256": pl.String, "checkpoints": pl.List(pl.String)},
        )
        frame = frame.join(by_hash, on="manifest_sha256", how="left")
    for name in LINEAGE_COLUMNS:
        if name not in frame.columns:
            frame = frame.with_columns(pl.lit(None).alias(name))
    return frame.select(LINEAGE_COLUMNS)


def subset_diff(old: pl.DataFrame, new: pl.DataFrame) -> dict[str, list[str]]:
    """Samples that entered and left the selected subset between two peripheral_subsets
    versions (each with ``sample_id`` and ``selected``)."""
    before = set(old.filter(pl.col("selected"))["sample_id"])
    after = set(new.filter(pl.col("selected"))["sample_id"])
    return {"entered": sorted(after - before), "left": sorted(before - after)}


# The lineage columns each stage supplies: what a newer version of the stage would change.
STAGE_COLUMNS = {
    RAW_INSTRUCTIONS: "the rows (which samples), split, source_file, source_line, source_index",
    PROXY_EMBEDDINGS: "n_response_tokens, mean_loss, skip_reason",
    BALANCED_CLUSTERS: "cluster, sq_distance",
    PERIPHERAL_SUBSETS: "selection_rank, selected, copies, weight",
    SHARD_MANIFESTS: "rank, shard_positions, manifest_sha256, checkpoints",
}


@dataclass(frozen=True)
class LineageTables:
    """The lineage stages' tables at one consistent set of versions (module docstring).

    ``frames``: stage -> its table at ``versions[stage]`` (None where the stage has no table);
    ``latest``: stage -> its latest version; ``anchor``: the furthest stage with a table, whose
    recorded inputs pinned the others (None when there is no table); ``pinned``: whether the
    anchor's commit recorded its inputs (False for a table an older pipeline wrote: then every
    table is at its latest version).
    """

    frames: dict[str, pl.DataFrame | None]
    versions: dict[str, int]
    latest: dict[str, int]
    anchor: str | None
    pinned: bool

    def notes(self) -> list[str]:
        """The lines that say which versions were read and what is newer
        (:func:`version_notes`)."""
        return version_notes(self.versions, self.latest, self.anchor, self.pinned)


def latest_versions(layout: DataLayout, dataset: str) -> dict[str, int]:
    """Stage -> the latest version of its table, for the lineage stages that have one."""
    out: dict[str, int] = {}
    for stage in LINEAGE_STAGES:
        try:
            out[stage] = DeltaTable(layout.table_uri(stage, dataset)).version()
        except TableNotFoundError:
            continue
    return out


def version_notes(
    versions: Mapping[str, int], latest: Mapping[str, int], anchor: str | None, pinned: bool = True
) -> list[str]:
    """What a reader of the lineage must know about its versions, one line each: the versions
    read and where they come from, then each stage whose latest version is newer than the one
    read, with the columns that come from the older one and what to run.

    Args:
        versions: stage -> the version read.
        latest: stage -> its latest version.
        anchor: the stage whose recorded inputs pinned the versions (None: nothing read).
        pinned: False when the anchor recorded no inputs (every table at its latest).
    """
    if anchor is None:
        return []
    read = ", ".join(f"{s} v{versions[s]}" for s in LINEAGE_STAGES if s in versions)
    if not pinned:
        return [
            f"tables: {read}, each its latest: {anchor} v{versions[anchor]} recorded no input "
            "versions (an older pipeline wrote it), so these may not be the versions it was "
            f"built from; materialize {anchor} again to pin them"
        ]
    if anchor == LINEAGE_STAGES[0]:
        return [f"tables: {read}; no stage after it materialized yet"]
    lines = [f"tables: {read}: the versions {anchor} v{versions[anchor]} was built from"]
    for stage in LINEAGE_STAGES:
        if stage in versions and latest.get(stage, -1) > versions[stage]:
            lines.append(
                f"{stage} v{latest[stage]} is newer than the v{versions[stage]} {anchor} "
                f"v{versions[anchor]} was built from: {STAGE_COLUMNS[stage]} below are from "
                f"v{versions[stage]}; materialize the stages after {stage} again (selection_job "
                f"runs them) to trace v{latest[stage]}"
            )
    return lines


def read_lineage_tables(layout: DataLayout, dataset: str) -> LineageTables:
    """The lineage stages' tables at the versions the latest shard manifests (or the furthest
    stage materialized) were built from. Used where no Dagster instance is at hand (the CLI);
    the ``sample_lineage`` asset reads the same versions from the records.

    Raises:
        FileNotFoundError: a table version to read lists Parquet files that were deleted, or is
            gone (the table was deleted or vacuumed); the message says what to re-materialize.
    """
    latest = latest_versions(layout, dataset)
    anchor = next((s for s in reversed(LINEAGE_STAGES) if s in latest), None)
    if anchor is None:
        return LineageTables(dict.fromkeys(LINEAGE_STAGES), {}, {}, None, False)
    # The first stage reads no table: its version pins nothing.
    inputs = (
        {}
        if anchor == LINEAGE_STAGES[0]
        else table_inputs(layout.table_uri(anchor, dataset), latest[anchor])
    )
    versions = {
        s: latest[s] if inputs is None or s == anchor else inputs.get(s, latest.get(s, -1))
        for s in LINEAGE_STAGES
        if s in latest or (inputs is not None and s in inputs)
    }
    frames: dict[str, pl.DataFrame | None] = dict.fromkeys(LINEAGE_STAGES)
    for stage, version in versions.items():
        uri = layout.table_uri(stage, dataset)
        if version < 0 or version > latest.get(stage, -1):
            raise FileNotFoundError(
                f"{stage} table {uri} has no version {version}, which {anchor} "
                f"v{latest[anchor]} was built from (the table was deleted or rewritten); "
                f"re-materialize the selection chain for {dataset!r}"
            )
        try:
            frames[stage] = pl.read_delta(uri, version=version)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{stage} table {uri} v{version} lists data files that are gone ({e}); "
                f"re-materialize {stage} for {dataset!r}"
            ) from e
    return LineageTables(frames, versions, latest, anchor, inputs is not None)


def checkpoints_elsewhere(checkpoints: Mapping[str, list[str]], shown: Iterable[str]) -> list[str]:
    """The checkpoints trained on none of the ``shown`` manifest hashes (an older manifest set),
    sorted: the lineage's ``checkpoints`` column cannot name them, so a reader is told apart.

    Args:
        checkpoints: manifest sha256 -> checkpoint paths (``checkpoints_by_manifest``).
        shown: the manifest hashes of the lineage's rows.
    """
    shown = set(shown)
    on_shown = {p for sha in shown for p in checkpoints.get(sha, [])}
    return sorted({p for paths in checkpoints.values() for p in paths} - on_shown)
