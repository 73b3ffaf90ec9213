"""Fate-sharing between a run's processes, with no heavy imports (it must run before torch is
imported, to leave no window in which a parent's death goes unnoticed).

:func:`die_with_parent` asks Linux to signal a process when its parent dies: a Dagster step
process when the run's worker dies (:func:`bind_step`), the torchrun launcher when its step
dies, each rank when the launcher dies. :class:`RunGuard` is the second line: before a table is
committed, a checkpoint or chunk renamed into place, or an outcome written, the writer checks
that the run it works for is still alive (every process from the run's worker down to it, and
the run's partition lock, storage/run_lock.py), so nothing is committed by a run that died, even
in the moment before a signal lands. The guard travels to child processes in
``$CLUSTER_PIPELINE_RUN_GUARD``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

_PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "CLUSTER_PIPELINE_LAUNCHER_PID"


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Ask Linux to send this process ``sig`` when its parent dies (PR_SET_PDEATHSIG).

    If the parent is already gone (``os.getppid()`` is no longer ``expected_parent``; by default
    the pid in ``$CLUSTER_PIPELINE_LAUNCHER_PID`` when set), exit at once. A no-op off Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    if expected_parent is None and os.environ.get(LAUNCHER_PID_ENV):
        expected_parent = int(os.environ[LAUNCHER_PID_ENV])
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def die_with_process(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send this process ``sig`` when process ``pid`` (an ancestor that is not the parent)
    exits: a daemon thread waits on the process's pidfd (Linux 5.3+, ``os.pidfd_open``).

    What a step forked by Dagster's fork server needs: its parent is the server, which holds on
    while any of its children lives (each child keeps the server's "alive" pipe open), so the
    parent-death signal would never fire when the run's worker dies. If ``pid`` has already
    exited, this process exits at once (an exited process's pidfd, zombie or gone, is readable
    at once).

    Returns:
        False where pidfds are unavailable (nothing armed; the run guard still refuses
        commits).
    """
    import select
    import threading

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(128 + int(sig))
    except (AttributeError, OSError):
        return False

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()
    return True


# --- Whether the run is still alive: a guard consulted before anything is committed -----------

GUARD_ENV = "CLUSTER_PIPELINE_RUN_GUARD"


class RunGone(RuntimeError):
    """The run this process works for is no longer alive (its worker or step process died, or
    its partition lock is held by another run): nothing may be committed in its name."""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first),
    or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot; with the pid, a process's identity), or
    None when it is gone or a zombie (dead, not yet reaped)."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``, or None when it is gone."""
    fields = _stat(pid)
    return int(fields[1]) if fields is not None else None


@dataclass(frozen=True)
class RunGuard:
    """What must still hold for this process to commit anything for run ``run_id``: the
    partition lock ``lock`` (storage/run_lock.py) names the run and is held, and every process of
    ``chain`` ((role, pid, start) from the run's worker down) is alive. Checks of processes and of
    the lock's flock are made only on ``host`` (a Slurm rank elsewhere checks the holder file).
    An empty ``lock``: the run holds none (nothing to check)."""

    run_id: str
    lock: str = ""
    host: str = ""
    chain: tuple[tuple[str, int, int], ...] = ()

    def check(self, what: str) -> None:
        """Raise :class:`RunGone` if the run is no longer alive.

        Args:
            what: what is about to be committed, for the message ("commit the proxy_embeddings
                table", "save checkpoint step_0000012").

        Raises:
            RunGone: names the run, what was refused, and why (the process that died, or the
                run that holds the partition now).
        """
        local = self.host == socket.gethostname()
        refused = f"refusing to {what}: run {self.run_id}"
        if self.lock:
            from cluster_pipeline.storage.run_lock import PartitionLock

            lock = PartitionLock(self.lock)
            holder = lock.holder()
            if holder is not None and holder.run_id != self.run_id:
                if self.chain or not local or lock.is_held():
                    raise RunGone(
                        f"{refused} no longer holds its dataset partition: {holder.describe()} does"
                    )
            elif holder is not None and local and not lock.is_held():
                raise RunGone(
                    f"{refused} is no longer alive: its worker process (pid {holder.pid}) died "
                    "and released the partition lock"
                )
            elif holder is None and self.chain:
                raise RunGone(f"{refused} no longer holds its dataset partition ({self.lock})")
        if local:
            for role, pid, start in self.chain:
                if process_start(pid) != start:
                    raise RunGone(f"{refused} is no longer alive: its {role} (pid {pid}) died")

    def extended(self, role: str, pid: int | None = None) -> RunGuard:
        """This guard with process ``pid`` (default: this one) added to the chain."""
        pid = os.getpid() if pid is None else pid
        start = process_start(pid)
        if start is None:
            raise RunGone(f"run {self.run_id}: its {role} (pid {pid}) is gone")
        return replace(self, chain=(*self.chain, (role, pid, start)))

    def env(self) -> dict[str, str]:
        """The environment variable that hands this guard to child processes."""
        return {GUARD_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RunGuard | None:
        """The guard a parent handed down (:meth:`env`), or None."""
        text = environ.get(GUARD_ENV)
        if not text:
            return None
        fields = json.loads(text)
        return cls(
            run_id=fields["run_id"],
            lock=fields["lock"],
            host=fields["host"],
            chain=tuple((str(r), int(p), int(s)) for r, p, s in fields["chain"]),
        )


def bind_step(lock_path: Path | str, run_id: str) -> RunGuard:
    """The guard of a Dagster step process of run ``run_id``, arming fate-sharing first.

    When the partition lock names this run and its worker is an ancestor of this process on
    this machine (the project's executor ran the step in a child process, or in a child of its
    fork server), this process is SIGKILLed when the worker dies (exiting at once if it already
    has): by Linux's parent-death signal when the worker is its parent, else by
    :func:`die_with_process`. The guard checks the worker, the processes between and this
    process are alive. Otherwise (an in-process run, or a run that
    holds no lock) the guard only refuses commits while another run holds the partition.

    Raises:
        RunGone: the run's worker died before this process could bind to it.
    """
    from cluster_pipeline.storage.run_lock import PartitionLock

    lock = PartitionLock(lock_path)
    holder = lock.holder()
    host = socket.gethostname()
    guard = RunGuard(run_id=run_id, lock=str(lock_path), host=host)
    if holder is None or holder.run_id != run_id or holder.host != host:
        return guard
    if holder.pid == os.getpid():  # the run worker itself (an in-process step)
        return guard.extended("run worker")
    path, pid = [], os.getppid()
    while pid not in (holder.pid, 0, 1) and len(path) < 4:
        path.append(pid)
        pid = parent_of(pid) or 0
    if pid != holder.pid:
        return guard  # not a descendant of the worker here: the holder file is what can be checked
    if path:  # forked by the executor's fork server, which outlives the worker
        die_with_process(holder.pid)
    else:
        die_with_parent(signal.SIGKILL, expected_parent=holder.pid)
    guard = guard.extended("run worker", holder.pid)
    for between in reversed(path):
        guard = guard.extended("executor process", between)
    guard = guard.extended("step process")
    guard.check("start the step")
    return guard


def check_alive(what: str) -> None:
    """:meth:`RunGuard.check` of the guard this process inherited (none: nothing to check, as
    in a plain process or a test).

    Raises:
        RunGone: the run is no longer alive.
    """
    guard = RunGuard.from_env()
    if guard is not None:
        guard.check(what)
