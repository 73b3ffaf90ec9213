"""The partition lock: one holder at a time, named to whoever waits; a dead holder's lock is free
at once and is taken over, naming the dead run; partitions are independent."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster_pipeline.storage.run_lock import Holder, PartitionBusy, PartitionLock

HOLD = textwrap.dedent(
    """
    import sys, time
    from cluster_pipeline.storage.run_lock import Holder, PartitionLock
    lock = PartitionLock(sys.argv[1], "tiny")
    assert lock.try_acquire(Holder.this_process(sys.argv[2], "main_job"))[0]
    print("held", flush=True)
    time.sleep(float(sys.argv[3]))
    lock.release()
    """
)


def _holder_process(path: Path, run_id: str, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), run_id, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_one_holder_at_a_time_and_the_busy_message_names_it(tmp_path):
    path = tmp_path / "locks" / "tiny.lock"
    first, second = PartitionLock(path, "tiny"), PartitionLock(path, "tiny")
    me = Holder("run-a", os.getpid(), "host-1", 0.0, "main_job")
    assert first.try_acquire(me) == (True, None)
    assert first.is_held() and first.holder() == me
    assert second.try_acquire(Holder.this_process("run-b")) == (False, None)
    with pytest.raises(PartitionBusy) as e:
        second.acquire(Holder.this_process("run-b"), timeout_s=0)
    assert str(e.value) == (
        "dataset partition 'tiny' is held by run run-a (job main_job, pid "
        f"{os.getpid()} on host host-1, since 1970-01-01 00:00:00 UTC): not waiting "
        "(partition_wait_seconds: 0). Let that run finish, or stop it (Runs -> the run -> "
        "Terminate in the UI, or kill its pid), then start this run again; set the executor's "
        "partition_wait_seconds to wait longer"
    )
    first.release()
    assert not path.with_suffix(".json").exists() and not first.is_held()
    assert second.try_acquire(Holder.this_process("run-b")) == (True, None)  # cleanly free
    second.release()


def test_a_waiting_run_names_the_holder_then_takes_the_lock(tmp_path):
    path = tmp_path / "tiny.lock"
    holder = _holder_process(path, "run-a", 1.5)
    seen: list[tuple[str | None, float]] = []
    lock = PartitionLock(path, "tiny")
    start = time.monotonic()
    stale = lock.acquire(
        Holder.this_process("run-b"),
        timeout_s=30,
        on_wait=lambda h, waited: seen.append((h.run_id if h else None, waited)),
        poll_s=0.1,
    )
    assert lock.held and stale is None  # released cleanly: nothing taken over
    assert 1.0 < time.monotonic() - start < 20
    assert seen and seen[0][0] == "run-a"
    lock.release()
    holder.wait()


def test_a_dead_holders_lock_is_free_at_once_and_taken_over_naming_it(tmp_path):
    path = tmp_path / "tiny.lock"
    holder = _holder_process(path, "run-dead", 600)
    lock = PartitionLock(path, "tiny")
    assert lock.is_held()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert not lock.is_held()  # the kernel released it with the process
    taken, stale = lock.try_acquire(Holder.this_process("run-next"))
    assert taken and stale is not None
    assert (stale.run_id, stale.pid, stale.job) == ("run-dead", holder.pid, "main_job")
    assert lock.holder() is not None and lock.holder().run_id == "run-next"  # pyright: ignore[reportOptionalMemberAccess]
    lock.release()


def test_two_partitions_do_not_block_each_other(tmp_path):
    a = PartitionLock(tmp_path / "a.lock", "a")
    b = PartitionLock(tmp_path / "b.lock", "b")
    assert a.try_acquire(Holder.this_process("run-a"))[0]
    assert b.try_acquire(Holder.this_process("run-b"))[0]
    a.release()
    b.release()


def test_a_holder_that_never_releases_fails_the_waiter_after_the_timeout(tmp_path):
    path = tmp_path / "tiny.lock"
    holder = _holder_process(path, "run-a", 600)
    try:
        start = time.monotonic()
        with pytest.raises(PartitionBusy, match=r"held by run run-a .*gave up after waiting 1 s"):
            PartitionLock(path, "tiny").acquire(Holder.this_process("run-b"), 1.0, poll_s=0.1)
        assert time.monotonic() - start < 10
    finally:
        holder.kill()
        holder.wait()
