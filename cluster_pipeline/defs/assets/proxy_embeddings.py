"""Stage 1: the gradient-proxy embedding of every training sample, a torchrun step."""

import time

import dagster as dg
import polars as pl
from pydantic import Field

from cluster_pipeline.data.datasets import read_instructions, read_train_split
from cluster_pipeline.defs.embedding_passes import pass_cache_key, run_cached_pass
from cluster_pipeline.defs.metadata import table_display
from cluster_pipeline.defs.records import ProxyEmbeddingsRecord, RawInstructionsRecord, read_record
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.selection.embedding_table import assemble_table
from cluster_pipeline.selection.selectors.base import PASS_EMBEDDING, round_mib
from cluster_pipeline.storage.embedding_cache import CacheUnreadable, pool_seconds
from cluster_pipeline.storage.names import PROXY_EMBEDDINGS, RAW_INSTRUCTIONS
from cluster_pipeline.storage.tables import mean_of, write_table
from cluster_pipeline.training.config import EmbedSettings, settings_of


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


@stage_asset("selection", deps=[RAW_INSTRUCTIONS], kinds={"pytorch", "deltalake"})
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
    split = read_train_split(instructions.table.uri, instructions.table.version)
    sample_ids = split["sample_id"].to_list()
    settings = settings_of(config, EmbedSettings)
    model_path = base_model.local_path(storage)
    # Before the model loads: rules the run's worker could not check without the model or N.
    recheck_settings(context, layout, model_path, torchrun.agents, instructions)
    key = pass_cache_key(model_path, settings)
    cache_dir = layout.embedding_cache_dir(dataset, key)
    try:
        done = run_cached_pass(
            context,
            storage,
            torchrun,
            pipes_subprocess_client,
            table=instructions.table,
            sample_ids=sample_ids,
            model_path=model_path,
            settings=settings,
            cache_dir=cache_dir,
            world_size=config.world_size,
            recompute=config.recompute,
        )
        result = assemble_table(done.rows)
    except CacheUnreadable as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    except FileNotFoundError as e:
        raise dg.Failure(f"{dataset}: {e}; re-run with recompute: true") from e
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e} (max_length={settings.max_length})") from e
    table = write_table(
        result.frame,
        layout.table_uri(PROXY_EMBEDDINGS, dataset),
        guard=storage.guard,
        inputs=instructions.lineage(),
    )
    _log_outcome(context, result, instructions, settings, time.perf_counter() - start)
    stats = done.stats
    pass_seconds, pass_tokens = float(stats.get("seconds", 0.0)), float(stats.get("tokens", 0))
    peaks = done.cost(PASS_EMBEDDING)
    record = ProxyEmbeddingsRecord(
        table=table,
        inputs=instructions.lineage(),
        seconds=round(time.perf_counter() - start, 3),
        selection_seconds=round(pool_seconds(cache_dir, len(sample_ids)), 2),
        embedded=result.embedded,
        skipped=result.skipped,
        truncated=result.truncated,
        hidden_size=result.hidden_size,
        cache_key=key,
        samples_embedded_now=done.embedded_now,
        samples_reused=len(sample_ids) - done.embedded_now,
        embedding_seconds=round(pass_seconds, 2),
        tokens_per_second=round(pass_tokens / max(pass_seconds, 1e-9), 1),
        world_size=config.world_size,
        mean_loss=round(mean_of(result.frame["mean_loss"]), 4),
        base_model=model_path,
        embed_settings=settings.model_dump(),
        peak_rss_mib=round_mib(peaks.peak_rss_mib),
        peak_cuda_mib=round_mib(peaks.peak_cuda_mib),
    )
    shown = ["sample_id", "n_tokens", "n_response_tokens", "mean_loss", "skip_reason"]
    return dg.MaterializeResult(
        metadata={**record.to_metadata(), **table_display(result.frame, PROXY_EMBEDDINGS, shown)}
    )


def _log_outcome(context, result, instructions, settings: EmbedSettings, seconds: float) -> None:
    """The pass's outcome in the run log, and where the first skipped samples come from."""
    context.log.info(
        f"{result.embedded} embedded, {result.frame.height - result.embedded} "
        f"skipped in {seconds:.1f} s; truncated: {result.truncated or 'none'}"
    )
    skipped = result.frame.filter(pl.col("skip_reason").is_not_null())
    if not skipped.height:
        return
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
