"""A step process that dies without a Python error fails with its cause (issue 43: a SIGKILLed
step failed with a bare ``ChildProcessCrashException``): the signal or exit status, the likely
reason, and the last lines the step logged.

The kind, "a step's process ends without raising": killed by SIGKILL (the OOM killer's), by
SIGSEGV (native code), and ``os._exit`` with a status. The rewording itself is
:func:`~cluster_pipeline.launch.torchrun.process_crash`, checked exactly below; the slow test
runs a real job through the project's executor."""

import os
import subprocess
import sys
import textwrap

import dagster as dg
import pytest

from cluster_pipeline.launch.torchrun import process_crash

JOB = textwrap.dedent(
    """
    import os
    import signal

    import dagster as dg

    from cluster_pipeline.defs.executor import partition_locked_executor


    class Death(dg.Config):
        how: str = "SIGKILL"


    @dg.op
    def dies(context: dg.OpExecutionContext, config: Death) -> None:
        for i in range(7):
            context.log.info(f"line {i}")
        if config.how == "exit":
            os._exit(3)
        os.kill(os.getpid(), getattr(signal, config.how))


    @dg.job(executor_def=partition_locked_executor)
    def crash_job():
        dies()
    """
)


@pytest.mark.parametrize(
    ("exit_code", "ended"),
    [
        (
            -9,
            "was killed by signal SIGKILL (exit code -9): likely out of memory (the kernel's OOM "
            "killer sends SIGKILL; see `dmesg`, lower the batch size or max_length)",
        ),
        (
            -11,
            "was killed by signal SIGSEGV (exit code -11): a crash in native code "
            "(segmentation fault)",
        ),
        (3, "exited with status 3"),
        (None, "died without an exit status"),
    ],
)
def test_the_cause_names_the_signal_the_reason_and_the_last_lines(exit_code, ended):
    assert process_crash("step s", 42, exit_code, ["a", "b's"]) == (
        f"the process of step s (pid 42) {ended}; its last log lines: 'a' | \"b's\""
    )
    assert process_crash("step s", None, exit_code, []).endswith("; it logged nothing before")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "ended"),
    [
        ("SIGKILL", "was killed by signal SIGKILL (exit code -9): likely out of memory"),
        ("exit", "exited with status 3"),
    ],
)
def test_a_crashed_step_fails_with_its_cause(tmp_path, how, ended):
    module = tmp_path / "crash_defs.py"
    module.write_text(JOB)
    (tmp_path / "run.yaml").write_text(f"ops:\n  dies:\n    config:\n      how: {how}\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "DAGSTER_HOME": str(home)}
    env.pop("CLUSTER_PIPELINE_RUN_GUARD", None)
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")
    out = subprocess.run(
        [dagster, "job", "execute", "-f", str(module), "-j", "crash_job", "-c", "run.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    with dg.DagsterInstance.from_config(str(home)) as instance:
        run = instance.get_runs(limit=1)[0]
        failures = [
            e.dagster_event
            for e in instance.all_logs(run.run_id)
            if e.dagster_event is not None and e.dagster_event.is_step_failure
        ]
    assert len(failures) == 1
    error = failures[0].step_failure_data.error
    assert error is not None and error.cls_name == "ChildProcessCrashException"
    assert error.message.startswith("the process of step dies (pid "), error.message
    assert f") {ended}" in error.message
    assert error.message.endswith(
        "; its last log lines: 'line 2' | 'line 3' | 'line 4' | 'line 5' | 'line 6'"
    )
