"""Launching the torchrun entry points and reading back why a launch failed.

:func:`torchrun_command` builds the command line (one machine with ``--standalone``, or a c10d
rendezvous across machines) around :mod:`cluster_pipeline.launch.launcher`, a torchrun that dies
with the process that started it. :func:`rank_failures` reads the per-rank logs torchrun writes
with ``--log-dir``/``--tee`` and :func:`failure_summary` names the rank that failed first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

LAUNCH_MODULE = "cluster_pipeline.launch.launcher"
# The python -m targets torchrun starts, by job (cluster_pipeline/recipes/); strings, so that the
# Dagster definitions never import a recipe. cluster_pipeline_tests/test_layout.py resolves each.
RECIPES = {
    "embed": "cluster_pipeline.recipes.embed",
    "train": "cluster_pipeline.recipes.train",
    "evaluate": "cluster_pipeline.recipes.evaluate",
}
# Written under --log-dir by the launcher when ranks fail: local rank -> exit code and signal.
RANK_EXITS = "rank_exits.json"
# Why a rank dies by a signal without writing an error, in plain words.
_SIGNAL_CAUSES = {
    "SIGKILL": "likely out of memory (the kernel's OOM killer sends SIGKILL; see `dmesg`, "
    "lower the batch size or max_length)",
    "SIGSEGV": "a crash in native code (segmentation fault)",
    "SIGBUS": "a crash in native code (bus error; often a full /dev/shm)",
    "SIGABRT": "aborted by native code",
}

_PEER_LOST = re.compile(
    r"Connection closed by peer|remote worker crash|Connection reset by peer|Broken pipe|"
    r"remote process exited|NCCL communicator was aborted"
)


def torchrun_command(
    module: str,
    nproc_per_node: int,
    args: list[str],
    *,
    nnodes: int = 1,
    node_rank: int | str = 0,
    rdzv_endpoint: str = "",
    rdzv_id: str = "cluster_pipeline",
    log_dir: Path | str | None = None,
) -> list[str]:
    """The command running ``python -m module args`` on every rank under torchrun.

    With ``log_dir``, every rank's stdout/stderr is also written (``--tee``) under it, so a
    failed rank's log can be shown (:func:`rank_failures`). ``node_rank``, ``rdzv_endpoint`` and
    ``log_dir`` may be shell expressions (``$SLURM_PROCID``) for a script to fill in.

    Raises:
        ValueError: ``nproc_per_node`` < 1, or ``nnodes`` > 1 without a rendezvous endpoint.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    launcher = [sys.executable, "-m", LAUNCH_MODULE]
    if nnodes == 1 and not rdzv_endpoint:
        launcher += ["--standalone"]
    else:
        if not rdzv_endpoint:
            raise ValueError("rdzv_endpoint (host:port) is required when nnodes > 1")
        launcher += [
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}",
            f"--rdzv_id={rdzv_id}",
        ]
    if log_dir is not None:
        launcher += [f"--log-dir={log_dir}", "--redirects=3", "--tee=3"]
    return [*launcher, f"--nproc_per_node={nproc_per_node}", "-m", module, *args]


