"""The watchdog of one run: marks the run failed if its worker process dies before the run ends.

    python -m cluster_pipeline.defs.run_watchdog <run id> <worker pid> <dataset>

Started by the project's executor (``defs/executor.py``) in its own session (a Ctrl-C or a kill
of the run's process group spares it), it reads the Dagster instance's reference (serialized)
from stdin, then waits on stdin. The worker writes ``done`` when the run ends; end of file
without it means the worker died (``kill -9``, the out-of-memory killer), and the watchdog
marks the run failed, if nothing else has (for a run launched by the daemon the code server
may already have), so it does not stay STARTED forever and block the run queue. Its steps die
with the worker (``launch/fate.py``); every table, embedding chunk and checkpoint finished
before stays, and re-executing the run resumes from them.
"""

import os
import sys


def main(run_id: str, worker_pid: int, dataset: str) -> None:
    """Wait for the worker ``worker_pid``; mark ``run_id`` failed if it dies before "done"."""
    ref = sys.stdin.readline()
    if sys.stdin.read().strip().startswith("done"):
        return
    # Import Dagster only now: the watchdog sits idle for the whole run.
    import dagster as dg

    instance = dg.DagsterInstance.from_ref(dg.deserialize_value(ref.strip()))  # pyright: ignore[reportArgumentType]
    run = instance.get_run_by_id(run_id)
    if run is not None and not run.is_finished:
        instance.report_run_failed(
            run,
            f"the worker process of this run (pid {worker_pid}) died before the run ended "
            "(killed by a signal, or out of memory); its step processes, torchrun launchers "
            f"and ranks stopped with it and committed nothing after. Dataset partition "
            f"{dataset!r} is free again; re-execute the run to resume it (finished tables, "
            "embedding chunks and checkpoints are kept).",
        )
    # Exit at once: disposing of the instance took seconds on a busy machine, and the event is
    # committed.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
