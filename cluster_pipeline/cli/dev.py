"""Run ``dagster dev`` so that SIGTERM, SIGINT or SIGHUP stops all of it within seconds.

    cluster-pipeline dev -- [dagster dev arguments...]     (what `make dev` runs)

``dagster dev`` alone cannot be relied on to stop (issue 23): started by a shell in the
background or by a service manager, it inherits SIGINT ignored and then ignores SIGTERM too
(it maps SIGTERM onto SIGINT's disposition); make forwards only SIGTERM to its recipe and waits
for it, with the signal blocked, so a SIGINT to make alone stops nothing; and the daemon or a
code server waiting for its runs can outlive ``dagster dev``. This supervisor:

- unblocks and catches SIGTERM, SIGINT and SIGHUP, so ``dagster dev`` starts with their default
  actions whatever this process inherited, and becomes the child subreaper of everything below
  it (a process whose parent dies is re-parented here, not lost to init);
- stops when it gets one of those signals, when its parent dies (``PR_SET_PDEATHSIG``) or sits
  in make's handler of a fatal signal waiting for its children, or when ``dagster dev``, its
  webserver or its daemon exits (``dagster dev`` was signalled directly);
- then asks ``dagster dev`` to shut down (SIGINT, its own graceful path: webserver, daemon,
  code servers), sends what is left SIGTERM after :data:`GRACE_S` seconds (a run worker then
  marks its run failed) and SIGKILL :data:`TERM_S` seconds later.

Runs in progress stop with it and stay resumable: embedding chunks and checkpoints are written
atomically, the dataset partition lock is released by the kernel, and each run is marked
failed by its worker or by its watchdog (``defs/run_watchdog.py``, spared here, as is the Slurm
job guard: both must outlive their parent to do their job); re-execute it to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

GRACE_S = 3.5  # for dagster dev's own shutdown
TERM_S = 1.5  # between SIGTERM and SIGKILL of what is left
# How long dagster dev may take to exit after one of its services did (it stops them first on a
# signal; measured 3 s between its webserver's exit and its own on a busy machine).
SERVICE_EXIT_S = 5.0
POLL_S = 0.2
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Processes that must outlive their parent (they act on its death): never signalled here.
SPARED = ("cluster_pipeline.defs.run_watchdog", "cluster_pipeline.launch.slurm")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_FATAL_TO_MAKE = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``dev``'s arguments: everything after ``--`` goes to ``dagster dev``."""
    parser.add_argument(
        "dagster_args",
        nargs=argparse.REMAINDER,
        help="`--`, then the arguments of `dagster dev` (e.g. -- -w workspace.yaml -p 3000)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Run ``dagster dev`` under :func:`supervise` and exit with its status."""
    dagster = str(Path(sys.executable).parent / "dagster")
    passed = args.dagster_args[1:] if args.dagster_args[:1] == ["--"] else args.dagster_args
    code = supervise([dagster, "dev", *passed])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # at once: tearing down the interpreter took 1.5 s on a busy machine


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value)


def _blocked_by(pid: int) -> set[int]:
    """The signals ``pid`` blocks (``SigBlk`` of ``/proc/<pid>/status``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigBlk:"):
                mask = int(line.split()[1], 16)
                return {n for n in range(1, 65) if mask >> (n - 1) & 1}
    except OSError:
        pass
    return set()


def parent_stopping(parent: int) -> bool:
    """Whether ``parent`` is make inside its handler of a fatal signal: GNU make's handler
    (``fatal_error_signal``) runs with that signal blocked and waits for its children, and
    forwards only SIGTERM to them; a SIGINT or SIGHUP sent to make alone would otherwise leave
    it waiting forever."""
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return True  # gone
    return name in ("make", "gmake") and bool(_blocked_by(parent) & _FATAL_TO_MAKE)


def _descendants(root: psutil.Process) -> list[psutil.Process]:
    try:
        found = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    alive = []
    for proc in found:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(name in " ".join(proc.cmdline()) for name in SPARED):
                continue
            alive.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return alive


def _reap(statuses: dict[int, int]) -> None:
    """Collect exited children (as subreaper, orphans of the tree are ours to wait for),
    keeping each one's exit code in ``statuses``."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        statuses[pid] = os.waitstatus_to_exitcode(status)


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            proc.send_signal(sig)


