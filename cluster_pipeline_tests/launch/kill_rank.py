"""A torchrun entry point whose rank 1 is SIGKILLed (as the OOM killer does) while rank 0 works;
used by test_faults."""

import os
import signal
import time

if __name__ == "__main__":
    if int(os.environ["LOCAL_RANK"]) == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
