"""The project's executor: Dagster's multiprocess executor, plus what a run must settle in its
worker process before its first step starts.

Every run that executes through the project's Definitions (the web UI, schedules, sensors,
``make run``'s ``dagster job execute``, ``dagster asset materialize``) runs its steps here, so
this is the one place that sees each run start and end, whoever started it:

1. **Settings.** Every stage config of the run, as the run will use it (its own knobs over the
   settings its dataset partition was last launched with: ``defs/partition_settings.py``), is
   validated (``defs/run_checks.py``: each knob's bounds, rules across stages, the data and the
   base model's chat template); a bad one fails the run at once with one line,
   ``<stage>.<knob> = <value>: <rule>``.
2. **One run per partition.** The run takes its dataset partition's lock
   (``storage/run_lock.py``), waiting up to ``partition_wait_seconds`` while another run holds it
   (and saying which); a lock left by a run that died is taken over, and that run, if still
   marked in progress, is marked failed. Holding it, the run records the knobs its launch gave
   as the partition's settings and logs what changed and what it keeps from earlier launches.
3. **A crashed step named.** A step process that dies without a Python error (a signal, the
   OOM killer's SIGKILL, ``os._exit``) fails with its cause: the signal or exit status, the
   likely reason, and the last lines the step logged, instead of Dagster's bare
   ``ChildProcessCrashException`` (issue 43).
4. **A watchdog** (``defs/run_watchdog.py``), started first, marks the run failed if this
   worker process dies (``kill -9``, the OOM killer) before the run's end is recorded: in the
   settings check, while it waits for the lock, during its steps, or after its last step;
   its step processes die with it (``launch/fate.py``).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pkgutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import dagster as dg

# The one private import, on purpose: while a run waits for its partition's lock, a terminate
# from the UI reaches this worker as SIGINT, which Dagster's run worker captures instead of
# raising (``capture_interrupts``). Dagster 1.13 exposes no public way to ask whether one
# arrived; without it a terminated run would sit in the wait for up to an hour. If a later
# Dagster drops it, loading the Definitions fails (every test does), not the wait, silently.
from dagster._utils.interrupts import check_captured_interrupt

from cluster_pipeline.defs.partition_settings import (
    SettingsUnreadable,
    effective_run_config,
    from_settings_file,
    launched_knobs,
    remember,
    run_settings_line,
    stored_settings,
)
from cluster_pipeline.defs.resources import StorageResource
from cluster_pipeline.defs.run_checks import ConfigRefused, check_run, resource_config
from cluster_pipeline.launch.progress import short_lines
from cluster_pipeline.launch.torchrun import process_crash
from cluster_pipeline.storage.layout import DataLayout
from cluster_pipeline.storage.partition_settings import PartitionSettings
from cluster_pipeline.storage.run_lock import Holder, PartitionBusy, PartitionLock

PARTITION_TAG = "dagster/partition"
WATCHDOG_MODULE = "cluster_pipeline.defs.run_watchdog"
PARTITION_WAIT_ENV = "CLUSTER_PIPELINE_PARTITION_WAIT_S"
# An hour: a run started from a shell while another run of its dataset is in progress waits
# for it (as the UI's queue makes a second run wait), then reuses its embeddings and
# checkpoint; a holder that hangs fails the waiter after an hour instead of never.
DEFAULT_PARTITION_WAIT_S = float(os.environ.get(PARTITION_WAIT_ENV) or 3600.0)

# What the fork server imports once, before it forks each step process: the Definitions and
# every stage module (Dagster, polars, the project; not torch or transformers, which the
# stages import only inside the functions that need them), so a step starts without
# importing them again. First, launch/fork_server.py: the server then ends at once after its
# run, without finalizing an interpreter that holds all of them (1-7 s).
PRELOAD_MODULES = [
    "cluster_pipeline.launch.fork_server",
    "cluster_pipeline.definitions",
    *(
        f"cluster_pipeline.defs.assets.{m.name}"
        for m in pkgutil.iter_modules([str(Path(__file__).parent / "assets")])
    ),
]

# The multiprocess executor's own fields (max_concurrent, retries, ...), and one of ours.
_MULTIPROCESS: Any = dg.multiprocess_executor.config_schema.config_type
_START_METHOD = _MULTIPROCESS.fields["start_method"]
_CONFIG = {
    **_MULTIPROCESS.fields,
    # Steps start from a fork server (Dagster's forkserver start method) that has imported the
    # project once: a selection run's five steps took 30-40 s instead of 50-55 s with spawn,
    # each of which imports Dagster, torch and the stages anew (docs/design.md, "Runs").
    "start_method": dg.Field(
        _START_METHOD.config_type,
        is_required=False,
        default_value={"forkserver": {"preload_modules": PRELOAD_MODULES}},
        description="How step processes start: forkserver (default: forked from a server that "
        "preloaded the project) or spawn (a fresh Python per step).",
    ),
    "partition_wait_seconds": dg.Field(
        float,
        default_value=DEFAULT_PARTITION_WAIT_S,
        description="Seconds a run waits for its dataset partition while another run holds it "
        "(a run started from a shell while another runs; the UI's queue already holds runs "
        "back); then it fails naming the holder. 0 = fail at once. Default: "
        f"${PARTITION_WAIT_ENV} if set, else 3600.",
    ),
}


class PartitionLockedExecutor(dg.Executor):
    """The multiprocess executor inside the three steps of the module docstring."""

    def __init__(self, inner: dg.Executor, partition_wait_s: float, preload: Sequence[str] = ()):
        self._inner = inner
        self._wait_s = partition_wait_s
        self._preload = list(preload)

    @property
    def retries(self):
        """The wrapped executor's retry mode."""
        return self._inner.retries

    @property
    def step_dependency_config(self):
        """The wrapped executor's step dependency settings."""
        return self._inner.step_dependency_config

    def execute(self, plan_context, execution_plan) -> Iterator[dg.DagsterEvent]:
        """Start the watchdog, check settings, take the partition lock, then run the plan."""
        run, instance = plan_context.dagster_run, plan_context.instance
        dataset = run.tags.get(PARTITION_TAG)
        # The watchdog watches every moment of a partitioned run, the settings check and the
        # wait for the lock included: a worker killed while it waits holds nothing, so no later
        # run would look at it, and its run would stay STARTED.
        watchdog = _start_watchdog(instance, run.run_id, dataset) if dataset else None
        try:
            yield from self._checked_and_locked(plan_context, execution_plan, dataset)
        finally:
            if watchdog is not None:
                _stop_watchdog(watchdog)

    def _checked_and_locked(
        self, plan_context, execution_plan, dataset: str | None
    ) -> Iterator[dg.DagsterEvent]:
        """Steps 1 and 2 of the module docstring around the inner executor's plan."""
        run, instance = plan_context.dagster_run, plan_context.instance
        run_config: Any = plan_context.run_config
        layout = StorageResource(**resource_config(run_config, "storage")).layout
        missing = missing_modules(self._preload)
        if missing:
            # multiprocessing's fork server skips a module it cannot import, saying nothing.
            _refuse(
                plan_context,
                f"execution.start_method.forkserver.preload_modules = {missing}: no such module "
                "(a typo?); name importable modules, or leave preload_modules out",
            )
        stages = execution_plan.step_keys_to_execute
        stored = self._settings(plan_context, layout, dataset)
        self._check(plan_context, stages, layout, dataset, stored)
        if dataset is None:  # every stage is partitioned; other jobs take no lock
            yield from self._inner.execute(plan_context, execution_plan)
            return
        lock = PartitionLock(layout.partition_lock(dataset), dataset)
        me = Holder.this_process(run.run_id, run.job_name)

        def waiting(holder: Holder | None, waited: float) -> None:
            who = holder.describe() if holder else "another process"
            plan_context.log.info(
                f"dataset partition {dataset!r} is held by {who}; waiting "
                f"({waited:.0f} of {self._wait_s:.0f} s, executor config partition_wait_seconds)"
            )

        try:
            stale = lock.acquire(
                me,
                self._wait_s,
                on_wait=waiting,
                interrupted=lambda: check_captured_interrupt() or _terminating(instance, run),
            )
        except PartitionBusy as e:
            _refuse(plan_context, str(e))
        if not lock.held:
            raise dg.DagsterExecutionInterruptedError()  # terminated while it waited
        try:
            if stale is not None and stale.run_id == run.run_id:
                # This run again, in a new worker (a resumed run): nothing to mark.
                plan_context.log.info(f"resuming after {stale.describe()} died")
            elif stale is not None:
                plan_context.log.warning(_take_over(instance, dataset, stale))
            plan_context.log.info(f"holding dataset partition {dataset!r} ({lock.path})")
            self._remember(plan_context, stages, layout, dataset, stored)
            yield from self._inner.execute(plan_context, execution_plan)
        finally:
            lock.release()

    @staticmethod
    def _settings(
        plan_context, layout: DataLayout, dataset: str | None
    ) -> PartitionSettings | None:
        """The partition's settings (None for a run of no partition); a damaged file refuses
        the run, naming it."""
        if dataset is None:
            return None
        try:
            return stored_settings(layout, dataset)
        except SettingsUnreadable as e:
            _refuse(plan_context, str(e))

    @staticmethod
    def _check(
        plan_context,
        stages: list[str],
        layout: DataLayout,
        dataset: str | None,
        stored: PartitionSettings | None,
    ) -> None:
        """Step 1 of the module docstring, on the run config as the run uses it."""
        run = plan_context.dagster_run
        run_config: Any = plan_context.run_config
        if stored is not None:
            run_config = effective_run_config(run_config, run.tags, stored)
        try:
            check_run(run_config, stages, plan_context.instance, dataset, layout)
        except ConfigRefused as e:
            note = ""
            launched = launched_knobs(run.run_config, run.tags)
            taken = (
                [] if stored is None else from_settings_file(str(e).split("; "), launched, stored)
            )
            if taken:
                note = (
                    f" ({', '.join(taken)}: not given by this run's config, taken from "
                    f"{layout.partition_settings(str(dataset))}, the settings dataset partition "
                    f"{dataset!r} was last launched with: give them in the run config, or edit "
                    "or delete the file)"
                )
            _refuse(plan_context, f"{e}{note}")

    def _remember(
        self,
        plan_context,
        stages: list[str],
        layout: DataLayout,
        dataset: str,
        checked: PartitionSettings | None,
    ) -> None:
        """Under the partition's lock: the settings checked again if another run changed them
        meanwhile, then this run's knobs recorded and the settings line logged."""
        run = plan_context.dagster_run
        now = self._settings(plan_context, layout, dataset)
        if now != checked:
            self._check(plan_context, stages, layout, dataset, now)
        launched = launched_knobs(run.run_config, run.tags)
        try:
            settings, changes = remember(layout, dataset, run.run_id, launched)
        except (SettingsUnreadable, OSError) as e:
            _refuse(plan_context, f"dataset partition {dataset!r}: its settings: {e}")
        path = str(layout.partition_settings(dataset))
        line = run_settings_line(dataset, path, stages, launched, settings, changes)
        for piece in short_lines(line) if line is not None else []:
            plan_context.log.info(piece)  # lines a person reads whole (issue 44)


