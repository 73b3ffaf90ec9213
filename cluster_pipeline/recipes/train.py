"""Data-parallel fine-tuning, one rank per cluster, re-weighted (docs/design.md, steps 4-5).

Launch lines::

    # one process (world size 1: one shard manifest)
    python -m cluster_pipeline.recipes.train --config train_job.json
    # K ranks on one machine, rank c trains on shard manifest c (gloo on CPU, nccl on GPUs)
    torchrun --standalone --nproc_per_node=K -m cluster_pipeline.recipes.train \
        --config train_job.json
    # several machines: same command on each node, with
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
        --nproc_per_node=K/2 -m cluster_pipeline.recipes.train --config train_job.json

The job file is a :class:`~cluster_pipeline.training.config.TrainJob`. Rank c reads
``manifests[c]`` and multiplies its loss by the manifest's weight w_c = n_c K / N (K R_c / R
under token balance, R_c the cluster's response tokens). DDP averages gradients over the K
ranks, so each update follows (1/K) sum_c w_c g_c = sum_c (n_c / N) g_c (by tokens: sum_c
(R_c / R) g_c): the stratified estimate of the full-data gradient. Every rank must take the
same number of optimizer steps (DDP hangs otherwise); that is checked before the first step.

Rank 0 alone logs (through Dagster Pipes when launched by the ``trained_checkpoint`` asset),
writes the per-step metrics and saves the checkpoint: ``save_pretrained`` output (safetensors)
and the tokenizer, written to a temporary folder and renamed, plus ``training_info.json`` naming
the manifests' content hashes, the base model and the job (layout: training/checkpointing.py).

The run is split as torchtune's recipes are: :func:`setup` (model, data, optimizer, scheduler,
resume), :func:`train_step` (one optimizer step), :func:`save_intermediate` (resumable state) and
:func:`finalize` (the checkpoint and its ``training_info.json``).
"""

if __name__ == "__main__":
    # Before torch loads (seconds): a rank must not outlive a launcher killed meanwhile.
    from cluster_pipeline.launch.fate import die_with_parent

    die_with_parent()


from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.training.config import TrainJob
from cluster_pipeline.training.distributed import (
    run_entry_point,
)
from cluster_pipeline.training.loop import train


@record
def main(argv: list[str] | None = None) -> None:
    """Data-parallel fine-tuning on this rank, from ``--config <TrainJob JSON>``."""
    run_entry_point(TrainJob, train, argv, __doc__ or "")


if __name__ == "__main__":
    main()
