"""``torchrun`` that dies with its parent.

    python -m cluster_pipeline.training.launch [torchrun arguments...]

Same arguments as ``torchrun``. Linux is first asked to send this process SIGTERM when its
parent (the Dagster step) dies, which torchrun answers by stopping every rank; the ranks in turn
are SIGKILLed if torchrun itself is killed (:func:`~cluster_pipeline.training.distributed.
die_with_parent`). So no rank outlives the run that started it.
"""

import os
import signal
import sys

from cluster_pipeline.training.fate import LAUNCHER_PID_ENV, die_with_parent

_PARENT = os.getppid()


def main() -> None:
    die_with_parent(signal.SIGTERM, expected_parent=_PARENT)
    # torchrun's agent runs in this process, so it is the ranks' parent.
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:])


if __name__ == "__main__":
    main()
