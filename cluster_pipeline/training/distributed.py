"""What every torchrun entry point shares: rank discovery, process group, fate-sharing with the
parent, and a rank-0-only channel back to Dagster through Pipes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from cluster_pipeline.launch.fate import die_with_parent
from cluster_pipeline.launch.progress import Heartbeat
from cluster_pipeline.storage.job_files import JobFile, JobFileError

J = TypeVar("J", bound=JobFile)


@dataclass(frozen=True)
class DistEnv:
    """RANK / LOCAL_RANK / WORLD_SIZE as set by torchrun (0 / 0 / 1 for a plain process)."""

    rank: int
    local_rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that logs, reports and saves."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """This rank's device: its GPU (LOCAL_RANK) where CUDA is available, else the CPU."""
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Read the torchrun environment and, when launched by torchrun, join the process group
    (nccl on CUDA, gloo otherwise)."""
    env = DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )
    die_with_parent()
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return env


def shutdown_distributed() -> None:
    """Leave the process group (if joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def step_eta(done: int, left: int, seconds: float) -> str:
    """``", ETA 42 s"`` for a progress line: the ``left`` steps (or samples) at the mean time
    of the ``done`` ones (``seconds`` of wall time in all); empty when none is done or none is
    left."""
    if done <= 0 or left <= 0:
        return ""
    return f", ETA {left * seconds / done:.0f} s"


class Reporter:
    """Rank 0's voice: logs and metadata go to Dagster through Pipes when the process was
    launched by a Pipes client, and to stdout otherwise. Other ranks stay silent. Its
    :class:`Heartbeat` (running while :func:`reporter`'s block runs) says what still runs
    when nothing was logged for :data:`~cluster_pipeline.launch.progress.HEARTBEAT_S` seconds."""

    def __init__(self, env: DistEnv, pipes=None):
        self.env = env
        self.pipes = pipes
        self.heartbeat = Heartbeat(self._info)

    def _info(self, message: str) -> None:
        if self.pipes is not None:
            self.pipes.log.info(message)
        else:
            print(message, flush=True)

    def info(self, message: str) -> None:
        """Log ``message`` from rank 0 (Pipes, else stdout)."""
        if self.env.is_main:
            self.heartbeat.say(message)

    def doing(self, what: str, say: bool = True) -> None:
        """``what`` runs from now on: logged (unless ``say`` is False) from rank 0, and named
        by the heartbeat while nothing else is said."""
        if self.env.is_main:
            self.heartbeat.doing(what, say)

    def _warning(self, message: str) -> None:
        if self.pipes is not None:
            self.pipes.log.warning(message)
        else:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def warning(self, message: str) -> None:
        """Log ``message`` as a warning from rank 0 (Pipes, else stderr)."""
        if self.env.is_main:
            self.heartbeat.say(message, self._warning)

    def materialization(self, metadata: dict) -> None:
        """Report the asset's materialization metadata from rank 0 (Pipes, else stdout as JSON)."""
        if not self.env.is_main:
            return
        if self.pipes is not None:
            self.pipes.report_asset_materialization(metadata=metadata)
        else:
            print(json.dumps({"materialization": metadata}, default=str), flush=True)


@contextlib.contextmanager
def reporter(env: DistEnv) -> Iterator[Reporter]:
    """Open Dagster Pipes on rank 0 if this process runs under a Pipes client; rank 0's
    heartbeat runs while the block does."""
    if env.is_main and "DAGSTER_PIPES_CONTEXT" in os.environ:
        from dagster_pipes import open_dagster_pipes

        with open_dagster_pipes() as pipes:
            report = Reporter(env, pipes)
            with report.heartbeat.running():
                yield report
    else:
        report = Reporter(env)
        if env.is_main:
            with report.heartbeat.running():
                yield report
        else:
            yield report


def all_gather_floats(values: list[float], env: DistEnv) -> list[list[float]]:
    """Gather a short list of floats from every rank (rank order); identity on one process."""
    t = torch.tensor(values, dtype=torch.float64)
    if env.world_size == 1 or not dist.is_initialized():
        return [t.tolist()]
    if dist.get_backend() == "nccl":
        t = t.to(env.device)
    out = [torch.zeros_like(t) for _ in range(env.world_size)]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]


def run_entry_point(
    job_cls: type[J],
    body: Callable[[J, DistEnv, Reporter], None],
    argv: list[str] | None,
    description: str,
) -> None:
    """The shared ``main`` of a torchrun entry point: read ``--config`` as a ``job_cls`` job
    file (validated), join the process group, run ``body`` with rank 0's reporter, and leave
    the group. Call it from a ``main`` wrapped in torch's ``@record``.

    Raises:
        JobFileError: under torchrun, a job file that cannot be read or is invalid (recorded
            by ``@record`` for the launch's failure summary). Run without torchrun, the same
            message goes to stderr as argparse's error and the process exits with status 2.
    """
    parser = argparse.ArgumentParser(
        description=description.splitlines()[0] if description else None
    )
    parser.add_argument("--config", required=True, help=f"{job_cls.__name__} JSON file")
    args = parser.parse_args(argv)
    try:
        job = job_cls.load(args.config)
    except JobFileError as e:
        # Under torchrun, @record writes the error to the file the launch's failure summary
        # reads (``TORCHELASTIC_ERROR_FILE``): raise. Run by hand, argparse's one-line error
        # and exit status 2, not a traceback before the message.
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            raise
        parser.error(str(e))
    # Every rank would print transformers' "Loading weights" bar into the run's logs, several
    # lines per model load and rank; the stages report their own progress instead.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # peft reads transformers' deprecated ``is_gradient_checkpointing`` whenever it wraps a
    # model (LoRA training, less's warm-up checkpoints): one FutureWarning per rank and adapter
    # in the run's log, which users cannot act on; only that one is silenced.
    warnings.filterwarnings(
        "ignore",
        message=r"`is_gradient_checkpointing` is deprecated",
        category=FutureWarning,
    )
    env = init_distributed()
    # On success, leave the process group cleanly; on an error, exit without tearing it down
    # first, so the peers' errors do not race ahead of this rank's own (see @record).
    with reporter(env) as report:
        body(job, env, report)
    shutdown_distributed()
