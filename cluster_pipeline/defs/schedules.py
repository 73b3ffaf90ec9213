"""The nightly refresh of the selection chain, for datasets whose source changed."""

import dagster as dg

from cluster_pipeline.core.datasets import discover_datasets, source_fingerprint
from cluster_pipeline.defs.jobs import selection_job
from cluster_pipeline.defs.metadata import latest_materialization_metadata
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import StorageResource


def changed_datasets(instance: dg.DagsterInstance, storage: StorageResource) -> dict[str, str]:
    """dataset -> current source fingerprint, for every registered dataset whose fingerprint
    differs from the one its latest ``raw_instructions`` materialization recorded (or that was
    never materialized). Datasets whose folder is gone are left alone."""
    present = set(discover_datasets(storage.raw_dir))
    out = {}
    for dataset in instance.get_dynamic_partitions(dataset_partitions.name):
        if dataset not in present:
            continue
        current = source_fingerprint(dataset, storage.raw_dir)
        recorded = latest_materialization_metadata(instance, "raw_instructions", dataset) or {}
        if recorded.get("source_fingerprint") != current:
            out[dataset] = current
    return out


@dg.schedule(
    cron_schedule="0 2 * * *",
    job=selection_job,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Nightly at 02:00: raw_instructions -> shard_manifests for every dataset "
    "partition whose source files changed (by content fingerprint). Training and evaluation "
    "run only on request.",
)
def nightly_selection_refresh(context: dg.ScheduleEvaluationContext, storage: StorageResource):
    changed = changed_datasets(context.instance, storage)
    if not changed:
        return dg.SkipReason("no dataset source changed since its last raw_instructions")
    return [
        dg.RunRequest(run_key=f"{dataset}:{fingerprint}", partition_key=dataset)
        for dataset, fingerprint in sorted(changed.items())
    ]
