"""Runs of one dataset partition exclude each other wherever they start, and a run whose worker
is killed leaves nothing running, commits nothing, is marked failed, and its partition is taken
over by the next run, which names it (issue 23, items 4 and 5). Real ``dagster`` and ``make``
commands on a tiny model; the daemon-launched case is in test_orphans.py."""

import re
import signal
import socket
import time

import dagster as dg
import polars as pl
import psutil
import pytest

from cluster_pipeline.storage.run_lock import PartitionLock
from cluster_pipeline_tests.runs import (
    EMBED,
    LAUNCH,
    WATCHDOG,
    Project,
    descendants,
    failure_message,
    processes,
    run_of,
    runs_module,
    seconds_until_gone,
    wait_for,
)

pytestmark = pytest.mark.slow

EMBED_SLOW = {"world_size": 2, "chunk_size": 2}  # many chunks: the pass is in progress a while
NO_WAIT = {"partition_wait_seconds": 0.0}


def _holder_run_id(project: Project, dataset: str = "tiny") -> str | None:
    holder = PartitionLock(project.data / "locks" / f"{dataset}.lock").holder()
    return holder.run_id if holder else None


def _embedding_started(project: Project) -> list[psutil.Process]:
    return processes(runs_module(EMBED, project))


def _pause_in_the_embedding_pass(project: Project) -> list[psutil.Process]:
    """Wait until the embedding pass has written a chunk, then stop (SIGSTOP) its ranks, so the
    run holds its partition, mid-pass, for as long as the test needs."""
    ranks = wait_for(lambda: len(_embedding_started(project)) == 2, 300, "two embedding ranks")
    assert ranks
    wait_for(lambda: list((project.data / "cache").rglob("chunk_*.parquet")), 300, "a chunk")
    ranks = _embedding_started(project)
    for rank in ranks:
        rank.send_signal(signal.SIGSTOP)
    return ranks


def test_two_cli_runs_of_a_partition_take_turns_and_embed_once(tmp_path, tiny_model_dir):
    with Project.create(tmp_path, tiny_model_dir) as project:
        config = project.config("run", ["raw_instructions", "proxy_embeddings"])
        first = project.start_materialize("raw_instructions,proxy_embeddings", config, log="a")
        second = project.start_materialize("raw_instructions,proxy_embeddings", config, log="b")
        assert first.wait(timeout=600) == 0, project.log("a")[-3000:]
        assert second.wait(timeout=600) == 0, project.log("b")[-3000:]
        with project.instance() as instance:
            records = instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": "tiny"}))
            assert len(records) == 2
            # One waited, naming the run that held the partition (which run took the lock first
            # depends on the machine's load, not on which command started first).
            waiter = project.log("a") if "is held by run" in project.log("a") else project.log("b")
            own = re.search(r" - (\S+) - \d+ - RUN_START", waiter)
            assert own is not None
            (holder,) = [r for r in records if r.dagster_run.run_id != own.group(1)]
            held = f"dataset partition 'tiny' is held by run {holder.dagster_run.run_id} (job "
            assert held in waiter
            assert f"pid {_pid_of(project, holder)} on host {socket.gethostname()}" in waiter
            assert "waiting (0 of 3600 s, executor config partition_wait_seconds)" in waiter
            materializations = _embedded_now(instance)
            assert materializations[0] > 0 and materializations[1] == 0  # the second reused them


def _pid_of(project: Project, record) -> int:
    """The worker pid of a run, from its RUN_START log line."""
    for log in ("a", "b"):
        text = project.log(log)
        if record.dagster_run.run_id in text:
            found = re.search(
                rf"{record.dagster_run.run_id} - (\d+) - RUN_START", text, flags=re.MULTILINE
            )
            if found:
                return int(found.group(1))
    raise AssertionError("no RUN_START line for the run")


def _finished(instance, run_id: str) -> dg.DagsterRun | None:
    run = run_of(instance, run_id)
    return run if run.is_finished else None


def _embedded_now(instance) -> list[int]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("proxy_embeddings"), asset_partitions=["tiny"]),
        limit=10,
    ).records
    values = [
        int(str(r.asset_materialization.metadata["samples_embedded_now"].value))
        for r in sorted(records, key=lambda r: r.storage_id)
        if r.asset_materialization is not None
    ]
    return values