@dg.executor(
    name="multiprocess",
    config_schema=_CONFIG,
    requirements=dg.multiprocess_executor.get_requirements,  # pyright: ignore[reportArgumentType]
)
def partition_locked_executor(init_context: dg.InitExecutorContext) -> dg.Executor:
    """Dagster's multiprocess executor (same config) that validates the run's settings, holds
    its dataset partition for the whole run, and marks the run failed if its worker dies."""
    inner = dg.multiprocess_executor.executor_creation_fn(init_context)  # pyright: ignore[reportOptionalCall]
    name_crashes(inner)
    config: Any = init_context.executor_config
    wait = float(config.get("partition_wait_seconds", DEFAULT_PARTITION_WAIT_S))
    forkserver = (config.get("start_method") or {}).get("forkserver") or {}
    return PartitionLockedExecutor(inner, wait, forkserver.get("preload_modules") or [])


# Lines of a crashed step's log its failure quotes.
CRASH_LOG_LINES = 5
CRASH = "ChildProcessCrashException"


def last_log_lines(instance: dg.DagsterInstance, run_id: str, step_key: str, n: int) -> list[str]:
    """The last ``n`` lines the step ``step_key`` of run ``run_id`` logged itself
    (``context.log``: not Dagster's own events), oldest first."""
    lines = [
        entry.user_message
        for entry in instance.all_logs(run_id)
        if entry.step_key == step_key and entry.dagster_event is None and entry.user_message
    ]
    return lines[-n:]


