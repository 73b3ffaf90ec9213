"""Stage 1: the gradient-proxy embedding of every training sample, a torchrun step."""

import time

import dagster as dg
import polars as pl
from pydantic import Field

from cluster_pipeline.core.cache import model_fingerprint, stable_hash
from cluster_pipeline.core.datasets import read_instructions
from cluster_pipeline.core.tables import mean_of, write_table
from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import ProxyEmbeddingsRecord, RawInstructionsRecord, read_record
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import preflight
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.training.config import EmbedJob, EmbedSettings, settings_of
from cluster_pipeline.training.embed import (
    CHUNK_FORMAT,
    CacheUnreadable,
    assemble_table,
    cached_pass_stats,
    chunks_done,
    n_chunks,
    pending_ids,
    read_cached,
    read_train_split,
    store_pass,
    write_pass_ids,
)

EMBED_MODULE = "cluster_pipeline.training.embed"


class ProxyEmbeddingsConfig(dg.Config, EmbedSettings):
    """The embedding knobs (:class:`~cluster_pipeline.training.config.EmbedSettings`) plus how
    this asset runs the pass."""

    world_size: int = Field(
        default=1,
        ge=1,
        description="torchrun processes (data-parallel "
        "inference) over all nodes; 1 on CPU, the number of GPUs otherwise.",
    )
    recompute: bool = Field(
        default=False,
        description="Embed every sample again and replace the cache of this model and these "
        "settings with the result (the old cache is kept until the new pass has finished).",
    )


@stage_asset("selection", deps=["raw_instructions"], kinds={"pytorch", "deltalake"})
def proxy_embeddings(
    context: dg.AssetExecutionContext,
    config: ProxyEmbeddingsConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """One row per training sample: ``embedding`` e = (1/T) sum_t (p_t - 1) h_t (float32,
    hidden size d), ``embedding_normalised`` (L2), ``hidden_mean`` (1/T) sum_t h_t and
    ``hidden_mean_normalised`` (a second representation from the same pass), ``mean_loss``
    (nats/token),
    ``n_response_tokens`` T, ``n_tokens``, ``truncated``, and ``skip_reason`` for samples with no
    response token (their embeddings are null and they are never clustered).
    docs/design.md, step 1.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    instructions = read_record(context, RawInstructionsRecord)
    sample_ids = read_train_split(instructions.table.uri, instructions.table.version)[
        "sample_id"
    ].to_list()
    settings = settings_of(config, EmbedSettings)
    model_path = base_model.local_path(storage)
    # Before the model loads: rules the run's worker could not check without the model or N.
    preflight(context, layout, model_path, torchrun.agents, instructions)
    # Per-sample cache: keyed by what changes the numbers, not by the pool, so a refresh after
    # new data embeds only the new samples (training/embed.py, "Per-sample cache").
    key = stable_hash(model_fingerprint(model_path), settings.cache_fields(), CHUNK_FORMAT)
    cache_dir = layout.embedding_cache_dir(dataset, key)
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        # recompute: every sample, and the cache replaced only once the pass has finished.
        pending = list(sample_ids) if config.recompute else pending_ids(cache_dir, sample_ids)
    except CacheUnreadable as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    pass_seconds, pass_tokens = 0.0, 0.0
    if pending:
        # The pass folder is named by its samples, so a killed pass resumes its chunks.
        pass_dir = cache_dir / f"pass_{stable_hash(pending)}"
        ids_file = write_pass_ids(pass_dir, pending)
        if chunks_done(pass_dir, len(pending), settings.chunk_size) < n_chunks(
            len(pending), settings.chunk_size
        ):
            context.log.info(
                f"embedding {len(pending)} of {len(sample_ids)} samples "
                f"({len(sample_ids) - len(pending)} cached under {cache_dir})"
            )
            job = EmbedJob(
                settings=settings,
                model_path=model_path,
                instructions_uri=instructions.table.uri,
                instructions_version=instructions.table.version,
                chunk_dir=str(pass_dir),
                sample_ids_file=str(ids_file),
            )
            torchrun.run(
                context,
                pipes_subprocess_client,
                EMBED_MODULE,
                config.world_size // torchrun.agents,
                job.dump(pass_dir / "embed_job.json"),
            )
        if storage.guard is not None:
            storage.guard.check(f"add the embedding pass to the cache {cache_dir}")
        try:
            stats = store_pass(cache_dir, pass_dir, pending, settings.chunk_size, config.recompute)
        except CacheUnreadable as e:
            raise dg.Failure(f"{dataset}: {e}") from e
        except (FileNotFoundError, ValueError) as e:
            raise dg.Failure(f"{dataset}: {e}; re-run with recompute: true") from e
        pass_seconds, pass_tokens = float(stats.get("seconds", 0.0)), float(stats.get("tokens", 0))
    else:
        context.log.info(f"all {len(sample_ids)} samples cached under {cache_dir}")
    try:
        result = assemble_table(read_cached(cache_dir, sample_ids))
    except CacheUnreadable as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    except FileNotFoundError as e:
        raise dg.Failure(f"{dataset}: {e}; re-run with recompute: true") from e
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e} (max_length={settings.max_length})") from e
    table = write_table(
        result.frame, layout.table_uri("proxy_embeddings", dataset), guard=storage.guard
    )
    seconds = time.perf_counter() - start
    # Selection cost of this pool: one pass over it at the rate the cache's passes measured.
    totals = cached_pass_stats(cache_dir)
    rate = totals.get("seconds", 0.0) / max(totals.get("samples", 0.0), 1.0)
    context.log.info(
        f"{result.embedded} embedded, {result.frame.height - result.embedded} "
        f"skipped in {seconds:.1f} s; truncated: {result.truncated or 'none'}"
    )
    skipped = result.frame.filter(pl.col("skip_reason").is_not_null())
    if skipped.height:
        sources = read_instructions(
            instructions.table.uri,
            instructions.table.version,
            ["sample_id", "source_file", "source_line"],
        )
        for row in skipped.head(5).join(sources, on="sample_id").iter_rows(named=True):
            context.log.info(
                f"skipped {row['sample_id']} ({row['skip_reason']}, truncation="
                f"{settings.truncation}): {row['source_file']}:{row['source_line']}"
            )
    record = ProxyEmbeddingsRecord(
        table=table,
        inputs=instructions.lineage(),
        seconds=round(seconds, 3),
        selection_seconds=round(rate * len(sample_ids), 2),
        embedded=result.embedded,
        skipped=result.skipped,
        truncated=result.truncated,
        hidden_size=result.hidden_size,
        cache_key=key,
        samples_embedded_now=len(pending),
        samples_reused=len(sample_ids) - len(pending),
        embedding_seconds=round(pass_seconds, 2),
        tokens_per_second=round(pass_tokens / max(pass_seconds, 1e-9), 1),
        world_size=config.world_size,
        mean_loss=round(mean_of(result.frame["mean_loss"]), 4),
        base_model=model_path,
    )
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            **table_display(
                result.frame,
                ["sample_id", "n_tokens", "n_response_tokens", "mean_loss", "skip_reason"],
            ),
        }
    )
