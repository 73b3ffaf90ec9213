"""Inspection: every sample's path through the pipeline, in one table."""

import time

import dagster as dg
import polars as pl

from cluster_pipeline.core.lineage import build_lineage, checkpoints_by_manifest
from cluster_pipeline.core.tables import write_table
from cluster_pipeline.defs.metadata import table_metadata, upstream_table
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import StorageResource

_CHECKPOINT = dg.AssetSelection.assets("trained_checkpoint")

# Eager on the selection chain; a new checkpoint also refreshes it, but a missing one (training
# runs only on request) does not block it.
LINEAGE_CONDITION = (
    dg.AutomationCondition.eager().ignore(_CHECKPOINT)
    | (
        dg.AutomationCondition.any_deps_updated().allow(_CHECKPOINT).since_last_handled()
        & ~dg.AutomationCondition.any_deps_in_progress()
        & ~dg.AutomationCondition.in_progress()
    )
).with_label("eager; a missing checkpoint does not block")


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["raw_instructions", "proxy_embeddings", "balanced_clusters", "peripheral_subsets",
          "shard_manifests", "trained_checkpoint"],
    group_name="inspection",
    kinds={"polars", "deltalake"},
    automation_condition=LINEAGE_CONDITION,
)
def sample_lineage(context: dg.AssetExecutionContext, storage: StorageResource) -> dg.MaterializeResult:
    """One row per sample of the dataset: ``source_file``/``source_line``, ``sample_id``,
    ``split``, embedding stats (``n_response_tokens`` T, ``mean_loss``, ``skip_reason``),
    ``cluster`` and ``sq_distance``, ``selection_rank``, ``selected``, ``copies``, ``weight``,
    the shard ``rank`` and ``shard_positions``, the manifest's ``manifest_sha256``, and the
    ``checkpoints`` trained on that manifest. The same view from a shell:
    ``python -m cluster_pipeline.lineage <dataset> <sample_id>``.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    tables = {
        name: upstream_table(context, name).read()
        for name in ("raw_instructions", "proxy_embeddings", "balanced_clusters",
                     "peripheral_subsets", "shard_manifests")
    }
    checkpoints = checkpoints_by_manifest(storage.root / "checkpoints" / dataset)
    frame = build_lineage(
        tables["raw_instructions"], tables["proxy_embeddings"], tables["balanced_clusters"],
        tables["peripheral_subsets"], tables["shard_manifests"], checkpoints,
    )
    ref = write_table(frame, storage.table_uri("sample_lineage", dataset))
    trained = frame.filter(pl.col("checkpoints").list.len() > 0).height
    return dg.MaterializeResult(
        metadata={
            **table_metadata(ref, frame, time.perf_counter() - start, preview_columns=[
                "sample_id", "source_file", "source_line", "cluster", "selected", "rank",
                "weight"]),
            "selected_samples": int(frame["selected"].fill_null(False).sum()),
            "samples_in_a_checkpoint": trained,
        }
    )
