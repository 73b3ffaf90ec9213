"""The run watchdog (defs/run_watchdog.py) against a real Dagster instance and a real worker
process: it marks the run failed when the worker dies before the run's end is recorded, whether
mid-plan (no ``done``) or after its plan ended (``done``, then killed before Dagster wrote the
run's end: ``cluster-pipeline dev``'s SIGKILL landed there once and left the run STARTED), and
marks nothing when the run's end was recorded."""

import signal
import subprocess
import sys
import time

import dagster as dg
import pytest

from cluster_pipeline.defs.executor import WATCHDOG_MODULE
from cluster_pipeline_tests.runs import failure_message, run_of, wait_for

pytestmark = pytest.mark.slow  # each watchdog imports Dagster (seconds)


@dg.op
def _noop() -> None:
    pass


@dg.job
def _one_step() -> None:
    _noop()


def _watch(instance: dg.DagsterInstance, run_id: str, worker: subprocess.Popen, done: bool):
    watchdog = subprocess.Popen(
        [sys.executable, "-m", WATCHDOG_MODULE, run_id, str(worker.pid), "tiny"],
        stdin=subprocess.PIPE,
        start_new_session=True,
        text=True,
    )
    assert watchdog.stdin is not None
    watchdog.stdin.write(dg.serialize_value(instance.get_ref()) + "\n")
    if done:
        watchdog.stdin.write("done\n")
    watchdog.stdin.close()
    return watchdog


def _worker() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.mark.parametrize("done", [True, False], ids=["after the plan", "mid-plan"])
def test_a_worker_killed_before_the_run_end_is_recorded_leaves_a_failed_run(tmp_path, done):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        run = instance.create_run_for_job(_one_step)
        worker = _worker()
        watchdog = _watch(instance, run.run_id, worker, done)
        if done:
            # The plan ended; the worker is alive, so the run's end may still be recorded.
            time.sleep(3)
            assert watchdog.poll() is None
            assert not run_of(instance, run.run_id).is_finished
        worker.send_signal(signal.SIGKILL)  # not reaped: a zombie counts as gone
        assert watchdog.wait(timeout=60) == 0
        worker.wait()
        assert run_of(instance, run.run_id).status == dg.DagsterRunStatus.FAILURE
        when = (
            "after its steps ended but before it recorded the run's end"
            if done
            else "before the run ended"
        )
        assert failure_message(instance, run.run_id).startswith(
            f"the worker process of this run (pid {worker.pid}) died {when} (killed by a "
            "signal, or out of memory);"
        )


def test_a_recorded_end_is_left_alone(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = _one_step.execute_in_process(instance=instance)
        worker = _worker()
        watchdog = _watch(instance, result.run_id, worker, done=True)
        worker.terminate()
        worker.wait()
        assert watchdog.wait(timeout=60) == 0
        run = wait_for(lambda: run_of(instance, result.run_id), 1, "the run")
        assert run.status == dg.DagsterRunStatus.SUCCESS
        assert failure_message(instance, result.run_id) == ""