def name_crashes(executor: dg.Executor) -> None:
    """Make ``executor`` (Dagster's multiprocess executor) fail a step whose process crashed
    with the cause (:func:`~cluster_pipeline.launch.torchrun.process_crash`: signal or exit
    status, likely reason, the step's last log lines) as the error's message, where Dagster
    records a ``ChildProcessCrashException`` with none.

    The multiprocess executor builds that failure in ``log_failure_or_retry_event_after_error``
    while it handles the crash (the exception, with its ``pid`` and ``exit_code``, is the one
    being handled); the instance's method is wrapped to reword it first. Every other failure
    passes unchanged."""
    original = executor.log_failure_or_retry_event_after_error

    def log_failure_or_retry(step_context, err_info, known_state):
        if err_info.cls_name == CRASH:
            crash = sys.exc_info()[1]
            key = step_context.step.key
            lines = last_log_lines(step_context.instance, step_context.run_id, key, CRASH_LOG_LINES)
            cause = process_crash(
                f"step {key}",
                getattr(crash, "pid", None),
                getattr(crash, "exit_code", None),
                lines,
            )
            err_info = err_info._replace(message=cause)
        return original(step_context, err_info, known_state)

    executor.log_failure_or_retry_event_after_error = log_failure_or_retry  # pyright: ignore[reportAttributeAccessIssue]


