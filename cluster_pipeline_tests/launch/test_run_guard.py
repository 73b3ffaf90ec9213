"""The run guard: nothing is committed for a run that is no longer alive (a process of its chain
died, or another run holds its partition), and a step process bound to its run's worker dies
with it."""

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict
from pathlib import Path

import polars as pl
import pytest

from cluster_pipeline.launch.fate import GUARD_ENV, RunGone, RunGuard, process_start
from cluster_pipeline.storage.run_lock import Holder, PartitionLock
from cluster_pipeline.storage.tables import write_table
from cluster_pipeline.training.checkpointing import save_checkpoint

HOST = socket.gethostname()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_guard_refuses_once_a_process_of_its_chain_died(tmp_path):
    proc = _sleeper()
    guard = RunGuard("run-a", host=HOST).extended("step process", proc.pid)
    guard.check("commit")  # alive: nothing raised
    assert RunGuard.from_env(guard.env()) == guard
    proc.kill()
    proc.wait()
    with pytest.raises(RunGone) as e:
        guard.check("commit the proxy_embeddings table")
    assert str(e.value) == (
        "refusing to commit the proxy_embeddings table: run run-a is no longer alive: its step "
        f"process (pid {proc.pid}) died"
    )
    # On another machine the processes cannot be checked (a Slurm rank elsewhere).
    RunGuard("run-a", host="elsewhere", chain=guard.chain).check("commit")


def test_a_guard_follows_its_partition_lock(tmp_path):
    path = tmp_path / "tiny.lock"
    ours = PartitionLock(path, "tiny")
    assert ours.try_acquire(Holder.this_process("run-a"))[0]
    RunGuard("run-a", lock=str(path), host=HOST).check("commit")
    # A run that holds no lock (an in-process run) may not commit while another run holds it.
    with pytest.raises(RunGone, match=r"run run-b no longer holds .*: run run-a \(pid"):
        RunGuard("run-b", lock=str(path), host=HOST).check("commit")
    ours.release()
    RunGuard("run-b", lock=str(path), host=HOST).check("commit")  # free: nothing to refuse
    # The holder file names run-a but nobody holds the lock: run-a's worker died.
    path.with_suffix(".json").write_text(json.dumps(asdict(Holder("run-a", 1, HOST, 0.0))))
    with pytest.raises(RunGone, match="its worker process .pid 1. died and released"):
        RunGuard("run-a", lock=str(path), host=HOST).check("commit")


def test_a_refused_guard_commits_no_table_version_and_renames_no_checkpoint(
    tmp_path, monkeypatch, tiny_model, tiny_tokenizer
):
    uri = tmp_path / "table"
    first = write_table(pl.DataFrame({"a": [1]}), uri)
    proc = _sleeper()
    dead = RunGuard("run-a", host=HOST).extended("step process", proc.pid)
    proc.kill()
    proc.wait()
    with pytest.raises(RunGone):
        write_table(pl.DataFrame({"a": [2]}), uri, guard=dead)
    assert write_table(pl.DataFrame({"a": [3]}), uri).version == first.version + 1  # none between

    monkeypatch.setenv(GUARD_ENV, dead.env()[GUARD_ENV])
    out = tmp_path / "checkpoints" / "final"
    with pytest.raises(RunGone, match=r"refusing to rename checkpoint .*final into place"):
        save_checkpoint(tiny_model, tiny_tokenizer, out, {"step": 1})
    assert not out.exists() and list(out.parent.iterdir()) == []  # no half checkpoint either


BOUND_STEP = textwrap.dedent(
    """
    import sys, time
    from cluster_pipeline.launch.fate import bind_step
    guard = bind_step(sys.argv[1], sys.argv[2])
    print(" ".join(role for role, _, _ in guard.chain), flush=True)
    time.sleep(600)
    """
)
WORKER = textwrap.dedent(
    """
    import subprocess, sys, time
    from cluster_pipeline.storage.run_lock import Holder, PartitionLock
    lock = PartitionLock(sys.argv[1], "tiny")
    assert lock.try_acquire(Holder.this_process(sys.argv[2]))[0]
    step = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], sys.argv[2]])
    print(step.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_step_bound_to_its_run_worker_dies_with_it(tmp_path):
    lock = tmp_path / "tiny.lock"
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(lock), "run-a", BOUND_STEP],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    step = int(worker.stdout.readline())
    # The step shares the worker's stdout: it prints its chain once bound.
    assert worker.stdout.readline() == "run worker step process\n"
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    killed = time.monotonic()
    while process_start(step) is not None and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert process_start(step) is None, "the step outlived its run's worker"
    assert time.monotonic() - killed < 2


FORKSERVER_WORKER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from cluster_pipeline.storage.run_lock import Holder, PartitionLock

    def step(lock, run):
        from cluster_pipeline.launch.fate import bind_step
        guard = bind_step(lock, run)
        print(" ".join(role for role, _, _ in guard.chain), flush=True)
        time.sleep(600)

    if __name__ == "__main__":
        lock = PartitionLock(sys.argv[1], "tiny")
        assert lock.try_acquire(Holder.this_process(sys.argv[2]))[0]
        proc = multiprocessing.get_context("forkserver").Process(target=step, args=sys.argv[1:3])
        proc.start()
        print(proc.pid, flush=True)
        time.sleep(600)
    """
)


def test_a_step_forked_by_a_fork_server_dies_with_its_run_worker(tmp_path):
    """Dagster's forkserver start method: the step's parent is the fork server, which outlives
    the worker while the step lives, so the step watches the worker itself."""
    lock, script = tmp_path / "tiny.lock", tmp_path / "worker.py"
    script.write_text(FORKSERVER_WORKER)
    worker = subprocess.Popen(
        [sys.executable, str(script), str(lock), "run-a"], stdout=subprocess.PIPE, text=True
    )
    assert worker.stdout is not None
    step = int(worker.stdout.readline())
    assert worker.stdout.readline() == "run worker executor process step process\n"
    server = int(Path(f"/proc/{step}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert server != worker.pid
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    killed = time.monotonic()
    while (process_start(step) or process_start(server)) and time.monotonic() - killed < 10:
        time.sleep(0.05)
    assert process_start(step) is None, "the step outlived its run's worker"
    assert process_start(server) is None, "the fork server outlived its last client"
    assert time.monotonic() - killed < 2
