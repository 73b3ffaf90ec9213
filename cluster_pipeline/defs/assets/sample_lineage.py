"""Inspection: every sample's path through the pipeline, in one table."""

import time

import dagster as dg
import polars as pl

from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import SampleLineageRecord, ShardManifestsRecord, read_record
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.stages import eager, parents_updated, stage_asset
from cluster_pipeline.storage.lineage import (
    LINEAGE_STAGES,
    build_lineage,
    checkpoints_elsewhere,
    latest_versions,
    version_notes,
)
from cluster_pipeline.storage.names import SAMPLE_LINEAGE, SHARD_MANIFESTS, TRAINED_CHECKPOINT
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline.training.checkpointing import checkpoints_by_manifest, list_checkpoints

_CHECKPOINT = dg.AssetSelection.assets(TRAINED_CHECKPOINT)

# Eager on the selection chain; a new checkpoint also refreshes it, but a missing one (training
# runs only on request) does not block it.
LINEAGE_CONDITION = (
    eager().ignore(_CHECKPOINT)
    | (
        parents_updated().allow(_CHECKPOINT).since_last_handled()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    )
).with_label("eager; a missing checkpoint does not block")


@stage_asset(
    "inspection",
    deps=[*LINEAGE_STAGES, TRAINED_CHECKPOINT],
    kinds={"polars", "deltalake"},
    automation_condition=LINEAGE_CONDITION,
)
def sample_lineage(
    context: dg.AssetExecutionContext, storage: StorageResource
) -> dg.MaterializeResult:
    """One row per sample of the dataset: ``source_file``/``source_line``/``source_index``,
    ``sample_id``,
    ``split``, embedding stats (``n_response_tokens`` T, ``mean_loss``, ``skip_reason``),
    ``cluster`` and ``sq_distance``, ``selection_rank``, ``selected``, ``copies``, ``weight``,
    the shard ``rank`` and ``shard_positions``, the manifest's ``manifest_sha256``, and the
    ``checkpoints`` trained on that manifest. Each stage's table is read at the version the
    latest shard manifests were built from; ``version_notes`` names any stage re-run since (a
    newer version, not joined) and checkpoints trained on other manifests. The same view from a
    shell: ``cluster-pipeline lineage <dataset> <sample_id>``.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    shards = read_record(context, ShardManifestsRecord)
    versions = shards.lineage()
    checkpoints = checkpoints_by_manifest(list_checkpoints(layout.checkpoints_dir(dataset)))
    frame = build_lineage({stage: versions[stage].read() for stage in LINEAGE_STAGES}, checkpoints)
    table = write_table(
        frame, layout.table_uri(SAMPLE_LINEAGE, dataset), guard=storage.guard, inputs=versions
    )
    notes = version_notes(
        {stage: versions[stage].version for stage in LINEAGE_STAGES},
        latest_versions(layout, dataset),
        SHARD_MANIFESTS,
    )
    elsewhere = checkpoints_elsewhere(checkpoints, frame["manifest_sha256"].drop_nulls())
    if elsewhere:
        notes.append(f"checkpoints trained on other shard manifests: {', '.join(elsewhere)}")
    record = SampleLineageRecord(
        table=table,
        inputs=versions,
        seconds=round(time.perf_counter() - start, 3),
        selected_samples=int(frame["selected"].fill_null(False).sum()),
        samples_in_a_checkpoint=frame.filter(pl.col("checkpoints").list.len() > 0).height,
    )
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            "version_notes": dg.MetadataValue.md("\n".join(f"- {n}" for n in notes)),
            **table_display(
                frame,
                SAMPLE_LINEAGE,
                # What a row is first (a held-out sample has no cluster, selection or rank:
                # its split says why), the long source path last, where a narrow window
                # cuts it rather than the rest (issue 44).
                [
                    "sample_id",
                    "split",
                    "cluster",
                    "selected",
                    "weight",
                    "rank",
                    "source_line",
                    "source_index",
                    "source_file",
                ],
            ),
        }
    )
