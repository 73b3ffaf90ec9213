"""Stage 1: the gradient-proxy embedding of every training sample, a torchrun step."""


import hashlib
import json
import shutil
import time
from pathlib import Path

import dagster as dg
import numpy as np
import polars as pl
from pydantic import Field

from cluster_pipeline.core.embedding import l2_normalise
from cluster_pipeline.core.tables import series_to_matrix, vectors_to_series, write_table
from cluster_pipeline.defs.launch import run_torchrun
from cluster_pipeline.defs.metadata import table_metadata, upstream_table
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.training.embed import (
    EmbedConfig,
    chunk_path,
    gather_chunks,
    read_train_split,
)

EMBED_MODULE = "cluster_pipeline.training.embed"


class ProxyEmbeddingsConfig(dg.Config):
    max_length: int = Field(default=512, ge=2, description="Max tokens per sample (prompt + "
                            "response); the end of the response is cut first.")
    max_batch_size: int = Field(default=16, ge=1, description="Max samples per forward pass.")
    max_batch_tokens: int = Field(default=8192, ge=1, description="Max padded tokens per batch.")
    chunk_size: int = Field(default=512, ge=1, description="Samples per resumable chunk.")
    world_size: int = Field(default=1, ge=1, description="torchrun processes (data-parallel "
                            "inference); 1 on CPU, the number of GPUs otherwise.")
    bf16: bool = Field(default=False, description="bfloat16 autocast for the forward pass.")
    recompute: bool = Field(default=False, description="Ignore embeddings cached for the same "
                            "model, settings and samples.")


def _model_fingerprint(model_path: str) -> str:
    """Hash of the model's config/tokenizer files and weight file sizes (hub id: the id)."""
    h = hashlib.sha256(model_path.encode())
    folder = Path(model_path)
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.suffix in (".json", ".jinja", ".txt", ".model"):
                h.update(p.name.encode() + p.read_bytes())
            elif p.suffix in (".safetensors", ".bin"):
                h.update(f"{p.name}|{p.stat().st_size}|{p.stat().st_mtime_ns}".encode())
    return h.hexdigest()


def cache_key(model_path: str, cfg: ProxyEmbeddingsConfig, sample_ids: list[str]) -> str:
    """Embeddings are reused when model, tokenizer, settings and samples are all the same."""
    h = hashlib.sha256(_model_fingerprint(model_path).encode())
    h.update(json.dumps([cfg.max_length, cfg.chunk_size, cfg.bf16]).encode())
    for sid in sample_ids:
        h.update(sid.encode())
    return h.hexdigest()[:20]


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["raw_instructions"],
    group_name="selection",
    kinds={"pytorch", "deltalake"},
    code_version="1",
    # Kept in sync with its parent; training and evaluation run only on request.
    automation_condition=dg.AutomationCondition.eager(),
)
def proxy_embeddings(
    context: dg.AssetExecutionContext,
    config: ProxyEmbeddingsConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
) -> dg.MaterializeResult:
    """One row per training sample: ``embedding`` e = (1/T) sum_t (p_t - 1) h_t (float32,
    hidden size d), ``embedding_normalised`` (L2), ``mean_loss`` (nats/token),
    ``n_response_tokens`` T, ``n_tokens``, ``truncated``, and ``skip_reason`` for samples with no
    response token (their embeddings are null and they are never clustered). DESIGN.md step 1.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    instructions = upstream_table(context, "raw_instructions")
    train = read_train_split(instructions.uri, instructions.version)
    model_path = base_model.local_path(storage)
    key = cache_key(model_path, config, train["sample_id"].to_list())
    chunk_dir = storage.work_dir("cache", "embeddings", dataset, key)
    if config.recompute:
        shutil.rmtree(chunk_dir)
        chunk_dir.mkdir(parents=True)
    n_chunks = -(-train.height // config.chunk_size)
    cached = sum(chunk_path(chunk_dir, i).exists() for i in range(n_chunks))
    if cached < n_chunks:
        embed_cfg = EmbedConfig(
            model_path=model_path,
            instructions_uri=instructions.uri,
            instructions_version=instructions.version,
            chunk_dir=str(chunk_dir),
            max_length=config.max_length,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            chunk_size=config.chunk_size,
            bf16=config.bf16,
        )
        cfg_path = chunk_dir / "embed_config.json"
        embed_cfg.dump(cfg_path)
        run_torchrun(context, pipes_subprocess_client, torchrun, EMBED_MODULE,
                     config.world_size, cfg_path)
    else:
        context.log.info(f"all {n_chunks} chunks cached under {chunk_dir}; nothing to embed")
    # Timings of the pass that computed these embeddings (an earlier run's when cached).
    stats_file = chunk_dir / "pass_stats.json"
    pass_stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}

    try:
        chunks = gather_chunks(chunk_dir, train["sample_id"].to_list(), config.chunk_size)
    except (FileNotFoundError, ValueError) as e:
        raise dg.Failure(f"{e}; re-run with recompute: true") from e
    ok = chunks["skip_reason"].is_null().to_numpy()
    if not ok.any():
        raise dg.Failure(f"no sample of {dataset!r} has a response token within max_length="
                         f"{config.max_length}; raise max_length or check the responses")
    matrix = series_to_matrix(chunks.filter(pl.Series(ok))["embedding"])
    normalised = np.zeros((chunks.height, matrix.shape[1]), dtype=np.float32)
    normalised[ok] = l2_normalise(matrix)
    frame = chunks.with_columns(vectors_to_series("embedding_normalised", normalised)).with_columns(
        pl.when(pl.col("skip_reason").is_null()).then(pl.col("embedding_normalised"))
    )
    ref = write_table(frame, storage.table_uri("proxy_embeddings", dataset))
    seconds = time.perf_counter() - start
    skipped = frame.filter(pl.Series(~ok)).group_by("skip_reason").len()
    embedded = int(ok.sum())
    context.log.info(f"{embedded} embedded, {frame.height - embedded} skipped in {seconds:.1f} s")
    return dg.MaterializeResult(
        metadata={
            **table_metadata(ref, frame, seconds, preview_columns=[
                "sample_id", "n_tokens", "n_response_tokens", "mean_loss", "skip_reason"]),
            "embedded": embedded,
            "skipped": dg.MetadataValue.json(dict(zip(skipped["skip_reason"], skipped["len"]))),
            "hidden_size": int(matrix.shape[1]),
            "cache_key": key,
            "chunks_reused": cached,
            "embedding_seconds": round(float(pass_stats.get("seconds", 0.0)), 2),
            "tokens_per_second": round(
                pass_stats.get("tokens", 0) / max(pass_stats.get("seconds", 0.0), 1e-9), 1),
            "world_size": config.world_size,
            "mean_loss": round(float(frame["mean_loss"].mean() or float("nan")), 4),
            "base_model": model_path,
        },
    )

