"""Launchers that start torchrun on this machine (launch/base.py): alone (``standalone``), or
as one node of a multi-node c10d rendezvous started by hand on every node (``rendezvous``).

The launch is :mod:`cluster_pipeline.launch.launcher` (a torchrun that dies with the step that
started it) with every rank's output teed to ``<job file>.logs/``; a run's termination reaches
the waiting step as an interrupt, which sends torchrun SIGINT (it stops its ranks) and SIGKILL
if it has not ended in time. A failed launch is read back from those logs
(:func:`~cluster_pipeline.launch.torchrun.rank_failures`), or from the launcher's exit status
when no rank left a trace.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, Field

from cluster_pipeline.launch.base import (
    Launcher,
    LaunchError,
    LaunchFailure,
    LaunchOutcome,
    LaunchSpec,
)
from cluster_pipeline.launch.torchrun import (
    failure_summary,
    rank_failures,
    rank_threads,
    signal_cause,
    torchrun_command,
)
from cluster_pipeline.storage.disk import full_disk_note


class RendezvousKnobs(BaseModel):
    """The torchrun resource's knobs of a launch over machines (nodes)."""

    nnodes: int = Field(default=1, ge=1, description="Number of machines (Slurm: sbatch --nodes).")
    node_rank: int = Field(
        default=0, description="This machine's rank among nnodes (not used under Slurm)."
    )
    rdzv_endpoint: str = Field(
        default="",
        description="host:port of the c10d rendezvous for multi-node runs; empty = --standalone. "
        "Not used under Slurm (the job's first node hosts it).",
    )
    rdzv_id: str = Field(default="cluster_pipeline", description="Rendezvous job id.")


@dataclass(frozen=True)
class Standalone(Launcher):
    """This machine (``--standalone``), or, with ``rdzv_endpoint`` set, node ``node_rank`` of
    ``nnodes`` joining that c10d rendezvous (as before the ``launcher`` knob existed)."""

    name: ClassVar[str] = "standalone"
    order: ClassVar[int] = 0
    knobs: ClassVar[type[BaseModel] | None] = RendezvousKnobs

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = "cluster_pipeline"

    @property
    def agents(self) -> int:
        """``nnodes``: one torchrun agent per machine."""
        return self.nnodes

    def command(
        self, module: str, nproc_per_node: int, args: list[str], log_dir: Path | None = None
    ) -> list[str]:
        """The torchrun command line running ``python -m module args`` on ``nproc_per_node``
        ranks here (:func:`~cluster_pipeline.launch.torchrun.torchrun_command`).

        Raises:
            ValueError: several nodes without a rendezvous endpoint.
        """
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

    def prepare(self, spec: LaunchSpec) -> Path:
        """``<job file>.logs/``, emptied."""
        log_dir = Path(f"{spec.job_file}.logs")
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir.mkdir(parents=True)
        return log_dir

    def run(
        self,
        spec: LaunchSpec,
        log_dir: Path,
        env: Mapping[str, str],
        log: Callable[[str], None],
    ) -> LaunchOutcome:
        """Run torchrun here (module docstring); its ranks' threads split this machine's CPUs
        unless ``env`` sets ``OMP_NUM_THREADS``."""
        try:
            command = self.command(spec.module, spec.nproc_per_node, spec.args, log_dir)
        except ValueError as e:
            raise LaunchError(str(e)) from e
        process = subprocess.Popen(
            command, cwd=spec.cwd, env={**rank_threads(spec.nproc_per_node), **env}
        )
        try:
            code = process.wait()
        except BaseException:
            log(f"interrupted: stopping torchrun (pid {process.pid})")
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=spec.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise
        if code == 0:
            return LaunchOutcome()
        failures = rank_failures(log_dir)
        # No rank left a trace: the launcher itself died (its exit status says how).
        died = signal_cause(code)
        cause = failure_summary(failures) or (
            f"the torchrun launcher was {died}"
            if died
            else f"the torchrun launcher exited with status {code}"
        )
        # A full disk leaves ranks unable to write their error (an empty error.json): say it.
        disk = full_disk_note([log_dir, spec.job_file.parent])
        if disk is not None:
            cause = f"{cause} ({disk})"
        return LaunchOutcome(LaunchFailure(cause, log_dir, failures, {"exit_status": code}))


@dataclass(frozen=True)
class Rendezvous(Standalone):
    """This machine as node ``node_rank`` of ``nnodes`` joining the c10d rendezvous at
    ``rdzv_endpoint`` (started by hand on every node, each with its ``node_rank``)."""

    name: ClassVar[str] = "rendezvous"
    order: ClassVar[int] = 1

    def prepare(self, spec: LaunchSpec) -> Path:
        """As :meth:`Standalone.prepare`, once the endpoint is known.

        Raises:
            LaunchError: no ``rdzv_endpoint``.
        """
        if not self.rdzv_endpoint:
            raise LaunchError("launcher: rendezvous needs rdzv_endpoint (host:port of node 0)")
        return super().prepare(spec)
