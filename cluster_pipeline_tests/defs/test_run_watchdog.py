"""The run watchdog (defs/run_watchdog.py) against a real Dagster instance and a real worker
process that starts and stops it through the executor's own functions: it marks the run failed
when the worker is killed before the run's end is recorded, whether mid-plan or after its plan
ended (``cluster-pipeline dev``'s SIGKILL landed there once and left the run STARTED), and
ends without touching the run at the worker's normal exit."""

import signal
import subprocess
import sys

import dagster as dg
import pytest

from cluster_pipeline_tests.runs import failure_message, run_of

pytestmark = pytest.mark.slow  # a worker and a watchdog importing Dagster (seconds)

WORKER = """
import sys, time
import dagster as dg
from cluster_pipeline.defs.executor import _start_watchdog, _stop_watchdog

ref, run_id, stage = sys.argv[1:4]
instance = dg.DagsterInstance.from_ref(dg.deserialize_value(ref))
watchdog = _start_watchdog(instance, run_id, "tiny")
if stage != "mid-plan":
    _stop_watchdog(watchdog)  # the plan ended
print(watchdog.pid, flush=True)
if stage != "normal exit":
    time.sleep(120)  # killed here
"""


@dg.op
def _noop() -> None:
    pass


@dg.job
def _one_step() -> None:
    _noop()


def _worker(instance: dg.DagsterInstance, run_id: str, stage: str):
    ref = dg.serialize_value(instance.get_ref())
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, ref, run_id, stage], stdout=subprocess.PIPE, text=True
    )
    assert worker.stdout is not None
    watchdog_pid = int(worker.stdout.readline())
    return worker, watchdog_pid


def _wait_gone(pid: int, timeout: float = 60) -> None:
    import psutil

    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        pass


@pytest.mark.parametrize("stage", ["after the plan", "mid-plan"])
def test_a_worker_killed_before_the_run_end_is_recorded_leaves_a_failed_run(tmp_path, stage):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        run = instance.create_run_for_job(_one_step)
        worker, watchdog = _worker(instance, run.run_id, stage)
        assert not run_of(instance, run.run_id).is_finished
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        _wait_gone(watchdog)
        assert run_of(instance, run.run_id).status == dg.DagsterRunStatus.FAILURE
        when = (
            "after its steps ended but before it recorded the run's end"
            if stage == "after the plan"
            else "before the run ended"
        )
        assert failure_message(instance, run.run_id).startswith(
            f"the worker process of this run (pid {worker.pid}) died {when} (killed by a "
            "signal, or out of memory);"
        )


def test_a_normal_exit_leaves_the_recorded_end_alone(tmp_path):
    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        result = _one_step.execute_in_process(instance=instance)
        worker, watchdog = _worker(instance, result.run_id, "normal exit")
        assert worker.wait(timeout=60) == 0
        _wait_gone(watchdog)
        assert run_of(instance, result.run_id).status == dg.DagsterRunStatus.SUCCESS
        assert failure_message(instance, result.run_id) == ""
