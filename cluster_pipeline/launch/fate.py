"""Fate-sharing between a launcher and its children, with no heavy imports (it must run before
torch is imported, to leave no window in which a parent's death goes unnoticed)."""

import contextlib
import ctypes
import os
import signal
import sys

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
