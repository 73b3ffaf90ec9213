"""Launching a torchrun entry point from an asset through Dagster Pipes."""

import shutil
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterPipesExecutionError

from cluster_pipeline.defs.resources import TorchrunResource, rank_failures


def run_torchrun(
    context: dg.AssetExecutionContext,
    pipes_client: dg.PipesSubprocessClient,
    torchrun: TorchrunResource,
    module: str,
    nproc_per_node: int,
    config_path: Path,
) -> dg.PipesClientCompletedInvocation:
    """Run ``torchrun ... -m module --config config_path``; rank 0 reports through Pipes.

    Every rank's output is teed to ``<config_path>.logs/``. If the launch fails, the raised
    :class:`dagster.Failure` names the failed ranks and carries each one's error and log tail as
    metadata, so the Dagster UI shows which rank failed and why.
    """
    log_dir = Path(f"{config_path}.logs")
    shutil.rmtree(log_dir, ignore_errors=True)  # an earlier launch's logs would be misread
    log_dir.mkdir(parents=True)
    command = torchrun.command(module, nproc_per_node, ["--config", str(config_path)], log_dir)
    try:
        return pipes_client.run(context=context, command=command)
    except DagsterPipesExecutionError as e:
        failures = rank_failures(log_dir)
        if failures:
            rank, text = next(iter(failures.items()))
            cause = f"{rank} failed first: {text.strip().splitlines()[0]}"
            others = [r for r in failures if r != rank]
            if others:
                cause += f" (then {', '.join(others)})"
        else:
            cause = str(e)
        raise dg.Failure(
            description=f"{module}: {cause}. Per-rank logs: {log_dir}",
            metadata={
                **{name: dg.MetadataValue.md(f"```\n{text}\n```") for name, text in failures.items()},
                "log_dir": dg.MetadataValue.path(str(log_dir)),
            },
        ) from e
