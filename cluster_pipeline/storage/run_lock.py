"""One run per dataset partition at a time, wherever runs start: a lock file in the data folder.

Every run of a partition, whether the web UI, a schedule, ``make run`` or ``dagster asset
materialize`` started it, holds ``<data>/locks/<dataset>.lock`` for as long as it runs
(``defs/executor.py`` takes it in the run's worker process, before the first step). The lock is
``flock(2)`` on that file, so the kernel releases it the moment the holding process dies, however
it dies; beside it, ``<dataset>.json`` names the holder (run id, job, pid, host, since when), so
a run that has to wait, or gives up, says which run holds the partition. A run that ends removes
its ``.json`` before releasing; one that dies leaves it behind, so the next run to take the lock
knows it took over from a dead run (a *stale* lock) and which one.

Only light modules are imported: the torchrun ranks read the lock (``launch/fate.py``) before
they import torch.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster_pipeline.storage import atomic


class PartitionBusy(RuntimeError):
    """Another live run holds the partition (the message names it)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a partition: a Dagster run, its worker process (pid on host) and since when
    (``started``: Unix seconds)."""

    run_id: str
    pid: int
    host: str
    started: float
    job: str = ""

    @classmethod
    def this_process(cls, run_id: str, job: str = "") -> Holder:
        """The holder record of the calling process for ``run_id``."""
        return cls(run_id, os.getpid(), socket.gethostname(), time.time(), job)

    def describe(self) -> str:
        """``run 1a2b3c4d-... (job main_job, pid 4242 on host h, since 2026-12-01 12:00:03
        UTC)``."""
        since = dt.datetime.fromtimestamp(self.started, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        job = f"job {self.job}, " if self.job else ""
        return f"run {self.run_id} ({job}pid {self.pid} on host {self.host}, since {since} UTC)"


class PartitionLock:
    """The lock of one dataset partition: ``path`` (flock'd) and ``path.with_suffix('.json')``
    (the holder). One instance holds the lock at most once; :meth:`release` gives it back."""

    def __init__(self, path: Path | str, name: str | None = None):
        self.path = Path(path)
        self.name = name or self.path.stem
        self.info_path = self.path.with_suffix(".json")
        self._fd: int | None = None
        self._holder: Holder | None = None

    def holder(self) -> Holder | None:
        """The holder the ``.json`` names (the current one, or a dead one that never released);
        None when there is none or it cannot be read."""
        try:
            return Holder(**json.loads(self.info_path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def is_held(self) -> bool:
        """Whether some process holds the lock now. A probe: it takes the lock for an instant
        when it is free (a concurrent :meth:`try_acquire` may then fail once)."""
        fd = self._open()
        try:
            return not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)  # closing drops a lock the probe took

    def try_acquire(self, holder: Holder) -> tuple[bool, Holder | None]:
        """Take the lock if it is free and record ``holder``.

        Returns:
            (taken, stale): ``stale`` is the holder a dead run left behind (it died without
            releasing), None when the lock was cleanly free; when not taken, ``stale`` is None.

        Raises:
            RuntimeError: this instance already holds the lock.
        """
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this process")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open()
        if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
            os.close(fd)
            return False, None
        stale = self.holder()
        atomic.write_text(self.info_path, json.dumps(asdict(holder)))
        self._fd, self._holder = fd, holder
        return True, stale

    def acquire(
        self,
        holder: Holder,
        timeout_s: float,
        on_wait: Callable[[Holder | None, float], None] = lambda h, waited: None,
        poll_s: float = 1.0,
        report_every_s: float = 30.0,
        interrupted: Callable[[], bool] = lambda: False,
    ) -> Holder | None:
        """:meth:`try_acquire` until it succeeds or ``timeout_s`` seconds have passed.

        ``on_wait(holder, seconds waited)`` is called when the lock is first found busy and then
        every ``report_every_s`` seconds; ``interrupted()`` is polled every ``poll_s`` and ends
        the wait (returning without the lock raises nothing: check :attr:`held`).

        Returns:
            The stale holder taken over (see :meth:`try_acquire`), or None.

        Raises:
            PartitionBusy: still held by a live run after ``timeout_s`` (names it and for how
                long this run waited).
        """
        start = time.monotonic()
        next_report = start
        while True:
            taken, stale = self.try_acquire(holder)
            if taken:
                return stale
            waited = time.monotonic() - start
            current = self.holder()
            if waited >= timeout_s:
                raise PartitionBusy(_busy_message(self, current, waited, timeout_s))
            if time.monotonic() >= next_report:
                on_wait(current, waited)
                next_report += report_every_s
            if interrupted():
                return None
            time.sleep(min(poll_s, max(timeout_s - waited, 0.05)))

    @property
    def held(self) -> bool:
        """Whether this instance holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the holder file (only if it still names this holder) and unlock. Idempotent."""
        if self._fd is None:
            return
        if self._holder is not None and self.holder() == self._holder:
            with contextlib.suppress(FileNotFoundError):
                self.info_path.unlink()
        os.close(self._fd)
        self._fd, self._holder = None, None

    def _open(self) -> int:
        # Not inheritable (Python's default): a child must never keep a dead run's lock.
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)


def _flock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def _busy_message(
    lock: PartitionLock, holder: Holder | None, waited: float, timeout_s: float
) -> str:
    who = holder.describe() if holder else f"a process that recorded no holder in {lock.path}"
    waiting = (
        f"gave up after waiting {waited:.0f} s"
        if timeout_s > 0
        else "not waiting (partition_wait_seconds: 0)"
    )
    return (
        f"dataset partition {lock.name!r} is held by {who}: {waiting}. Let that run finish, or "
        "stop it (Runs -> the run -> Terminate in the UI, or kill its pid), then start this "
        "run again; set the executor's partition_wait_seconds to wait longer"
    )