def rank_threads(nproc_per_node: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ranks sharing this machine: its CPUs (the ones this process may
    run on) divided over ``nproc_per_node`` ranks, at least 1. torchrun sets 1 when it is unset
    and ``nproc_per_node`` > 1, with a banner in every run's log; an explicit value (the
    caller's environment wins over this) sets the same for 2 ranks on 2 cores and lets ranks
    of a larger machine use its cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"OMP_NUM_THREADS": str(max(1, (cpus or 1) // max(1, nproc_per_node)))}


def rank_failures(log_dir: Path, tail_chars: int = 3000) -> dict[str, str]:
    """Per-rank error summaries of a torchrun launch, the first failure first.

    For each rank that wrote an ``error.json`` (entry points wrapped in ``@record``): its
    message and traceback, ordered by the time it failed, so the root cause leads and the
    ranks that merely lost their peer follow. Ranks without one contribute the tail of a stderr
    that shows a traceback; a rank killed by a signal (no error file: the OOM killer's SIGKILL, a
    segfault) is named from the launcher's ``rank_exits.json`` with the signal and its likely
    cause. Keys are ``rank_<local rank>``.
    """
    return {f"rank_{rank}": text for _, rank, text in ranked_failures(log_dir, tail_chars)}


def read_rank_exits(log_dir: Path) -> dict[str, dict]:
    """The launcher's ``rank_exits.json`` under ``log_dir``: local rank -> ``exitcode``,
    ``signal``, ``timestamp`` and global ``rank``; empty when no rank failed."""
    exits_file = log_dir / RANK_EXITS
    return json.loads(exits_file.read_text()) if exits_file.exists() else {}


def ranked_failures(
    log_dir: Path, tail_chars: int = 3000
) -> list[tuple[tuple[bool, float], str, str]]:
    """:func:`rank_failures` as ``(order, local rank, text)``, sorted by ``order`` (a rank that
    only lost its peer or was stopped last, then time of failure), so launches of several
    agents can be merged into one order."""
    found: list[tuple[tuple[bool, float], str, str]] = []
    never = float("inf")
    for rank_dir in sorted(p for p in log_dir.glob("*/attempt_*/*") if p.is_dir()):
        error, stderr = rank_dir / "error.json", rank_dir / "stderr.log"
        if error.exists():
            try:
                body = json.loads(error.read_text())["message"]
                info = body.get("extraInfo", {})
                # The message whole (it leads the summary), the call stack's tail after it.
                stack = info.get("py_callstack", "")[-tail_chars:]
                text = f"{body.get('message', '')}\n{stack}"
            except (ValueError, KeyError, TypeError, AttributeError):
                text = error.read_text()[-tail_chars:]
            if not text.strip() and stderr.exists():
                # An error file left empty (a full disk cut it short): the rank's own output.
                text = stderr.read_text(errors="replace")[-tail_chars:]
            # A rank that only lost its peer is a consequence, not the cause; among the rest,
            # the file's mtime orders (error.json's timestamp has 1 s resolution).
            when = (_PEER_LOST.search(text) is not None, float(error.stat().st_mtime_ns))
            found.append((when, rank_dir.name, text))
        elif stderr.exists():
            text = stderr.read_text(errors="replace")
            if "Traceback" in text:
                found.append(((True, never), rank_dir.name, text[-tail_chars:]))
    named = {rank for _, rank, _ in found}
    for rank, info in read_rank_exits(log_dir).items():
        sig = info.get("signal")
        if sig and rank not in named:
            # torchrun stops the other ranks with SIGTERM once one fails: a consequence.
            stopped = sig in ("SIGTERM", "SIGINT")
            text = (
                f"killed by signal {sig} (exit code {info['exitcode']}): stopped by torchrun "
                "after another rank failed, or by a user"
                if stopped
                else signal_cause(int(info["exitcode"]))
                or f"killed by signal {sig} (exit code {info['exitcode']})"
            )
            found.append(((stopped, float(info.get("timestamp", 0)) * 1e9), rank, text))
    return sorted(found)


def signal_cause(exit_code: int) -> str | None:
    """``killed by signal SIGKILL (exit code -9): <likely cause>`` for a negative exit code
    (subprocess's convention for death by signal), None otherwise."""
    if exit_code >= 0:
        return None
    try:
        sig = signal.Signals(-exit_code).name
    except ValueError:
        return f"killed by signal {-exit_code} (exit code {exit_code})"
    return (
        f"killed by signal {sig} (exit code {exit_code}): "
        f"{_SIGNAL_CAUSES.get(sig, 'killed from outside the program')}"
    )


def process_crash(what: str, pid: int | None, exit_code: int | None, last_lines: list[str]) -> str:
    """Why a process ended without saying so itself (a Dagster step process killed by a
    signal: the executor's bare ``ChildProcessCrashException``): ``the process of <what> (pid
    N) was killed by signal SIGKILL (exit code -9): likely out of memory (...)``, or ``exited
    with status 3``, then the last lines it logged (``last_lines``, oldest first), each in
    quotes, or that it logged none.
    """
    who = f"the process of {what}" + (f" (pid {pid})" if pid is not None else "")
    if exit_code is None:
        ended = "died without an exit status"
    else:
        ended = signal_cause(exit_code) or f"exited with status {exit_code}"
        ended = f"was {ended}" if exit_code < 0 else ended
    lines = (
        "; its last log lines: " + " | ".join(repr(line) for line in last_lines)
        if last_lines
        else "; it logged nothing before"
    )
    return f"{who} {ended}{lines}"


def failure_summary(failures: dict[str, str]) -> str | None:
    """``rank_1 failed first: <first line of its error> (then rank_0)``, or None without
    failures."""
    if not failures:
        return None
    rank, text = next(iter(failures.items()))
    lines = text.strip().splitlines()
    cause = f"{rank} failed first: {lines[0] if lines else '(no message)'}"
    others = [r for r in failures if r != rank]
    if others:
        cause += f" (then {', '.join(others)})"
    return cause
