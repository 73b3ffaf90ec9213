"""Real runs from a shell, for the end-to-end tests of how runs start, exclude each other and
die: a data folder and Dagster instance of their own (the project's dagster.yaml), the
``dagster`` CLI started as a user would, and the processes it starts found by what they run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import psutil
import yaml

from cluster_pipeline.cli.register import prepare_instance_home
from cluster_pipeline.data.datasets import discover_datasets
from cluster_pipeline.defs.partitions import DATASETS
from cluster_pipeline_tests.helpers import RUN_CONFIG, tiny_records, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
T = TypeVar("T")

EMBED = "cluster_pipeline.recipes.embed"
TRAIN = "cluster_pipeline.recipes.train"
EVALUATE = "cluster_pipeline.recipes.evaluate"
LAUNCH = "cluster_pipeline.launch.launcher"
WATCHDOG = "cluster_pipeline.defs.run_watchdog"


@dataclass
class Project:
    """A data folder with datasets, a Dagster instance (``home``) and the environment a shell
    would run ``dagster`` in."""

    root: Path
    data: Path
    home: Path
    env: dict[str, str]

    @classmethod
    def create(
        cls, root: Path, model_dir: Path, datasets: tuple[str, ...] = ("tiny",), records: int = 60
    ) -> Project:
        data, home = root / "data", root / "home"
        for name in datasets:
            write_jsonl(data / "raw" / name / "samples.jsonl", tiny_records(records))
        env = {
            **os.environ,
            "DAGSTER_HOME": str(home),
            "CLUSTER_PIPELINE_DATA_DIR": str(data),
            "CLUSTER_PIPELINE_BASE_MODEL": str(model_dir),
        }
        env.pop("CLUSTER_PIPELINE_RUN_GUARD", None)
        project = cls(root, data, home, env)
        # What `cluster-pipeline datasets sync` does (cli/register.py; the CLI's own tests are in
        # defs/test_operations.py), in this process rather than a new one: the project's
        # dagster.yaml installed into DAGSTER_HOME and a partition per dataset registered.
        prepare_instance_home(home)
        with project.instance() as instance:
            instance.add_dynamic_partitions(DATASETS, list(discover_datasets(data / "raw")))
        return project

    def cli(self, *args: str, check: bool = False, timeout: float = 600, **env: str):
        """Run ``.venv/bin/<args[0]> args[1:]``; CompletedProcess with stdout+stderr as text."""
        program = BIN / args[0] if (BIN / args[0]).exists() else args[0]
        out = subprocess.run(
            [str(program), *args[1:]],
            cwd=ROOT,
            env={**self.env, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        if check:
            assert out.returncode == 0, out.stdout[-5000:]
        return out

    def config(self, name: str, stages: list[str], execution: dict | None = None, **over) -> Path:
        """A run config file: :data:`RUN_CONFIG` of ``stages``, each updated by ``over[stage]``,
        and executor config ``execution``."""
        ops = {
            s: {"config": {**RUN_CONFIG["ops"].get(s, {}).get("config", {}), **over.get(s, {})}}
            for s in stages
        }
        body: dict[str, Any] = {"ops": ops}
        if execution is not None:
            body["execution"] = {"config": execution}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(body))
        return path

    def materialize_args(self, select: str, config: Path | None, partition: str = "tiny"):
        args = ["dagster", "asset", "materialize", "-m", "cluster_pipeline.definitions"]
        args += ["--select", select, "--partition", partition]
        return args + (["-c", str(config)] if config else [])

    def materialize(self, select: str, config: Path | None = None, partition: str = "tiny", **kw):
        """``dagster asset materialize`` to the end (CompletedProcess)."""
        return self.cli(*self.materialize_args(select, config, partition), **kw)

    def start_materialize(
        self, select: str, config: Path | None = None, partition: str = "tiny", log: str = "run"
    ) -> subprocess.Popen:
        """``dagster asset materialize`` in the background; its output goes to
        ``<root>/<log>.log``."""
        args = self.materialize_args(select, config, partition)
        return subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            cwd=ROOT,
            env=self.env,
            stdout=(self.root / f"{log}.log").open("w"),
            stderr=subprocess.STDOUT,
        )

    def log(self, name: str = "run") -> str:
        return (self.root / f"{name}.log").read_text()

    def instance(self) -> dg.DagsterInstance:
        return dg.DagsterInstance.from_config(str(self.home))

    def __enter__(self) -> Project:
        return self

    def __exit__(self, *exc) -> None:
        """Kill whatever the test left running on this project (a failed test's run)."""
        for proc in processes(lambda p: any(str(self.root) in c for c in p.cmdline())):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()

    def mine(self, proc: psutil.Process) -> bool:
        """Whether ``proc`` works on this project's data (its command line names the folder)."""
        return any(str(self.data) in c for c in proc.cmdline())


def wait_for(probe: Callable[[], T | None], timeout: float, what: str, poll: float = 0.2) -> T:
    """``probe()``'s first true value, polled until ``timeout`` seconds.

    Raises:
        AssertionError: it never came (``what`` says what was awaited).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def processes(match: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """Running processes (not zombies) that ``match`` accepts."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and match(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def runs_module(module: str, project: Project, launcher: bool = False):
    """A matcher: a process running ``module`` (a rank; with ``launcher``, its torchrun
    launcher) on ``project``'s data."""

    def match(proc: psutil.Process) -> bool:
        cmdline = proc.cmdline()
        is_launcher = any(LAUNCH in c for c in cmdline)
        return module in cmdline and is_launcher == launcher and project.mine(proc)

    return match


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def seconds_until_gone(pids: list[int], timeout: float = 60) -> float:
    """Seconds until every one of ``pids`` has exited (measured from now). Prints when each
    went, with its command line, so that a slow link of a fate-sharing chain names itself.

    Raises:
        AssertionError: some are still running after ``timeout`` (names them).
    """
    start = time.monotonic()
    names = {}
    for pid in pids:
        try:
            names[pid] = " ".join(psutil.Process(pid).cmdline())[:100]
        except psutil.Error:
            names[pid] = "?"
    went: dict[int, float] = {}
    while left := alive(pids):
        now = time.monotonic() - start
        went.update({p: now for p in pids if p not in left and p not in went})
        if now > timeout:
            raise AssertionError(
                f"still running after {timeout:.0f} s: { ({p: names[p] for p in left}) }"
            )
        time.sleep(0.05)
    total = time.monotonic() - start
    went.update({p: total for p in pids if p not in went})
    for pid, seconds in sorted(went.items(), key=lambda item: item[1]):
        print(f"  gone after {seconds:5.2f} s: pid {pid} {names[pid]}")
    return total


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def run_of(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRun:
    run = instance.get_run_by_id(run_id)
    assert run is not None, run_id
    return run


def failure_message(instance: dg.DagsterInstance, run_id: str) -> str:
    """The message of the run's failure event ('' when it has none)."""
    for event in instance.all_logs(run_id, of_type=dg.DagsterEventType.RUN_FAILURE):
        return event.message or (event.dagster_event.message if event.dagster_event else "") or ""
    return ""
