"""The nightly refresh of the selection chain, for datasets whose source changed."""

import dagster as dg

from cluster_pipeline.data.datasets import discover_datasets, source_fingerprint
from cluster_pipeline.defs.jobs import selection_job
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline.defs.records import (
    RawInstructionsRecord,
    UpstreamNotMaterialized,
    latest_record,
)
from cluster_pipeline.defs.resources import StorageResource


def changed_datasets(instance: dg.DagsterInstance, storage: StorageResource) -> dict[str, str]:
    """Dataset -> current source fingerprint, for every registered dataset whose fingerprint
    differs from the one its latest ``raw_instructions`` materialization recorded (or that was
    never materialized). Datasets whose folder is gone are left alone."""
    raw_dir = storage.layout.raw_dir
    present = set(discover_datasets(raw_dir))
    out = {}
    for dataset in instance.get_dynamic_partitions(DATASETS):
        if dataset not in present:
            continue
        current = source_fingerprint(dataset, raw_dir)
        try:
            recorded = latest_record(instance, RawInstructionsRecord, dataset)
        except UpstreamNotMaterialized:  # written by an older version: refresh it
            recorded = None
        if recorded is None or recorded.source_fingerprint != current:
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
    """At 02:00, one ``selection_job`` run per dataset whose sources changed, else a skip reason."""
    changed = changed_datasets(context.instance, storage)
    if not changed:
        return dg.SkipReason("no dataset source changed since its last raw_instructions")
    return [
        dg.RunRequest(run_key=f"{dataset}:{fingerprint}", partition_key=dataset)
        for dataset, fingerprint in sorted(changed.items())
    ]
