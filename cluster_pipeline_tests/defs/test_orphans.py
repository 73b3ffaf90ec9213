"""No process outlives the run that started it, and nothing is committed by a run that died
(issue 23, item 4): SIGKILL of the Dagster step process during training, of the run's worker
during evaluation, and of a run worker launched by the daemon (the web UI's path), which also
holds its partition against a run started from a shell (item 5) and refuses bad settings
before any step (item 6). The CLI worker killed during the embedding pass is in
test_partition_runs.py."""

import signal
import socket
import subprocess
import time

import dagster as dg
import psutil
import pytest

from cluster_pipeline.defs.stages import SELECTION_STAGES
from cluster_pipeline.storage.run_lock import PartitionLock
from cluster_pipeline_tests.helpers import seed_embeddings
from cluster_pipeline_tests.runs import (
    BIN,
    EMBED,
    EVALUATE,
    LAUNCH,
    ROOT,
    TRAIN,
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


def _stop(procs: list[psutil.Process]) -> None:
    """SIGSTOP: hold a rank where it is, so the kill below lands mid-step, however fast the
    machine."""
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)


def _finished_run(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRun | None:
    run = run_of(instance, run_id)
    return run if run.is_finished else None


def _holder(project: Project, dataset: str = "tiny"):
    return PartitionLock(project.data / "locks" / f"{dataset}.lock").holder()


def test_a_killed_step_or_worker_leaves_no_process_and_commits_nothing(
    tmp_path, tiny_model_dir, tiny_embedding_cache
):
    with Project.create(tmp_path, tiny_model_dir) as project:
        seed_embeddings(tiny_embedding_cache, project.data)  # the pass is not what dies here
        chain = ",".join(SELECTION_STAGES)
        out = project.materialize(chain, project.config("chain", SELECTION_STAGES))
        assert out.returncode == 0, out.stdout[-3000:]
        checkpoints = project.data / "checkpoints" / "tiny"

        # 1. SIGKILL of the step process (not of its worker) in the middle of training.
        long = project.config("long", ["trained_checkpoint"], trained_checkpoint={"epochs": 30})
        worker = project.start_materialize("trained_checkpoint", long, log="train")
        wait_for(
            lambda: any(p.stat().st_size for p in checkpoints.glob("*.metrics.jsonl")),
            300,
            "the first optimizer step",
        )
        ranks = processes(runs_module(TRAIN, project))
        assert len(ranks) == 2
        _stop(ranks)
        (launcher,) = processes(runs_module(TRAIN, project, launcher=True))
        step = launcher.parent()
        # The step is the worker's child (spawn) or its fork server's (the default).
        assert step is not None and worker.pid in (step.ppid(), psutil.Process(step.ppid()).ppid())
        doomed = [p.pid for p in (launcher, *ranks)]
        step.send_signal(signal.SIGKILL)
        gone = seconds_until_gone(doomed, timeout=30)
        print(f"training launcher and ranks gone {gone:.2f} s after the step's SIGKILL")
        assert gone < 5
        assert worker.wait(timeout=300) != 0
        assert "child process for step trained_checkpoint was terminated by signal 9" in (
            project.log("train")
        )
        assert not list(checkpoints.glob("*/training_info.json"))  # no checkpoint renamed in
        assert _holder(project) is None  # the run ended (failed) and released its partition

        # 2. SIGKILL of the worker in the middle of evaluating (a finished checkpoint first).
        out = project.materialize("trained_checkpoint", project.config("t", ["trained_checkpoint"]))
        assert out.returncode == 0, out.stdout[-3000:]
        worker = project.start_materialize(
            "eval_report", project.config("e", ["eval_report"]), log="eval"
        )
        ranks = wait_for(lambda: processes(runs_module(EVALUATE, project)), 300, "evaluation")
        time.sleep(2)  # past its first lines, which arm its parent-death signal
        _stop(ranks)
        run_id = wait_for(lambda: _holder(project), 10, "the lock").run_id
        doomed = [
            p
            for p in descendants(worker.pid)
            if WATCHDOG not in " ".join(psutil.Process(p).cmdline())
        ]
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        gone = seconds_until_gone(doomed, timeout=30)
        print(f"evaluation step, launcher and process gone {gone:.2f} s after the worker's SIGKILL")
        assert gone < 5
        with project.instance() as instance:
            run = wait_for(lambda: _finished_run(instance, run_id), 60, "the run marked failed")
            assert run.status == dg.DagsterRunStatus.FAILURE
            assert "the worker process of this run" in failure_message(instance, run_id)
        time.sleep(3)
        assert not (project.data / "tables" / "eval_item_scores").exists()
        assert not (project.data / "reports" / "tiny" / "eval_report.md").exists()


def test_a_daemon_launched_run_holds_its_partition_and_dies_whole(tmp_path, tiny_model_dir):
    """The web UI's path (the daemon launches the run through the code server): a shell run of
    the partition is refused naming it; a bad setting is refused before any step; SIGKILL of
    its worker leaves nothing running and no table, and the run is marked failed."""
    with Project.create(tmp_path, tiny_model_dir, datasets=("tiny", "other")) as project:
        daemon = subprocess.Popen(
            [BIN / "dagster-daemon", "run", "-w", "workspace.yaml"],
            cwd=ROOT,
            env=project.env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            config = project.config(
                "sel",
                SELECTION_STAGES,
                proxy_embeddings={"world_size": 2, "chunk_size": 2},
            )

            def launch(config, partition):
                out = project.cli(
                    "dagster", "job", "launch", "-w", "workspace.yaml", "-j", "selection_job",
                    "-c", str(config), "--tags", f'{{"dagster/partition": "{partition}"}}',
                )  # fmt: skip
                assert out.returncode == 0, out.stdout[-3000:]

            launch(config, "tiny")
            wait_for(
                lambda: len(processes(runs_module(EMBED, project))) == 2,
                600,
                "the embedding ranks of the launched run",
            )
            wait_for(
                lambda: list((project.data / "cache").rglob("chunk_*.parquet")), 300, "a chunk"
            )
            _stop(processes(runs_module(EMBED, project)))
            holder = wait_for(lambda: _holder(project), 10, "the lock")

            # A run from a shell is refused at once, naming the daemon's run.
            raw = project.config(
                "raw", ["raw_instructions"], execution={"partition_wait_seconds": 0}
            )
            out = project.materialize("raw_instructions", raw)
            assert out.returncode != 0
            assert (
                f"dataset partition 'tiny' is held by run {holder.run_id} (job selection_job, "
                f"pid {holder.pid} on host {socket.gethostname()}, since " in out.stdout
            ), out.stdout[-3000:]

            # A bad setting is refused before any step runs, in one line (another partition:
            # the queue would hold it behind the run above).
            launch(
                project.config("bad", SELECTION_STAGES, peripheral_subsets={"ratio": 1.5}), "other"
            )
            with project.instance() as instance:

                def bad_run():
                    runs = instance.get_runs(dg.RunsFilter(tags={"dagster/partition": "other"}))
                    return runs[0] if runs and runs[0].is_finished else None

                run = wait_for(bad_run, 300, "the bad run to end")
                assert run.status == dg.DagsterRunStatus.FAILURE
                assert failure_message(instance, run.run_id) == (
                    "peripheral_subsets.ratio = 1.5: Input should be less than or equal to 1"
                )
                events = instance.all_logs(run.run_id)
                assert not [
                    e for e in events if e.dagster_event_type == dg.DagsterEventType.STEP_START
                ]
                assert not (project.data / "tables" / "raw_instructions" / "other").exists()

            # SIGKILL of the daemon-launched run's worker.
            worker = psutil.Process(holder.pid)
            doomed = [
                p for p in descendants(worker.pid)
                if WATCHDOG not in " ".join(psutil.Process(p).cmdline())
            ]  # fmt: skip
            assert processes(runs_module(EMBED, project, launcher=True))
            assert any(LAUNCH in " ".join(psutil.Process(p).cmdline()) for p in doomed)
            worker.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            gone = seconds_until_gone(doomed, timeout=30)
            print(f"step, launcher and ranks gone {gone:.2f} s after the worker's SIGKILL")
            assert gone < 5
            with project.instance() as instance:
                run = wait_for(
                    lambda: _finished_run(instance, holder.run_id), 120, "the run marked failed"
                )
                print(f"run marked failed {time.monotonic() - killed:.1f} s after the SIGKILL")
                assert run.status == dg.DagsterRunStatus.FAILURE
            time.sleep(3)
            assert not (project.data / "tables" / "proxy_embeddings").exists()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon.kill()
