"""The launcher interface: how a stage's torchrun job is started, watched and stopped, and what a
failed launch says (docs/design.md, "Launchers").

A :class:`Launcher` runs one torchrun entry point (``python -m <module> --config <job file>``)
on ``nproc_per_node`` ranks per torchrun agent and returns a :class:`LaunchOutcome`: what the
run records when it succeeded, or a :class:`LaunchFailure` (one line of cause, each failed
rank's error and log tail, where the per-rank logs are, the launcher's own details) that the
Dagster side turns into one ``dagster.Failure`` the same way for every launcher
(``defs/resources.py``, ``TorchrunResource``). A launch it cannot even start or follow (sbatch
refused the job) raises :class:`LaunchError`. Rank 0 talks to Dagster Pipes through the
environment the caller gives; a launcher whose ranks run on other machines names a folder
they share (:meth:`Launcher.channel_dir`) and Pipes passes through files there.

Each launcher is one class in one module of this package, registered by its ``name``, which is
the ``launcher`` knob of the torchrun resource: :class:`~cluster_pipeline.launch.local.
Standalone` and :class:`~cluster_pipeline.launch.local.Rendezvous` (this machine, alone or as one
node of a multi-node rendezvous) and :class:`~cluster_pipeline.launch.slurm.Slurm` (a batch job).
Kubernetes or Ray would be one more module here. Nothing here imports Dagster.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self

from pydantic import BaseModel

import cluster_pipeline.launch as _package


class LaunchError(RuntimeError):
    """A launch that could not be started or followed (not a rank's failure: a submission
    refused, a scheduler that forgot the job, a missing rendezvous endpoint)."""


@dataclass(frozen=True)
class LaunchSpec:
    """One launch.

    Attributes:
        module: the entry point (``cluster_pipeline.recipes.train``).
        nproc_per_node: ranks per torchrun agent.
        job_file: its ``--config``; logs and job folders are made beside it.
        run_id: the Dagster run it belongs to (names a job folder), '' outside a run.
        cwd: the ranks' working directory (None: this process's).
        stop_timeout_s: how long a stopped launch may take to end before it is killed.
    """

    module: str
    nproc_per_node: int
    job_file: Path
    run_id: str = ""
    cwd: str | None = None
    stop_timeout_s: float = 60.0

    @property
    def args(self) -> list[str]:
        """The entry point's arguments."""
        return ["--config", str(self.job_file)]


@dataclass(frozen=True)
class LaunchFailure:
    """What a failed launch says.

    Attributes:
        cause: one line: what failed first (``rank_1 failed first: ...``, or the launcher's
            own death or the job's state).
        log_dir: where the per-rank logs are.
        ranks: each failed rank's error and log tail, the first failure first.
        details: short facts of the launcher (exit status; Slurm's job id and state).
        texts: long texts of the launcher, shown as code (Slurm's output tail).
        note: said after the first line (the end of a job's output when no rank left an
            error), '' for nothing.
    """

    cause: str
    log_dir: Path
    ranks: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, str | int] = field(default_factory=dict)
    texts: Mapping[str, str] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class LaunchOutcome:
    """A finished launch: ``failure`` (None when every rank succeeded) and what the run
    records about the launch (Slurm's job id)."""

    failure: LaunchFailure | None = None
    metadata: Mapping[str, str | int] = field(default_factory=dict)


class Launcher(ABC):
    """Starts a torchrun job, waits for it and stops it when the caller is interrupted.

    A subclass is a dataclass whose fields are knobs of the torchrun resource by the same
    name (:meth:`from_knobs`), with a ``name`` (the resource's ``launcher`` value), an
    ``order`` (where the launchpad lists it) and ``knobs``: a pydantic class of the knobs it
    adds to the resource (bounds and help text; :func:`knob_classes`), None for none.
    """

    name: ClassVar[str]
    order: ClassVar[int] = 100
    # The ranks run on other machines: this machine's memory says nothing about theirs.
    remote: ClassVar[bool] = False
    knobs: ClassVar[type[BaseModel] | None] = None

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, Any]) -> Self:
        """The launcher from the torchrun resource's knobs (those it has no field for
        ignored)."""
        names = {f.name for f in fields(cls)}  # pyright: ignore[reportArgumentType]
        return cls(**{k: v for k, v in knobs.items() if k in names})

    @property
    @abstractmethod
    def agents(self) -> int:
        """Torchrun agents (nodes) the ranks are split over."""

    def channel_dir(self, spec: LaunchSpec) -> Path | None:
        """A folder the ranks share with this process, through which Dagster Pipes talks to
        rank 0 (files); None: through the environment (a process started here). Made empty
        by :meth:`prepare`."""
        return None

    @abstractmethod
    def prepare(self, spec: LaunchSpec) -> Path:
        """Make the launch's log folder (an earlier launch's logs removed, they would be
        misread) and return it."""

    @abstractmethod
    def run(
        self,
        spec: LaunchSpec,
        log_dir: Path,
        env: Mapping[str, str],
        log: Callable[[str], None],
    ) -> LaunchOutcome:
        """Start the launch with the environment ``env``, wait for it (``log`` receives its
        progress lines) and return its outcome. An interrupt while waiting (a Dagster run's
        termination) stops the launch before it propagates.

        Raises:
            LaunchError: the launch could not be started or followed.
        """


def launchers() -> dict[str, type[Launcher]]:
    """Every launcher class of this package's modules, by name, in their ``order``.

    Raises:
        ImportError: two launchers of one name.
    """
    for module in pkgutil.iter_modules(_package.__path__):
        importlib.import_module(f"{_package.__name__}.{module.name}")
    found: dict[str, type[Launcher]] = {}
    pending: list[type[Launcher]] = list(Launcher.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "name" in vars(cls):
            if cls.name in found and found[cls.name] is not cls:
                raise ImportError(f"two launchers are named {cls.name!r}")
            found[cls.name] = cls
    return dict(sorted(found.items(), key=lambda item: item[1].order))


def knob_classes() -> tuple[type[BaseModel], ...]:
    """Every launcher's knob class, once each, in launcher order: the torchrun resource's
    knobs beside ``launcher``."""
    out: list[type[BaseModel]] = []
    for cls in launchers().values():
        if cls.knobs is not None and cls.knobs not in out:
            out.append(cls.knobs)
    return tuple(out)