def test_a_killed_run_while_it_holds_its_partition(tmp_path, tiny_model_dir):
    """While a CLI run embeds: a second `make run` of the partition fails at once naming it, a
    run of another partition is not held back. Then its worker is SIGKILLed: its step,
    launcher and ranks exit within seconds, no table version is committed, the run is marked
    failed, and the next run takes the partition over naming it."""
    with Project.create(tmp_path, tiny_model_dir, datasets=("tiny", "other")) as project:
        config = project.config(
            "embed", ["raw_instructions", "proxy_embeddings"], **{"proxy_embeddings": EMBED_SLOW}
        )
        worker = project.start_materialize(
            "raw_instructions,proxy_embeddings", config, log="holder"
        )
        _pause_in_the_embedding_pass(project)
        run_id = wait_for(lambda: _holder_run_id(project), 10, "the partition lock")

        # A second `make run` of the partition: refused at once, naming the holder.
        start = time.monotonic()
        out = project.cli(
            "make", "run", "DATASET=tiny", CLUSTER_PIPELINE_PARTITION_WAIT_S="0", timeout=300
        )
        assert out.returncode != 0
        lines = [line for line in out.stdout.splitlines() if "is held by run" in line]
        assert len(lines) == 1, out.stdout[-3000:]
        assert (
            f"dataset partition 'tiny' is held by run {run_id} (job __ASSET_JOB, pid " in lines[0]
        )
        assert f"pid {worker.pid} on host {socket.gethostname()}" in lines[0]
        assert "not waiting (partition_wait_seconds: 0)" in lines[0]
        assert "Traceback" not in out.stdout
        print(f"second make run refused in {time.monotonic() - start:.1f} s")

        # Another partition is not held back (it would fail at once if it were).
        other = project.config("other", ["raw_instructions"], execution=NO_WAIT)
        out = project.materialize("raw_instructions", other, partition="other")
        assert out.returncode == 0 and "is held by" not in out.stdout, out.stdout[-3000:]

        # A run that waits for the partition, SIGKILLed while it waits: it holds nothing, so
        # only its watchdog (started before the wait) can mark it failed.
        waiter = project.start_materialize(
            "raw_instructions", project.config("raw", ["raw_instructions"]), log="waiter"
        )
        wait_for(lambda: "is held by run" in project.log("waiter"), 120, "the waiter waiting")
        with project.instance() as instance:
            (waiting_id,) = [
                r.run_id
                for r in instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
                if r.run_id != run_id
            ]
        waiter.send_signal(signal.SIGKILL)
        waiter.wait()
        with project.instance() as instance:
            run = wait_for(lambda: _finished(instance, waiting_id), 60, "the waiter marked failed")
            assert run.status.value == "FAILURE"
            assert failure_message(instance, waiting_id).startswith(
                f"the worker process of this run (pid {waiter.pid}) died before the run ended"
            )
        assert _holder_run_id(project) == run_id  # the holder is untouched

        # SIGKILL of the worker (`dagster asset materialize` itself) in the embedding pass.
        _embedding_started(project)
        tree = descendants(worker.pid)
        watchdog = [
            p.pid for p in processes(lambda p: WATCHDOG in p.cmdline()) if run_id in p.cmdline()
        ]
        doomed = [p for p in tree if p not in watchdog]
        launchers = [p for p in doomed if any(LAUNCH in c for c in psutil.Process(p).cmdline())]
        assert launchers and len(doomed) >= 4, "step, launcher and two ranks"
        worker.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        worker.wait()
        gone = seconds_until_gone(doomed, timeout=30)
        print(f"step, launcher and ranks gone {gone:.2f} s after the worker's SIGKILL")
        assert gone < 5
        with project.instance() as instance:
            run = wait_for(lambda: _finished(instance, run_id), 60, "the run marked failed")
            print(f"run marked failed {time.monotonic() - killed:.1f} s after the SIGKILL")
            assert run.status.value == "FAILURE"
            assert failure_message(instance, run_id).startswith(
                f"the worker process of this run (pid {worker.pid}) died before the run ended"
            )
        assert seconds_until_gone(watchdog, timeout=10) < 10
        time.sleep(5)  # nothing commits afterwards either
        assert not (project.data / "tables" / "proxy_embeddings").exists()
        for chunk in (project.data / "cache").rglob("chunk_*.parquet"):
            pl.read_parquet(chunk)  # finished chunks are intact
        lock = PartitionLock(project.data / "locks" / "tiny.lock")
        assert not lock.is_held() and lock.holder() is not None  # left behind by the dead run

        # The next run takes the partition over, naming the dead run, and finishes.
        out = project.materialize("raw_instructions,proxy_embeddings", config)
        assert out.returncode == 0, out.stdout[-3000:]
        assert (
            f"took over dataset partition 'tiny' from run {run_id} (job __ASSET_JOB, pid "
            f"{worker.pid} on host {socket.gethostname()}" in out.stdout
        )
        assert "whose worker died without releasing it; it is marked FAILURE" in out.stdout
        assert lock.holder() is None and not lock.is_held()  # released on success


def test_a_dead_run_nobody_marked_is_marked_failed_by_the_next_run(tmp_path, tiny_model_dir):
    """Worker and watchdog both killed (say, the machine's OOM killer took both): the run stays
    STARTED until the next run of the partition finds its lock stale and marks it failed."""
    with Project.create(tmp_path, tiny_model_dir) as project:
        config = project.config(
            "embed", ["raw_instructions", "proxy_embeddings"], **{"proxy_embeddings": EMBED_SLOW}
        )
        worker = project.start_materialize("raw_instructions,proxy_embeddings", config)
        wait_for(lambda: _embedding_started(project), 300, "the embedding ranks")
        run_id = wait_for(lambda: _holder_run_id(project), 10, "the partition lock")
        watchdog = processes(lambda p: WATCHDOG in p.cmdline() and run_id in p.cmdline())
        assert len(watchdog) == 1
        watchdog[0].send_signal(signal.SIGKILL)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        time.sleep(5)
        with project.instance() as instance:
            assert run_of(instance, run_id).status.value == "STARTED"
        out = project.materialize("raw_instructions", project.config("raw", ["raw_instructions"]))
        assert out.returncode == 0, out.stdout[-3000:]
        assert (
            f"took over dataset partition 'tiny' from run {run_id}" in out.stdout
            and "it was still marked in progress and is now marked failed" in out.stdout
        )
        with project.instance() as instance:
            assert run_of(instance, run_id).status.value == "FAILURE"
            assert failure_message(instance, run_id).startswith(
                f"marked failed by run of the same partition: the worker process of this run (pid "
                f"{worker.pid} on host {socket.gethostname()}) died without releasing dataset "
                "partition 'tiny'"
            )
