"""Data-parallel gradient-proxy embedding pass (docs/design.md, step 1), the torchrun entry point.

Launch lines::

    # one process
    python -m cluster_pipeline.recipes.embed --config embed_job.json
    # W processes on one machine (gloo on CPU, nccl on GPUs)
    torchrun --standalone --nproc_per_node=W -m cluster_pipeline.recipes.embed \
        --config embed_job.json
    # several machines: same command on each, with
    torchrun --nnodes=2 --node_rank=R --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
        --nproc_per_node=W -m cluster_pipeline.recipes.embed --config embed_job.json

The job file is an :class:`~cluster_pipeline.training.config.EmbedJob`. The training split of the
``raw_instructions`` table version it names (or the samples its ``sample_ids_file`` lists) is cut
into fixed chunks of ``chunk_size`` samples (in table order); rank r embeds chunks i with
i % world_size == r, each written atomically as ``chunk_<i>.parquet`` in ``chunk_dir``. A chunk
file that exists is done, so a killed run restarted with the same job embeds only the missing
chunks.

Per-sample cache (incremental refresh): embeddings are kept in a Delta table per (model,
tokenizer, settings) folder, one row per ``sample_id`` (a content hash, so an edited sample is a
new id). :func:`pending_ids` lists the samples it lacks, a pass embeds only those, and
:func:`store_pass` appends them; :func:`read_cached` then gives the rows of any pool, in its
order, and :func:`assemble_table` adds the normalised columns. A nightly refresh after new data
therefore costs in proportion to the new samples, not to the pool.
"""

if __name__ == "__main__":
    # Before torch loads (seconds): a rank must not outlive a launcher killed meanwhile.
    from cluster_pipeline.launch.fate import die_with_parent

    die_with_parent()


from torch.distributed.elastic.multiprocessing.errors import record

from cluster_pipeline.training.config import EmbedJob
from cluster_pipeline.training.distributed import run_entry_point
from cluster_pipeline.training.embedding_pass import run_pass


@record
def main(argv: list[str] | None = None) -> None:
    """The embedding pass on this rank, from ``--config <EmbedJob JSON>``."""
    run_entry_point(EmbedJob, run_pass, argv, __doc__ or "")


if __name__ == "__main__":
    main()