def missing_modules(modules: Sequence[str]) -> list[str]:
    """Those of ``modules`` that cannot be found on ``sys.path`` (``importlib.util.find_spec``
    is None, or a parent package is missing)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _refuse(plan_context, message: str) -> NoReturn:
    """Fail the run with ``message`` as its failure, before any step, without a traceback: the
    run is marked failed first, and the interrupt that ends execution then adds no second
    failure (Dagster's run iterator sees a run already failed)."""
    plan_context.log.error(message)
    plan_context.instance.report_run_failed(plan_context.dagster_run, message)
    raise dg.DagsterExecutionInterruptedError()


def _terminating(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    current = instance.get_run_by_id(run.run_id)
    return current is not None and current.status == dg.DagsterRunStatus.CANCELING


def _take_over(instance: dg.DagsterInstance, dataset: str, stale: Holder) -> str:
    """Mark the run that left ``stale`` failed, if this instance still has it in progress; the
    log line naming it."""
    dead = instance.get_run_by_id(stale.run_id)
    if dead is not None and not dead.is_finished:
        instance.report_run_failed(
            dead,
            f"marked failed by run of the same partition: the worker process of this run "
            f"(pid {stale.pid} on host {stale.host}) died without releasing dataset partition "
            f"{dataset!r}; re-execute the run to resume it",
        )
        status = "it was still marked in progress and is now marked failed"
    elif dead is not None:
        status = f"it is marked {dead.status.value}"
    else:
        status = "it is not a run of this Dagster instance"
    return (
        f"took over dataset partition {dataset!r} from {stale.describe()}, whose worker died "
        f"without releasing it; {status}"
    )


def _start_watchdog(instance: dg.DagsterInstance, run_id: str, dataset: str):
    """The watchdog process of this run (None for an in-memory instance, which no other process
    can reach)."""
    if instance.is_ephemeral:
        return None
    watchdog = subprocess.Popen(
        [sys.executable, "-m", WATCHDOG_MODULE, run_id, str(os.getpid()), dataset],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a kill of the run's process group spares it
        text=True,
    )
    assert watchdog.stdin is not None
    watchdog.stdin.write(dg.serialize_value(instance.get_ref()) + "\n")
    watchdog.stdin.flush()
    # At this process's normal exit, after Dagster recorded the run's end: "exit" (a kill
    # leaves the watchdog end of file instead).
    atexit.register(_worker_exits, watchdog)
    return watchdog


def _stop_watchdog(watchdog: subprocess.Popen) -> None:
    """Tell the watchdog the plan ended here. Dagster records the run's end after this, in this
    process; the watchdog exits at this process's normal exit (:func:`_worker_exits`) and marks
    the run failed if the process is killed before it (defs/run_watchdog.py)."""
    try:
        assert watchdog.stdin is not None
        watchdog.stdin.write("done\n")
        watchdog.stdin.flush()
    except OSError:
        watchdog.kill()


def _worker_exits(watchdog: subprocess.Popen) -> None:
    """At this process's normal exit: "exit" to the watchdog, which then ends without looking."""
    try:
        assert watchdog.stdin is not None
        watchdog.stdin.write("exit\n")
        watchdog.stdin.close()
    except (OSError, ValueError):  # the watchdog is gone, or its pipe already closed
        pass
