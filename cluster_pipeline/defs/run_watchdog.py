"""The watchdog of one run: marks the run failed if its worker process dies before the run's end
is recorded.

    python -m cluster_pipeline.defs.run_watchdog <run id> <worker pid> <dataset>

Started by the project's executor (``defs/executor.py``) in its own session (a Ctrl-C or a kill
of the run's process group spares it), it reads the Dagster instance's reference (serialized)
from stdin, then waits on stdin. The worker writes ``done`` when its plan ends and ``exit`` at
its normal exit, after Dagster recorded the run's end (success or failure). End of file without
both means the worker was killed: mid-plan (``kill -9``, the out-of-memory killer), or between
the end of its plan and the record of the run's end (``cluster-pipeline dev``'s SIGKILL after
SIGTERM landed there once and left the run STARTED). Then the watchdog marks the run failed, if
nothing else has (for a run launched by the daemon the code server may already have), so it
does not stay STARTED forever and block the run queue. Its steps die with the worker
(``launch/fate.py``); every table, embedding chunk and checkpoint finished before stays, and
re-executing the run resumes from them.
"""

import os
import sys


def main(run_id: str, worker_pid: int, dataset: str) -> None:
    """Wait for the worker ``worker_pid``; mark ``run_id`` failed if it ends before the run's end
    is recorded."""
    ref = sys.stdin.readline()
    said = sys.stdin.read().split()  # until the worker's exit closes the pipe
    plan_ended = "done" in said
    if plan_ended and "exit" in said:
        return
    # Import Dagster only now: the watchdog sits idle for the whole run.
    import dagster as dg

    instance = dg.DagsterInstance.from_ref(dg.deserialize_value(ref.strip()))  # pyright: ignore[reportArgumentType]
    run = instance.get_run_by_id(run_id)
    if run is not None and not run.is_finished:
        when = (
            "after its steps ended but before it recorded the run's end"
            if plan_ended
            else "before the run ended"
        )
        instance.report_run_failed(
            run,
            f"the worker process of this run (pid {worker_pid}) died {when} (killed by a "
            "signal, or out of memory); its step processes, torchrun launchers and ranks "
            f"stopped with it and committed nothing after. It no longer holds dataset partition "
            f"{dataset!r}; re-execute the run to resume it (finished tables, embedding chunks and "
            "checkpoints are kept).",
        )
    # Exit at once: disposing of the instance took seconds on a busy machine, and the event is
    # committed.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
