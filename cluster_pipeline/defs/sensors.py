"""The sensor that turns every dataset folder under ``data/raw/`` into a partition."""

import dagster as dg

from cluster_pipeline.data.datasets import discover_datasets, refused_datasets
from cluster_pipeline.defs.partitions import DATASETS, dataset_partitions
from cluster_pipeline.defs.resources import StorageResource


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def dataset_folders_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
    """Adds a ``datasets`` partition for ``python_stdlib`` and for each new folder
    ``data/raw/<name>/`` holding data files with records (``data.datasets.discover_datasets``);
    a folder it refuses (no data file, every file empty, a name Dagster rejects) is logged with
    the reason and never added. Removing a folder deletes nothing."""
    raw_dir = storage.layout.raw_dir
    for name, reason in refused_datasets(raw_dir).items():
        context.log.warning(f"data/raw/{name}/ is not a dataset partition: {reason}")
    known = set(context.instance.get_dynamic_partitions(DATASETS))
    new = [name for name in discover_datasets(raw_dir) if name not in known]
    if not new:
        return dg.SkipReason("no new dataset folders")
    context.log.info(f"adding dataset partitions {new}")
    return dg.SensorResult(dynamic_partitions_requests=[dataset_partitions.build_add_request(new)])


# Dagster's implicit automation sensor starts stopped; this one runs by default, so the
# selection chain (eager conditions) follows its parents as soon as `dagster dev` runs.
selection_automation_sensor = dg.AutomationConditionSensorDefinition(
    "selection_automation_sensor",
    target=dg.AssetSelection.groups("selection", "inspection"),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=60,
    description="Evaluates the eager automation conditions of the selection and inspection assets.",
)
