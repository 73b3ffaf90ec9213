"""A torchrun entry point for the Slurm launcher's tests. Rank 0 says where it runs through
Dagster Pipes, then every rank does what the job file's ``behaviour`` says: ``sleep`` (120 s,
to be cancelled) or ``fail`` (rank 1 raises at once, the others wait to be stopped).

    python -m cluster_pipeline_tests.slurm.entry --config job.json
"""

import argparse
import json
import os
import socket
import time

from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.training.distributed import DistEnv, reporter

FAILURE = "rank 1 cannot go on (a deliberate test failure)"


@record
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    behaviour = json.loads(open(parser.parse_args().config).read())["behaviour"]
    env = DistEnv(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    with reporter(env) as report:
        report.info(f"rank 0 of {env.world_size} runs on {socket.gethostname()}")
        if behaviour == "fail" and env.rank == 1:
            raise RuntimeError(FAILURE)
        time.sleep(120)


if __name__ == "__main__":
    main()
