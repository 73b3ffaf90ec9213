"""End a multiprocessing fork server without Python's finalization, once its last step is gone.

The executor's fork server (``defs/executor.py``) preloads the project (Dagster, polars, the
stages) and forks each step process from it. It exits when its run's worker and every
step it forked are gone, but then it finalizes an interpreter holding all of those modules,
which takes 1.2 s on an idle 2-core machine and 7 s on a loaded one: long enough to outlive the
run it served (``dagster job execute`` returns while it still runs, and a worker's SIGKILL
leaves it behind for seconds). It holds no data, files or child processes by then, so nothing
is lost by skipping finalization.

Importing this module inside ``multiprocessing.forkserver.main`` (it is first among the
executor's preload modules) registers an ``atexit`` handler that, in the server process only,
flushes stdout and stderr and calls ``os._exit``: status 0 after the server's normal end (its
``SystemExit``), 1 after an unhandled exception (its traceback is printed first). It runs
after every other ``atexit`` handler the preloaded modules registered (handlers run last
registered, first run). Imported anywhere else it does nothing; the steps the server forks end
by ``os._exit`` anyway.
"""

from __future__ import annotations

import atexit
import os
import sys


def in_fork_server() -> bool:
    """True when called (at any depth) from ``multiprocessing.forkserver.main``: the import of a
    preload module in a fork server."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_without_finalizing(pid: int) -> None:
    if os.getpid() != pid:  # a forked child (it ends by os._exit itself)
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(1 if getattr(sys, "last_value", None) is not None else 0)


if in_fork_server():
    atexit.register(_exit_without_finalizing, os.getpid())
