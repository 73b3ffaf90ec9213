"""The project's one :class:`dagster.Definitions`: the stages under ``defs/`` plus resources (data
folder, base model, torchrun, Pipes, MLflow tracking) and the executor (Dagster's multiprocess
executor that also checks a run's settings, holds its dataset partition and watches its worker:
``defs/executor.py``)."""

from pathlib import Path

import dagster as dg

from cluster_pipeline.defs.executor import partition_locked_executor
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    StorageResource,
    TorchrunResource,
    TrackingResource,
)


@dg.definitions
def defs() -> dg.Definitions:
    """The one Definitions: the ``defs/`` folder's assets, checks, jobs, schedules and sensors,
    the resources and the multiprocess executor."""
    return dg.Definitions.merge(
        dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
        dg.Definitions(
            resources={
                "storage": StorageResource(),
                "base_model": BaseModelResource(),
                "torchrun": TorchrunResource(),
                "pipes_subprocess_client": dg.PipesSubprocessClient(),
                "tracking": TrackingResource(),
            },
            executor=partition_locked_executor,
        ),
    )
