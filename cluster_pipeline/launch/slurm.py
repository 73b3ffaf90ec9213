r"""A torchrun entry point as a Slurm batch job: one torchrun agent per Slurm task, c10d
rendezvous on the job's first node, state polled with ``squeue``/``sacct``, ``scancel`` to stop.

The batch script (``job.sbatch``) runs, on the job's first node::

    srun --ntasks-per-node=A --kill-on-bad-exit=1 bash agent.sh

and every task's ``agent.sh`` runs the same launcher as the local launches
(:func:`~cluster_pipeline.launch.torchrun.torchrun_command`)::

    python -m cluster_pipeline.launch.launcher --nnodes=N*A --node_rank=$SLURM_PROCID \\
        --rdzv_backend=c10d --rdzv_endpoint=<first node>:<port> --rdzv_id=$SLURM_JOB_ID \\
        --log-dir=<log_dir>/agent<SLURM_PROCID>-<node> ... -m <module> --config <job file>

``A`` (agents per node) is 1 on a real cluster; more than one lets a one-node test cluster run
a multi-node rendezvous. The job inherits the submitting process's environment (sbatch's
default ``--export=ALL``): Python, ``PYTHONPATH`` and Dagster Pipes' variables, whose files lie
in the shared job folder. Every path the job touches (the Python environment, the code, the
data folder, the job folder) must be on a filesystem all nodes share.

Why not the community ``dagster-slurm`` package (1.22, checked for this module): it reaches
Slurm over SSH from an edge node and ships the environment with ``pixi pack``, adds
dependencies the project's lock does not have (loguru, pexpect), and its launchers are a
script, Ray and Spark, not a multi-node torchrun; the rendezvous and per-rank failure reading
below would still be ours. Here the Dagster step runs where ``sbatch`` works and shares a
filesystem with the nodes, so a thin launcher on Slurm's own commands is enough and offline.

A Dagster step that is killed outright (SIGKILL, or SIGTERM sent to the step process itself)
runs no ``finally``; :func:`cancelled_with_parent` leaves a small guard process behind it that
``scancel``s the job when the step dies (``python -m cluster_pipeline.launch.slurm guard``).

:class:`SlurmLauncher` is the launcher (launch/base.py) behind the torchrun resource's
``launcher: slurm``. Nothing here imports Dagster; the Dagster side (Pipes session, Failure) is
:meth:`cluster_pipeline.defs.resources.TorchrunResource.run`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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
from cluster_pipeline.launch.fate import LAUNCHER_PID_ENV, die_with_parent
from cluster_pipeline.launch.torchrun import (
    failure_summary,
    ranked_failures,
    read_rank_exits,
    torchrun_command,
)

# Job states after which the job runs no more (squeue/sacct spelling).
FAILED_STATES = {
    "FAILED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "CANCELLED",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
DONE_STATES = {"COMPLETED", *FAILED_STATES}
# What a failed state means, in words that say what to do.
STATE_CAUSES = {
    "TIMEOUT": "the job ran past its time limit (raise slurm_time_limit)",
    "OUT_OF_MEMORY": "a node ran out of memory (ask for more with slurm_sbatch_args "
    "['--mem=...'] or lower the batch size)",
    "NODE_FAIL": "a node failed (Slurm lost contact with it)",
    "CANCELLED": "the job was cancelled (scancel, or an administrator)",
    "PREEMPTED": "the job was preempted by a higher-priority job",
    "BOOT_FAIL": "a node failed to boot",
    "DEADLINE": "the job missed its deadline",
}
BATCH_SCRIPT = "job.sbatch"
AGENT_SCRIPT = "agent.sh"
# Written by the batch script when it ends: its exit status (the state when Slurm forgot it).
BATCH_EXIT = "batch_exit"
# torchrun arguments that the shell of each Slurm task fills in (double-quoted, not escaped).
_EXPANDED = ("--node_rank=", "--rdzv_endpoint=", "--rdzv_id=", "--log-dir=")


class SlurmError(RuntimeError):
    """A Slurm command failed (not the job: the submission, the query, the cancellation)."""


@dataclass(frozen=True)
class SlurmSpec:
    """What the batch job asks Slurm for.

    ``nodes``: sbatch ``--nodes``; ``agents_per_node``: torchrun agents (Slurm tasks) per node,
    so torchrun's nnodes is ``nodes * agents_per_node``; ``partition`` and ``time_limit``
    (Slurm's ``[D-]HH:MM:SS``) are left to the cluster's defaults when empty; ``sbatch_args`` are
    passed as they are (``--gres=gpu:8``, ``--account=...``); ``rdzv_port``: the rendezvous TCP
    port on the first node, 0 = derived from the job id (20000-39999) so that jobs sharing a
    node do not collide.
    """

    nodes: int = 1
    agents_per_node: int = 1
    partition: str = ""
    time_limit: str = ""
    sbatch_args: tuple[str, ...] = ()
    rdzv_port: int = 0
    job_name: str = "cluster_pipeline"

    @property
    def agents(self) -> int:
        """Torchrun agents in the job: nodes x agents per node."""
        return self.nodes * self.agents_per_node


@dataclass(frozen=True)
class JobState:
    """One look at a job: its state (``RUNNING``, ``COMPLETED``, ...), nodes and Slurm's reason
    (why pending, or why it failed)."""

    state: str
    nodes: str = ""
    reason: str = ""

    @property
    def done(self) -> bool:
        """Whether the job has ended (any terminal state)."""
        return self.state in DONE_STATES

    @property
    def failed(self) -> bool:
        """Whether the job ended in a failed state (FAILED, TIMEOUT, OUT_OF_MEMORY, ...)."""
        return self.state in FAILED_STATES


def write_scripts(
    spec: SlurmSpec,
    job_dir: Path,
    module: str,
    nproc_per_node: int,
    args: Sequence[str],
    log_dir: Path,
) -> Path:
    """Write ``job.sbatch`` and ``agent.sh`` into ``job_dir``; returns the batch script's path.

    ``nproc_per_node``: ranks per agent; the world size is ``spec.agents * nproc_per_node``.

    Raises:
        ValueError: ``spec.nodes`` or ``spec.agents_per_node`` < 1, or ``nproc_per_node`` < 1.
    """
    if spec.nodes < 1 or spec.agents_per_node < 1:
        raise ValueError(
            f"nodes and agents_per_node must be >= 1, got {spec.nodes} and {spec.agents_per_node}"
        )
    command = torchrun_command(
        module,
        nproc_per_node,
        list(args),
        nnodes=spec.agents,
        node_rank="$SLURM_PROCID",
        rdzv_endpoint="$CLUSTER_PIPELINE_RDZV_ENDPOINT",
        rdzv_id="$SLURM_JOB_ID",
        log_dir=f"{log_dir}/agent$SLURM_PROCID-$SLURMD_NODENAME",
    )
    agent = job_dir / AGENT_SCRIPT
    agent.write_text(
        "#!/bin/bash\n"
        "# One torchrun agent per Slurm task; its node rank is the task's rank.\n"
        "set -eu\n"
        f'mkdir -p "{log_dir}/agent$SLURM_PROCID-$SLURMD_NODENAME"\n'
        f"exec {' '.join(_shell_word(w) for w in command)}\n"
    )
    port = str(spec.rdzv_port) if spec.rdzv_port else "$((20000 + SLURM_JOB_ID % 20000))"
    script = job_dir / BATCH_SCRIPT
    script.write_text(
        "#!/bin/bash\n"
        f"# {module}: {spec.agents} torchrun agents x {nproc_per_node} ranks.\n"
        f"trap 'echo $? > {shlex.quote(str(job_dir / BATCH_EXIT))}' EXIT\n"
        "set -eu\n"
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n'
        f'export CLUSTER_PIPELINE_RDZV_ENDPOINT="$head:{port}"\n'
        'echo "rendezvous on $CLUSTER_PIPELINE_RDZV_ENDPOINT, nodes $SLURM_JOB_NODELIST"\n'
        f"srun --nodes={spec.nodes} --ntasks-per-node={spec.agents_per_node} "
        f"--kill-on-bad-exit=1 bash {shlex.quote(str(agent))}\n"
    )
    return script


def _shell_word(word: str) -> str:
    """A torchrun argument for the agent script: the few that name the task's variables are
    double-quoted (the shell expands them), everything else is quoted literally."""
    if word.startswith(_EXPANDED):
        return f'"{word}"'
    return shlex.quote(word)


def sbatch_command(spec: SlurmSpec, script: Path, job_dir: Path) -> list[str]:
    """``sbatch --parsable ... job.sbatch``: output to ``job_dir/slurm-<job id>.out``, run in
    the current directory."""
    command = [
        "sbatch",
        "--parsable",
        f"--job-name={spec.job_name}",
        f"--nodes={spec.nodes}",
        f"--ntasks-per-node={spec.agents_per_node}",
        f"--output={job_dir}/slurm-%j.out",
        f"--chdir={os.getcwd()}",
    ]
    if spec.partition:
        command.append(f"--partition={spec.partition}")
    if spec.time_limit:
        command.append(f"--time={spec.time_limit}")
    return [*command, *spec.sbatch_args, str(script)]


def _slurm(command: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """Run a Slurm client command; its stdout.

    Raises:
        SlurmError: the program is missing, failed or hung for 60 s (its stderr is quoted).
    """
    try:
        out = subprocess.run(
            list(command),
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError as e:
        raise SlurmError(
            f"{command[0]} not found: run the Dagster step on a Slurm login/submit node "
            "(or install slurm-client) to use launcher: slurm"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise SlurmError(f"{' '.join(command)} hung for 60 s (is slurmctld up?)") from e
    if out.returncode != 0:
        raise SlurmError(f"{' '.join(command)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def submit(spec: SlurmSpec, script: Path, job_dir: Path, env: Mapping[str, str]) -> str:
    """Submit the batch script with ``env`` as the job's environment; returns the job id.

    Raises:
        SlurmError: sbatch refused the job (its message says why: partition, time limit, ...).
    """
    out = _slurm(sbatch_command(spec, script, job_dir), env)
    return out.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"


def _parse_state(out: str) -> JobState:
    """The first ``state|nodes|reason`` line of squeue's or sacct's output ("CANCELLED by 0"
    -> CANCELLED; Slurm's reason "None" -> "")."""
    state, nodes, reason = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
    return JobState((state.split() or [""])[0], nodes, "" if reason == "None" else reason)


def job_state(job_id: str, job_dir: Path) -> JobState | None:
    """The job's state from ``squeue`` (which keeps finished jobs for MinJobAge), else from
    ``sacct`` (accounting, where configured), else from the exit status the batch script left in
    ``job_dir``; None while none of them knows the job (just submitted)."""
    try:
        out = _slurm(["squeue", "-h", "-j", job_id, "--states=all", "-o", "%T|%N|%r"])
        if out.strip():
            return _parse_state(out)
    except SlurmError:
        pass  # "Invalid job id": slurmctld has forgotten the job
    try:
        out = _slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,NodeList,Reason"])
        if out.strip():
            return _parse_state(out)
    except SlurmError:
        pass  # no accounting storage on this cluster
    exit_file = job_dir / BATCH_EXIT
    if exit_file.exists():
        code = exit_file.read_text().strip()
        return JobState("COMPLETED" if code == "0" else "FAILED", reason=f"batch exit {code}")
    return None


def wait(
    job_id: str,
    job_dir: Path,
    poll_s: float = 5.0,
    on_change: Callable[[JobState], None] | None = None,
    forgotten_after_s: float = 300.0,
) -> JobState:
    """Poll until the job is done; ``on_change`` sees each new state. Interrupts
    (KeyboardInterrupt, Dagster's termination) propagate: the caller cancels.

    Raises:
        SlurmError: no source knows the job for ``forgotten_after_s`` seconds.
    """
    last: JobState | None = None
    unknown_since = time.monotonic()
    while True:
        state = job_state(job_id, job_dir)
        if state is None:
            if time.monotonic() - unknown_since > forgotten_after_s:
                raise SlurmError(
                    f"Slurm does not know job {job_id} (squeue, sacct) and it left no exit "
                    f"status in {job_dir}: look for it with `scontrol show job {job_id}`"
                )
        else:
            unknown_since = time.monotonic()
            if state != last and on_change is not None:
                on_change(state)
            last = state
            if state.done:
                return state
        time.sleep(poll_s)


def cancel(job_id: str, job_dir: Path, wait_s: float = 120.0) -> JobState | None:
    """``scancel`` the job and wait (up to ``wait_s`` seconds) until it has left the nodes.

    Returns its last known state. Raises nothing: a job that already ended is not an error.
    """
    try:
        _slurm(["scancel", job_id])
    except SlurmError:
        pass
    deadline = time.monotonic() + wait_s
    state = None
    while time.monotonic() < deadline:
        state = job_state(job_id, job_dir)
        # COMPLETING: processes are still being killed on the nodes.
        if state is None or state.done:
            break
        time.sleep(0.5)
    return state


def agent_failures(log_dir: Path, tail_chars: int = 3000) -> dict[str, str]:
    """Per-rank error summaries across the agents of a Slurm job, the first failure first.

    Each agent logs under ``log_dir/agent<task>-<node>`` (see :func:`write_scripts`). A rank is
    named by its global rank and node (``rank_3 on gpu07``) when its agent recorded the ranks it
    lost (``rank_exits.json``), else by its local rank and agent (``local_rank_1 of agent 1 on
    gpu07``).
    """
    found = []
    for agent_dir in sorted(p for p in log_dir.glob("agent*-*") if p.is_dir()):
        task, node = agent_dir.name.removeprefix("agent").split("-", 1)
        exits = read_rank_exits(agent_dir)
        for order, local_rank, text in ranked_failures(agent_dir, tail_chars):
            rank = exits.get(local_rank, {}).get("rank")
            name = (
                f"rank_{rank} on {node}"
                if rank is not None
                else f"local_rank_{local_rank} of agent {task} on {node}"
            )
            found.append((order, name, text))
    return {name: text for _, name, text in sorted(found)}


def output_path(job_dir: Path, job_id: str) -> Path:
    """The batch job's stdout/stderr file, as :func:`sbatch_command` names it."""
    return job_dir / f"slurm-{job_id}.out"


def output_tail(job_dir: Path, job_id: str, chars: int = 3000) -> str:
    """The end of the batch job's stdout/stderr (:func:`output_path`), or '' if none."""
    out = output_path(job_dir, job_id)
    return out.read_text(errors="replace")[-chars:] if out.exists() else ""


def output_excerpt(output: str, job_dir: Path, job_id: str, lines: int = 20) -> str:
    """For a job whose ranks left no error: the last ``lines`` lines of its batch ``output``
    (:func:`output_tail`), where srun's and the torchrun agents' own errors land (a rendezvous
    that failed before any rank started, a node that could not run the agent script)."""
    path = output_path(job_dir, job_id)
    kept = output.rstrip().splitlines()[-lines:]
    if not kept:
        return f"The batch job wrote no output ({path})."
    return f"The batch job's output ({path}) ends:\n" + "\n".join(kept)


def failure_summary_or_state(failures: dict[str, str], state: JobState) -> str:
    """What failed: the rank that failed first (:func:`failure_summary`), else what the job's
    state means, else Slurm's reason."""
    return (
        failure_summary(failures)
        or STATE_CAUSES.get(state.state)
        or (f"Slurm says: {state.reason}" if state.reason else "no rank left an error")
    )


@contextlib.contextmanager
def cancelled_with_parent(job_id: str, job_dir: Path) -> Iterator[None]:
    """While the block runs, a guard process cancels the job if this process dies without
    leaving the block (killed by a signal no ``finally`` sees). Leaving the block, normally or by
    an exception, stops the guard without cancelling: the caller decides."""
    guard = subprocess.Popen(
        [sys.executable, "-m", __name__, "guard", job_id, str(job_dir), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C or the run's process group spares it
    )
    try:
        yield
    finally:
        guard.kill()
        guard.wait()


def _guard(job_id: str, job_dir: Path, parent: int) -> None:
    """Wait for the parent's death (PR_SET_PDEATHSIG: SIGTERM), then cancel the job."""

    def cancel_and_exit(signum, frame) -> None:
        cancel(job_id, job_dir)
        os._exit(0)

    signal.signal(signal.SIGTERM, cancel_and_exit)
    os.environ.pop(LAUNCHER_PID_ENV, None)  # the parent is checked here, not in die_with_parent
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # died before the signal was armed
        cancel_and_exit(signal.SIGTERM, None)
    while True:
        signal.pause()


class SlurmKnobs(BaseModel):
    """The torchrun resource's knobs of a Slurm batch job (with ``nnodes``, sbatch --nodes)."""

    slurm_partition: str = Field(default="", description="sbatch --partition; empty = default.")
    slurm_time_limit: str = Field(
        default="",
        description="sbatch --time, [D-]HH:MM:SS; empty = the partition's default limit.",
    )
    slurm_sbatch_args: list[str] = Field(
        default_factory=list,
        description="More sbatch arguments as they are, e.g. ['--gres=gpu:8', '--account=ml'].",
    )
    slurm_job_dir: str = Field(
        default="",
        description="Shared folder for the batch script, Slurm output, Pipes files and per-rank "
        "logs (a sub-folder per job); empty = next to the job file, in the data folder.",
    )
    slurm_agents_per_node: int = Field(
        default=1,
        ge=1,
        description="torchrun agents per Slurm node (torchrun nnodes = nnodes x this). 1 on a "
        "real cluster; more lets a one-node cluster run a multi-node rendezvous (tests).",
    )
    slurm_rdzv_port: int = Field(
        default=0, description="Rendezvous port on the first node; 0 = derived from the job id."
    )
    slurm_poll_seconds: float = Field(
        default=5.0, gt=0, description="Seconds between looks at the job's state (squeue)."
    )


@dataclass(frozen=True)
class SlurmLauncher(Launcher):
    """A Slurm batch job over ``nnodes`` nodes, ``slurm_agents_per_node`` torchrun agents each
    (module docstring); the knobs are the torchrun resource's ``slurm_*``. Pipes' context and
    messages pass through files in the shared job folder. The job is cancelled if the caller is
    interrupted (a run's termination) or fails while waiting."""

    name: ClassVar[str] = "slurm"
    order: ClassVar[int] = 2
    remote: ClassVar[bool] = True
    knobs: ClassVar[type[BaseModel] | None] = SlurmKnobs

    nnodes: int = 1
    slurm_agents_per_node: int = 1
    slurm_partition: str = ""
    slurm_time_limit: str = ""
    slurm_sbatch_args: Sequence[str] = field(default_factory=tuple)
    slurm_job_dir: str = ""
    slurm_rdzv_port: int = 0
    slurm_poll_seconds: float = 5.0

    @property
    def agents(self) -> int:
        """Torchrun agents: nodes x agents per node."""
        return self.nnodes * self.slurm_agents_per_node

    def job_dir(self, spec: LaunchSpec) -> Path:
        """The launch's job folder: ``<slurm_job_dir>/<job file>-<run id>`` on the shared
        folder, else ``<job file>.slurm`` beside the job file."""
        if self.slurm_job_dir:
            return Path(self.slurm_job_dir) / f"{spec.job_file.stem}-{spec.run_id[:8]}"
        return Path(f"{spec.job_file}.slurm")

    def channel_dir(self, spec: LaunchSpec) -> Path | None:
        """The job folder, which every node shares."""
        return self.job_dir(spec)

    def prepare(self, spec: LaunchSpec) -> Path:
        """The job folder emptied, and its ``logs/``."""
        job_dir = self.job_dir(spec)
        shutil.rmtree(job_dir, ignore_errors=True)
        log_dir = job_dir / "logs"
        log_dir.mkdir(parents=True)
        return log_dir

    def run(
        self,
        spec: LaunchSpec,
        log_dir: Path,
        env: Mapping[str, str],
        log: Callable[[str], None],
    ) -> LaunchOutcome:
        """Submit the batch job, follow its state and read back how it ended.

        Raises:
            LaunchError: sbatch refused the job, or Slurm forgot it.
        """
        job_dir = log_dir.parent
        slurm = SlurmSpec(
            nodes=self.nnodes,
            agents_per_node=self.slurm_agents_per_node,
            partition=self.slurm_partition,
            time_limit=self.slurm_time_limit,
            sbatch_args=tuple(self.slurm_sbatch_args),
            rdzv_port=self.slurm_rdzv_port,
            job_name=spec.module.rsplit(".", 1)[-1],
        )
        args = ["--config", str(spec.job_file.resolve())]
        script = write_scripts(slurm, job_dir, spec.module, spec.nproc_per_node, args, log_dir)
        try:
            job_id = submit(slurm, script, job_dir, env)
        except SlurmError as e:
            raise LaunchError(str(e)) from e
        log(
            f"submitted Slurm job {job_id}: {slurm.agents} torchrun agents on {slurm.nodes} "
            f"node(s) x {spec.nproc_per_node} ranks; job folder {job_dir}"
        )
        finished = False
        try:
            with cancelled_with_parent(job_id, job_dir):
                final = wait(
                    job_id,
                    job_dir,
                    poll_s=self.slurm_poll_seconds,
                    on_change=lambda s: log(
                        f"Slurm job {job_id}: {s.state}"
                        + (f" on {s.nodes}" if s.nodes else "")
                        + (f" ({s.reason})" if s.reason else "")
                    ),
                )
            finished = True
        except SlurmError as e:
            raise LaunchError(str(e)) from e
        finally:
            if not finished:
                # Run termination arrives here as an interrupt: the job must not outlive it.
                log(f"cancelling Slurm job {job_id} (scancel)")
                cancel(job_id, job_dir)
        recorded = {"slurm_job_id": job_id}
        if not final.failed:
            return LaunchOutcome(metadata=recorded)
        failures = agent_failures(log_dir)
        output = output_tail(job_dir, job_id)
        where = f" on {final.nodes}" if final.nodes else ""
        return LaunchOutcome(
            LaunchFailure(
                cause=f"Slurm job {job_id} {final.state}{where}: "
                + failure_summary_or_state(failures, final),
                log_dir=log_dir,
                ranks=failures,
                details={**recorded, "slurm_state": final.state},
                texts={"slurm_output": output},
                note="" if failures else output_excerpt(output, job_dir, job_id),
            ),
            recorded,
        )


if __name__ == "__main__" and sys.argv[1:2] == ["guard"]:
    _guard(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]))
