"""Stage 4: one shard manifest per data-parallel rank (cluster c -> rank c)."""

import time

import dagster as dg

from cluster_pipeline.defs.configs import ShardManifestsConfig
from cluster_pipeline.defs.metadata import error_checks, table_display
from cluster_pipeline.defs.records import PeripheralSubsetsRecord, ShardManifestsRecord, read_record
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.run_checks import refused_in_step
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.selection.selectors import selection_from_table
from cluster_pipeline.selection.sharding import (
    CHECKS,
    allocate,
    check_allocation,
    manifest_set_hash,
    manifests_frame,
)
from cluster_pipeline.storage.names import PERIPHERAL_SUBSETS, SHARD_MANIFESTS
from cluster_pipeline.storage.provenance import code_identity
from cluster_pipeline.storage.tables import write_table


@stage_asset(
    "selection",
    deps=[PERIPHERAL_SUBSETS],
    kinds={"json", "deltalake"},
    check_specs=[
        dg.AssetCheckSpec(name, asset=SHARD_MANIFESTS, blocking=True, description=text)
        for name, text in CHECKS.items()
    ],
)
def shard_manifests(
    context: dg.AssetExecutionContext, config: ShardManifestsConfig, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per (rank, position): the ``sample_id`` that rank ``rank`` trains on at
    ``position`` of its shard, with the rank's loss ``weight`` and the manifest's content hash.
    Every rank holds the same number of tokens (token balance, to within one sample) or of
    samples (sample balance). The same manifests are written as JSON files
    (``rank_<c>.json``), which the training ranks read. docs/design.md, step 4.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    subsets = read_record(context, PeripheralSubsetsRecord)
    frame = subsets.table.read()
    k = len(subsets.cluster_weights)
    selection = selection_from_table(
        frame, subsets.selector, k, subsets.per_cluster, subsets.balance, subsets.token_budget
    )
    sample_ids, labels = frame["sample_id"].to_numpy(), frame["cluster"].to_numpy()
    lengths = frame["n_tokens"].to_numpy() if "n_tokens" in frame.columns else None
    try:
        allocation = allocate(
            dataset, sample_ids, labels, selection, k, config.seed, lengths=lengths
        )
    except ValueError as e:
        raise refused_in_step(context, layout, f"{dataset}: {e}") from e
    set_hash = manifest_set_hash(allocation.manifests)
    folder = layout.shards_dir(dataset, set_hash)
    paths = [str(m.write(folder)) for m in allocation.manifests]
    shards = manifests_frame(allocation.manifests)
    table = write_table(
        shards,
        layout.table_uri(SHARD_MANIFESTS, dataset),
        guard=storage.guard,
        inputs=subsets.lineage(),
    )
    seconds = time.perf_counter() - start
    samples = [m.n_samples for m in allocation.manifests]
    context.log.info(
        f"{k} shards in {folder}: samples {samples}, tokens {allocation.tokens_per_rank} "
        f"(spread {100 * allocation.token_spread:.2f} %), weights "
        f"{[round(m.weight, 4) for m in allocation.manifests]}"
    )
    checks = check_allocation(
        allocation.manifests,
        sample_ids,
        labels,
        selection,
        allocation.dropped,
        lengths,
        frame["n_response_tokens"].to_numpy() if "n_response_tokens" in frame.columns else None,
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
        rank_weights=[round(m.weight, 6) for m in allocation.manifests],  # shown; files exact
        balance=selection.balance,
        samples_per_rank=samples,
        tokens_per_rank=allocation.tokens_per_rank,
        token_spread=round(allocation.token_spread, 5),
        config=config.model_dump(mode="json"),
        code=code_identity(),
    )
    return dg.MaterializeResult(
        check_results=error_checks(checks),
        metadata={**record.to_metadata(), **table_display(shards, SHARD_MANIFESTS)},
        data_version=dg.DataVersion(set_hash[:16]),
    )