def _wait_gone(
    root: psutil.Process, seconds: float, statuses: dict[int, int]
) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while True:
        _reap(statuses)
        left = _descendants(root)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def _service(proc: psutil.Process) -> str | None:
    """``webserver`` or ``daemon`` for those processes of ``dagster dev``, else None."""
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if "dagster_webserver" in cmdline:
        return "webserver"
    if "dagster._daemon" in cmdline:
        return "daemon"
    return None


def _name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    words = [Path(c).name if c.startswith("/") else c for c in cmdline[:4]]
    return " ".join(w for w in words if not w.startswith("python"))


def supervise(command: list[str]) -> int:
    """Run ``command`` (``dagster dev ...``) until it or this process is told to stop, then stop
    every process below this one (module docstring).

    Returns:
        The exit status: 0 for a normal stop (a stop signal to this process, its parent
        stopping, or ``dagster dev`` ended by SIGTERM, SIGINT or SIGHUP: issue 44, so that make
        reports no ``Error 143`` after a Ctrl-C), else ``dagster dev``'s status (1 when its
        webserver or daemon died under it).
    """
    received: list[int] = []

    def on_signal(signum, frame) -> None:
        received.append(signum)

    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)  # caught here, so the child starts with the default
    parent = os.getppid()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    me = psutil.Process()
    child = subprocess.Popen(command)
    services: dict[int, str] = {}
    why, asked = "", False
    while not why:
        if received:
            why, asked = f"received {signal.Signals(received[0]).name}", True
        elif child.poll() is not None:
            why = f"dagster dev exited ({child.returncode})"
            asked = _stopped_by_signal(child.returncode)
        elif os.getppid() != parent or parent_stopping(parent):
            why, asked = "the parent process (make) is stopping", True
        else:
            for proc in _descendants(me):
                name = _service(proc)
                if name and proc.pid not in services:
                    services[proc.pid] = name
            gone = [n for pid, n in services.items() if not psutil.pid_exists(pid)]
            if gone:
                why = f"dagster dev's {gone[0]} exited"
                # dagster dev stopping on a signal shuts its services first (its webserver
                # exits seconds before it does): let it end by itself and read its status, so
                # that race is a normal stop; one still running has lost a service under it.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=SERVICE_EXIT_S)
                code = child.returncode
                asked = bool(received) or (code is not None and _stopped_by_signal(code))
            else:
                time.sleep(POLL_S)
    since = time.monotonic()
    print(f"cluster-pipeline dev: {why}; stopping dagster dev", file=sys.stderr, flush=True)
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signal.SIGINT)
    statuses: dict[int, int] = {}
    if child.returncode is not None:
        statuses[child.pid] = child.returncode
    left = _wait_gone(me, GRACE_S, statuses)
    for sig, wait in ((signal.SIGTERM, TERM_S), (signal.SIGKILL, 1.0)):
        if not left:
            break
        names = ", ".join(f"{p.pid} ({_name(p)})" for p in left)
        print(
            f"cluster-pipeline dev: {sig.name} to {names}, still running after "
            f"{time.monotonic() - since:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        _signal_all(left, sig)
        left = _wait_gone(me, wait, statuses)
    print(
        f"cluster-pipeline dev: stopped in {time.monotonic() - since:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    if asked:
        return 0
    return statuses.get(child.pid, 1)


def _stopped_by_signal(returncode: int) -> bool:
    """Whether an exit status says the process ended on one of :data:`STOP_SIGNALS`: killed
    by it (``-n``) or exiting with ``128 + n`` as shells and Python's handlers report it."""
    stops = {int(s) for s in STOP_SIGNALS}
    return -returncode in stops or returncode - 128 in stops
