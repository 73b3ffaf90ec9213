"""Stage 1: the gradient-proxy embedding of every training sample, a torchrun step."""

import time

import dagster as dg

from cluster_pipeline.data.datasets import read_train_split
from cluster_pipeline.defs.configs import ProxyEmbeddingsConfig
from cluster_pipeline.defs.metadata import log_skipped, memory_display, table_display
from cluster_pipeline.defs.pass_runner import pass_cache_key, pool_embeddings
from cluster_pipeline.defs.records import ProxyEmbeddingsRecord, RawInstructionsRecord, read_record
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.models.loading import model_identity
from cluster_pipeline.selection.passes import PASS_EMBEDDING, round_mib
from cluster_pipeline.storage.embedding_cache import pool_seconds
from cluster_pipeline.storage.names import PROXY_EMBEDDINGS, RAW_INSTRUCTIONS
from cluster_pipeline.storage.provenance import code_identity
from cluster_pipeline.storage.tables import content_digest, mean_of, write_table
from cluster_pipeline.training.config import EmbedSettings, settings_of
from cluster_pipeline.training.memory import embedding_estimate


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
    (nats/token), ``n_response_tokens`` T, ``n_tokens``, ``truncated``, and ``skip_reason`` for
    samples with no response token (their embeddings are null and they are never clustered).
    docs/design.md, step 1.
    """
    dataset, layout = context.partition_key, storage.layout
    start = time.perf_counter()
    instructions = read_record(context, RawInstructionsRecord)
    split = read_train_split(instructions.table.uri, instructions.table.version)
    sample_ids = split["sample_id"].to_list()
    settings = settings_of(config, EmbedSettings)
    model_path = base_model.local_path(storage, context.log.info)
    # Before the model loads: rules the run's worker could not check without the model or N.
    recheck_settings(context, layout, model_path, torchrun.agents, instructions)
    key = pass_cache_key(model_path, settings)  # the cache's: pool_embeddings' folder
    done, result, cache_dir = pool_embeddings(
        context,
        storage,
        torchrun,
        pipes_subprocess_client,
        instructions.table,
        sample_ids,
        model_path,
        settings,
        config.world_size,
        config.recompute,
    )
    table = write_table(
        result.frame,
        layout.table_uri(PROXY_EMBEDDINGS, dataset),
        guard=storage.guard,
        inputs=instructions.lineage(),
    )
    context.log.info(
        f"{result.embedded} embedded, {result.frame.height - result.embedded} skipped in "
        f"{time.perf_counter() - start:.1f} s; truncated: {result.truncated or 'none'}"
    )
    log_skipped(context.log.info, result.frame, instructions, settings.truncation)
    stats, peaks = done.stats, done.cost(PASS_EMBEDDING)
    pass_seconds, pass_tokens = float(stats.get("seconds", 0.0)), float(stats.get("tokens", 0))
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
        base_model_identity=model_identity(base_model.model, model_path),
        base_model_setting=base_model.model,
        config=config.model_dump(mode="json"),
        code=code_identity(),
        peak_rss_mib=round_mib(peaks.peak_rss_mib),
        peak_cuda_mib=round_mib(peaks.peak_cuda_mib),
        **done.packing(),
    )
    shown = ["sample_id", "n_tokens", "n_response_tokens", "mean_loss", "skip_reason"]
    # The vectors are those of the cache key (model, tokenizer, settings) for these samples:
    # the key and the per-sample columns stand for them (hashing N x d floats would cost more).
    version = content_digest(result.frame, [*shown, "truncated"], key)
    peak = stats.get("peak_rss_bytes") if done.embedded_now else None
    memory = memory_display(
        embedding_estimate(model_path, settings, int(pass_tokens) or None),
        [int(peak)] if peak else None,
        context.log.info,
    )
    return dg.MaterializeResult(
        metadata={
            **record.to_metadata(),
            **memory,
            **table_display(result.frame, PROXY_EMBEDDINGS, shown),
        },
        data_version=dg.DataVersion(version),
    )
