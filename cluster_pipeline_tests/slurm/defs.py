"""Definitions for the Slurm tests: one asset that runs :mod:`cluster_pipeline_tests.slurm.entry`
through ``TorchrunResource`` with the Slurm launcher (two agents on the one test node), under
the project's multiprocess executor, so ``dagster asset materialize -m`` can run it."""

import json
from pathlib import Path

import dagster as dg

from cluster_pipeline.defs.resources import TorchrunResource

ENTRY = "cluster_pipeline_tests.slurm.entry"


class EntryConfig(dg.Config):
    behaviour: str = "sleep"
    job_dir: str


@dg.asset
def slurm_entry(
    context: dg.AssetExecutionContext,
    config: EntryConfig,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> None:
    job_file = Path(config.job_dir) / "entry_job.json"
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(json.dumps({"behaviour": config.behaviour}))
    torchrun.run(context, pipes_subprocess_client, ENTRY, 1, job_file)


def slurm_torchrun() -> TorchrunResource:
    """Two torchrun agents (torchrun nnodes = 2) on the one node of the test cluster."""
    return TorchrunResource(launcher="slurm", slurm_agents_per_node=2, slurm_poll_seconds=0.5)


defs = dg.Definitions(
    assets=[slurm_entry],
    resources={
        "torchrun": slurm_torchrun(),
        "pipes_subprocess_client": dg.PipesSubprocessClient(),
    },
    executor=dg.multiprocess_executor,
)
