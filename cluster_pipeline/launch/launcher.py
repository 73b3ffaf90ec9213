"""``torchrun`` that dies with its parent.

    python -m cluster_pipeline.launch.launcher [torchrun arguments...]

Same arguments as ``torchrun``. Linux is first asked to SIGKILL this process when its parent
(the Dagster step) dies, and the ranks in turn are SIGKILLed when torchrun dies
(:func:`~cluster_pipeline.launch.fate.die_with_parent`), so no rank outlives the run that
started it. SIGKILL, not SIGTERM: torchrun answers SIGTERM by stopping its ranks and then
shutting down its rendezvous, and a launcher stopped that way was seen alive 70 s later with
its ranks long gone (issue 23); the ranks die of their own parent-death signal either way.
"""

import json
import os
import signal
import sys
from pathlib import Path

from cluster_pipeline.launch.fate import LAUNCHER_PID_ENV, die_with_parent
from cluster_pipeline.launch.torchrun import RANK_EXITS

_PARENT = os.getppid()


def main() -> None:
    """Torchrun's own ``main`` in a process that dies with its parent (the Dagster step), and
    each rank's exit recorded for the failure report."""
    die_with_parent(signal.SIGKILL, expected_parent=_PARENT)
    # torchrun's agent runs in this process, so it is the ranks' parent.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(sys.argv[1:])
    except ChildFailedError as e:
        _write_exits(e, sys.argv[1:])
        raise


def _write_exits(error, argv: list[str]) -> None:
    """Record each failed rank's global rank, exit code and signal under ``--log-dir``
    (``rank_exits.json``, keyed by local rank), so a rank killed by a signal, which writes no
    error file, can still be named, and a rank of a multi-agent launch by its global rank."""
    log_dir = next(
        (a.split("=", 1)[1] for a in argv if a.startswith(("--log-dir=", "--log_dir="))), None
    )
    if log_dir is None:
        return
    exits = {
        str(f.local_rank): {
            "rank": rank,
            "exitcode": f.exitcode,
            "signal": f.signal_name() if f.exitcode < 0 else None,
            "timestamp": f.timestamp,
        }
        for rank, f in error.failures.items()
    }
    (Path(log_dir) / RANK_EXITS).write_text(json.dumps(exits))


if __name__ == "__main__":
    main()
