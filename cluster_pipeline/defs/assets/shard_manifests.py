"""Stage 4: one shard manifest per data-parallel rank (cluster c -> rank c)."""


import time

import dagster as dg
import numpy as np
import polars as pl
from pydantic import Field

from cluster_pipeline.core.selection import SelectionResult
from cluster_pipeline.core.sharding import allocate, check_allocation, manifest_set_hash
from cluster_pipeline.core.tables import write_table
from cluster_pipeline.defs.metadata import latest_metadata, table_metadata, upstream_table
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import StorageResource

CHECKS = {
    "equal_shards": "Every rank holds the same number of samples (else DDP hangs).",
    "coverage": "Every selected sample (with its copies) is in exactly one shard position.",
    "weights": "Each rank's loss weight equals n_c K / N recomputed from the cluster labels.",
}


class ShardManifestsConfig(dg.Config):
    seed: int = Field(default=0, description="Seed of each shard's sample order.")


def selection_from_table(frame: pl.DataFrame, selector: str, k: int, per_cluster: int) -> SelectionResult:
    """Rebuild the selector's result from the peripheral_subsets table (weights at full
    precision from its ``weight`` column, not from rounded metadata)."""
    per_cluster_weight = frame.group_by("cluster").agg(pl.col("weight").first()).sort("cluster")
    weights = np.ones(k)
    weights[per_cluster_weight["cluster"].to_numpy()] = per_cluster_weight["weight"].to_numpy()
    return SelectionResult(
        selector=selector,
        selected=frame["selected"].to_numpy(),
        copies=frame["copies"].to_numpy().astype(np.int64),
        selection_rank=frame["selection_rank"].to_numpy(),
        weight=frame["weight"].to_numpy(),
        cluster_weights=weights,
        per_cluster=per_cluster,
    )


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["peripheral_subsets"],
    group_name="selection",
    kinds={"json", "deltalake"},
    code_version="1",
    # Kept in sync with its parent; training and evaluation run only on request.
    automation_condition=dg.AutomationCondition.eager(),
    check_specs=[
        dg.AssetCheckSpec(name, asset="shard_manifests", blocking=True, description=text)
        for name, text in CHECKS.items()
    ],
)
def shard_manifests(
    context: dg.AssetExecutionContext, config: ShardManifestsConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per (rank, position): the ``sample_id`` that rank ``rank`` trains on at
    ``position`` of its shard, with the rank's loss ``weight`` and the manifest's content hash.
    Every rank holds the same number of samples. The same manifests are written as JSON files
    (``rank_<c>.json``), which the training ranks read. DESIGN.md step 4.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    subsets_meta = latest_metadata(context, "peripheral_subsets")
    subsets = upstream_table(context, "peripheral_subsets").read()
    k = len(subsets_meta["cluster_weights"])
    selection = selection_from_table(subsets, str(subsets_meta["selector"]), k,
                                     int(subsets_meta["per_cluster"]))
    try:
        allocation = allocate(dataset, subsets["sample_id"].to_numpy(), subsets["cluster"].to_numpy(),
                              selection, k, config.seed)
    except ValueError as e:
        raise dg.Failure(description=f"{dataset}: {e}") from e
    set_hash = manifest_set_hash(allocation.manifests)
    folder = storage.work_dir("shards", dataset, set_hash[:16])
    paths = [str(m.write(folder)) for m in allocation.manifests]
    frame = pl.concat(
        [
            pl.DataFrame(
                {
                    "rank": [m.rank] * m.n_samples,
                    "position": list(range(m.n_samples)),
                    "sample_id": list(m.sample_ids),
                    "weight": [m.weight] * m.n_samples,
                    "manifest_sha256": [m.sha256] * m.n_samples,
                },
                schema={"rank": pl.Int64, "position": pl.Int64, "sample_id": pl.String,
                        "weight": pl.Float64, "manifest_sha256": pl.String},
            )
            for m in allocation.manifests
        ]
    )
    ref = write_table(frame, storage.table_uri("shard_manifests", dataset))
    seconds = time.perf_counter() - start
    context.log.info(f"{k} shards of {allocation.shard_size} samples in {folder}")
    checks = check_allocation(allocation.manifests, subsets["sample_id"].to_numpy(),
                              subsets["cluster"].to_numpy(), selection, allocation.dropped)
    return dg.MaterializeResult(
        check_results=[
            dg.AssetCheckResult(check_name=name, passed=passed, description=text,
                                severity=dg.AssetCheckSeverity.ERROR)
            for name, (passed, text) in checks.items()
        ],
        metadata={
            **table_metadata(ref, frame, seconds),
            "world_size": k,
            "shard_size": allocation.shard_size,
            "dropped_for_equal_shards": allocation.dropped,
            "selector": selection.selector,
            "manifest_paths": dg.MetadataValue.json(paths),
            "manifest_sha256": dg.MetadataValue.json([m.sha256 for m in allocation.manifests]),
            "manifest_set_sha256": set_hash,
            "rank_weights": dg.MetadataValue.json([m.weight for m in allocation.manifests]),
        },
    )
