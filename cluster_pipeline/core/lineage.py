"""Per-sample lineage: one row per sample, from its source line to the checkpoints trained on it.

Joins, by ``sample_id``, the tables of every stage (raw_instructions, proxy_embeddings,
balanced_clusters, peripheral_subsets, shard_manifests) and the ``training_info.json`` of every
checkpoint, which names the content hashes of the shard manifests it was trained on.
"""

import json
from pathlib import Path

import polars as pl

LINEAGE_COLUMNS = [
    "sample_id", "split", "source_file", "source_line", "n_response_tokens", "mean_loss",
    "skip_reason", "cluster", "sq_distance", "selection_rank", "selected", "copies", "weight",
    "rank", "shard_positions", "manifest_sha256", "checkpoints",
]


def checkpoints_by_manifest(checkpoint_root: Path) -> dict[str, list[str]]:
    """manifest sha256 -> checkpoint folders whose ``training_info.json`` names it."""
    out: dict[str, list[str]] = {}
    if not checkpoint_root.is_dir():
        return out
    for info_path in sorted(checkpoint_root.glob("*/training_info.json")):
        try:
            info = json.loads(info_path.read_text())
        except ValueError:
            continue
        for m in info.get("manifests", []):
            out.setdefault(m["sha256"], []).append(str(info_path.parent))
    return out


def build_lineage(
    raw: pl.DataFrame,
    embeddings: pl.DataFrame | None,
    clusters: pl.DataFrame | None,
    subsets: pl.DataFrame | None,
    shards: pl.DataFrame | None,
    checkpoints: dict[str, list[str]],
) -> pl.DataFrame:
    """The lineage table (:data:`LINEAGE_COLUMNS`), one row per sample of ``raw`` (held-out
    samples included, with nulls past ``raw_instructions``). Stages not yet materialized may be
    None; their columns are null."""
    frame = raw.select("sample_id", "split", "source_file", "source_line")
    if embeddings is not None:
        frame = frame.join(embeddings.select("sample_id", "n_response_tokens", "mean_loss", "skip_reason"),
                           on="sample_id", how="left")
    if clusters is not None:
        frame = frame.join(clusters.select("sample_id", "cluster", "sq_distance"), on="sample_id",
                           how="left")
    if subsets is not None:
        frame = frame.join(subsets.select("sample_id", "selection_rank", "selected", "copies", "weight"),
                           on="sample_id", how="left")
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
