"""Per-sample lineage: one row per sample, from its source line to the checkpoints trained on it.

Joins, by ``sample_id``, the tables of every stage (raw_instructions, proxy_embeddings,
balanced_clusters, peripheral_subsets, shard_manifests) and the checkpoints trained on them
(the caller passes the catalogue's ``checkpoints_by_manifest``: which checkpoints name each
shard manifest's content hash, read by :mod:`cluster_pipeline.training.checkpointing`).
"""

from collections.abc import Mapping

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
    frame = raw.select("sample_id", "split", "source_file", "source_line")
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


def latest_tables(layout: DataLayout, dataset: str) -> dict[str, tuple[int, pl.DataFrame] | None]:
    """Stage -> (version, frame) of the latest version of each lineage stage's table, or None
    where the stage has no table yet. Used where no Dagster instance is at hand (the CLI);
    the ``sample_lineage`` asset reads the versions its shard manifests were built from.

    Raises:
        FileNotFoundError: a table's latest version lists Parquet files that were deleted.
    """
    out: dict[str, tuple[int, pl.DataFrame] | None] = {}
    for stage in LINEAGE_STAGES:
        uri = layout.table_uri(stage, dataset)
        try:
            version = DeltaTable(uri).version()
        except TableNotFoundError:
            out[stage] = None
            continue
        try:
            out[stage] = (version, pl.read_delta(uri, version=version))
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"{stage} table {uri} v{version} lists data files that are gone ({e}); "
                f"re-materialize {stage} for {dataset!r}"
            ) from e
    return out
