"""Stage 4: one shard manifest per data-parallel rank (cluster c -> rank c)."""

import time

import dagster as dg
from pydantic import Field

from cluster_pipeline.core.selection import selection_from_table
from cluster_pipeline.core.sharding import (
    CHECKS,
    allocate,
    check_allocation,
    manifest_set_hash,
    manifests_frame,
)
from cluster_pipeline.core.tables import write_table
from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import PeripheralSubsetsRecord, ShardManifestsRecord, read_record
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.stages import stage_asset


class ShardManifestsConfig(dg.Config):
    seed: int = Field(default=0, ge=0, description="Seed of each shard's sample order.")


@stage_asset(
    "selection",
    deps=["peripheral_subsets"],
    kinds={"json", "deltalake"},
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
    (``rank_<c>.json``), which the training ranks read. docs/design.md, step 4.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    subsets = read_record(context, PeripheralSubsetsRecord)
    frame = subsets.table.read()
    k = len(subsets.cluster_weights)
    selection = selection_from_table(frame, subsets.selector, k, subsets.per_cluster)
    sample_ids, labels = frame["sample_id"].to_numpy(), frame["cluster"].to_numpy()
    try:
        allocation = allocate(dataset, sample_ids, labels, selection, k, config.seed)
    except ValueError as e:
        raise dg.Failure(description=f"{dataset}: {e}") from e
    set_hash = manifest_set_hash(allocation.manifests)
    folder = layout.shards_dir(dataset, set_hash)
    paths = [str(m.write(folder)) for m in allocation.manifests]
    shards = manifests_frame(allocation.manifests)
    table = write_table(shards, layout.table_uri("shard_manifests", dataset))
    seconds = time.perf_counter() - start
    context.log.info(f"{k} shards of {allocation.shard_size} samples in {folder}")
    checks = check_allocation(
        allocation.manifests, sample_ids, labels, selection, allocation.dropped
    )
    record = ShardManifestsRecord(
        table=table,
        inputs=subsets.lineage(),
        seconds=round(seconds, 3),
        selection_seconds=round(subsets.selection_seconds + seconds, 2),
        world_size=k,
        shard_size=allocation.shard_size,
        dropped_for_equal_shards=allocation.dropped,
        selector=selection.selector,
        manifest_paths=paths,
        manifest_sha256=[m.sha256 for m in allocation.manifests],
        manifest_set_sha256=set_hash,
        rank_weights=[m.weight for m in allocation.manifests],
    )
    return dg.MaterializeResult(
        check_results=[
            dg.AssetCheckResult(
                check_name=name,
                passed=passed,
                description=text,
                severity=dg.AssetCheckSeverity.ERROR,
            )
            for name, (passed, text) in checks.items()
        ],
        metadata={**record.to_metadata(), **table_display(shards)},
    )
