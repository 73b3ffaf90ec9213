"""Re-execute a failed or canceled run from its failure, as the web UI's "Re-execute > From
failure" does, for any run, those started from a shell included.

    cluster-pipeline reexecute <run_id> [--dry-run]     (the id, or its first characters)

The web UI re-executes only runs it launched itself: a run started by ``dagster asset
materialize`` or ``dagster job execute`` (``make run``, ``cluster-pipeline rerun``, the docs'
shell commands) records no code location, and Dagster's "From failure" on it fails with
``CheckError: Expected non-None value: None``. This command re-executes the run's failed and
not-yet-run steps in the Dagster instance `make` uses ($DAGSTER_HOME, else .dagster_home), with
the parent's run config and tags (its dataset partition among them), as a new run of the same
job loaded from ``cluster_pipeline.definitions``. The steps keep the partition's settings, and a
killed training resumes from its latest complete checkpoint, as any launch does. Prints the new
run's id and exits 1 when it fails. ``--dry-run`` prints which run, job, partition and steps it
would re-execute.
"""

from __future__ import annotations

import argparse
import os

from cluster_pipeline.cli import UserError, instance_home

# The tags a re-execution carries from its parent, besides the user's own (no "/" in the key):
# the partition, which the steps read. Dagster adds the re-execution's own (parent, root run).
_CARRIED_TAGS = ("dagster/partition", "dagster/partition_set")
# How a run's status (DagsterRunStatus' value) reads in a sentence ("run 1a2b... succeeded").
_STATES = {
    "SUCCESS": "succeeded",
    "STARTED": "is still running",
    "STARTING": "is starting",
    "QUEUED": "is queued",
    "NOT_STARTED": "has not started",
    "CANCELING": "is being canceled",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``reexecute`` arguments: the run id (or a unique prefix), ``--dry-run``."""
    parser.add_argument(
        "run_id", help="the failed run's id, or its first characters (the UI shows 8)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would be re-executed, run nothing"
    )


def find_run(instance, run_id: str):
    """The run of ``instance`` whose id is ``run_id`` or starts with it (at least 4 characters).

    Raises:
        UserError: no such run, or the prefix names several (they are listed).
    """
    run = instance.get_run_by_id(run_id)
    if run is not None:
        return run
    if len(run_id) < 4:
        raise UserError(f"no run {run_id!r}: give at least 4 characters of the run id")
    found = [r for r in instance.get_runs(limit=10_000) if r.run_id.startswith(run_id)]
    if not found:
        raise UserError(
            f"no run {run_id!r} in the Dagster instance at {instance_home()} ($DAGSTER_HOME): "
            "the runs page of the web UI, or `dagster run list`, shows the ids"
        )
    if len(found) > 1:
        ids = ", ".join(r.run_id for r in found[:5])
        raise UserError(f"{run_id!r} starts {len(found)} run ids ({ids}): give more characters")
    return found[0]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Re-execute the run from failure (module docstring)."""
    os.environ.setdefault("DAGSTER_HOME", str(instance_home()))
    import dagster as dg
    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.execution.plan.state import KnownExecutionState

    from cluster_pipeline.cli import PROJECT_ROOT

    with dg.DagsterInstance.get() as instance:
        parent = find_run(instance, args.run_id)
        if parent.status not in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
            value = parent.status.value
            state = _STATES.get(value, f"is {value.lower().replace('_', ' ')}")
            raise UserError(
                f"run {parent.run_id} {state}: only a failed or canceled run is re-executed "
                "from its failure"
            )
        # The steps "From failure" runs: those that failed or did not run (Dagster's own rule,
        # which execute_job applies again below).
        steps, _ = KnownExecutionState.build_resume_retry_reexecution(instance, parent)
        tags = {k: v for k, v in parent.tags.items() if k in _CARRIED_TAGS or "/" not in k}
        partition = tags.get("dagster/partition", "(none)")
        what = (
            f"run {parent.run_id} ({parent.job_name}, dataset partition {partition}): "
            f"steps {', '.join(steps)}"
        )
        if args.dry_run:
            print(f"would re-execute {what}")
            return
        print(f"re-executing {what}", flush=True)
        code = ReconstructableRepository.for_module(
            "cluster_pipeline.definitions", "defs", working_directory=str(PROJECT_ROOT)
        )
        job = code.get_reconstructable_job(parent.job_name)
        result = dg.execute_job(
            job,
            instance,
            run_config=parent.run_config,
            tags=tags,
            reexecution_options=dg.ReexecutionOptions.from_failure(parent.run_id, instance),
            raise_on_error=False,
        )
        print(f"run {result.run_id}: {'succeeded' if result.success else 'failed'}")
        if not result.success:
            raise SystemExit(1)
