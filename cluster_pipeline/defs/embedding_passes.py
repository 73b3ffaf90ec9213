"""The embedding pass as a stage runs it (docs/design.md, step 1 and "Incremental refresh"): a
torchrun job (``recipes/embed.py``) over the samples a per-sample cache folder lacks, stored
into the cache, then the cached rows of every sample asked for, in order.

``proxy_embeddings`` runs it over the pool. ``peripheral_subsets`` runs it for a selector's
own inputs under the pool's model and settings: the target set of ``rds`` (``kind="targets"``),
the response-only inputs of ``ifd`` (``kind="unconditioned"``) and ``s2l``'s loss pass under
each proxy checkpoint (``kind="s2l_loss"``, the checkpoint as the model) and ``less``'s
gradient passes under each warm-up checkpoint (``kind`` naming the pool or the targets, the
preconditioner, the checkpoint, the projection's d and seed; ``EmbedJob.gradients``). Each
kind has its own cache folder (the kind is part of the key), so a selector's pass is paid once
per sample and model, as the pool's is, and the pool's cache keeps counting only pool passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import polars as pl

from cluster_pipeline.defs.resources import StorageResource, TorchrunResource
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.selection.selectors import PassCost
from cluster_pipeline.selection.selectors.base import mib_of
from cluster_pipeline.storage.embedding_cache import (
    cache_key,
    cached_pass_stats,
    pending_pass,
    pool_seconds,
    read_cached,
    store_pass,
)
from cluster_pipeline.storage.tables import TableRef
from cluster_pipeline.training.config import EmbedJob, EmbedSettings, GradientPass


def pass_cache_key(model_path: str, settings: EmbedSettings, kind: str = "") -> str:
    """The cache folder's key of a pass: the pool's (``kind=""``; unchanged by this module) or
    a selector pass's, which adds its kind."""
    fields = settings.cache_fields()
    return cache_key(model_path, {**fields, "pass": kind} if kind else fields)


@dataclass(frozen=True)
class CachedPass:
    """A finished pass: the cached rows (:data:`~cluster_pipeline.storage.embedding_cache.
    CHUNK_SCHEMA`) of the samples asked for, in their order; its cache folder; the samples
    embedded by this run; this run's pass statistics ({} when every sample was cached)."""

    rows: pl.DataFrame
    cache_dir: Path
    embedded_now: int
    stats: dict[str, float]

    def cost(self, name: str) -> PassCost:
        """The pass's cost record: one forward per sample (skipped samples are not run), its
        tokens, its seconds at the rate the cache measured, and the peak memory of the passes
        that filled the cache."""
        ran = self.rows.filter(pl.col("skip_reason").is_null())
        logged = cached_pass_stats(self.cache_dir)
        return PassCost(
            name,
            samples=ran.height,
            tokens=int(ran["n_tokens"].sum()),
            seconds=pool_seconds(self.cache_dir, self.rows.height),
            run_now=self.embedded_now,
            peak_rss_mib=mib_of(logged, "peak_rss_bytes"),
            peak_cuda_mib=mib_of(logged, "peak_cuda_bytes"),
        )


def run_cached_pass(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    *,
    table: TableRef,
    sample_ids: list[str],
    model_path: str,
    settings: EmbedSettings,
    cache_dir: Path,
    world_size: int,
    recompute: bool = False,
    response_only: bool = False,
    gradients: GradientPass | None = None,
    label: str = "",
) -> CachedPass:
    """Embed the samples ``sample_ids`` of the instruction table ``table`` (training split)
    that ``cache_dir`` lacks (all of them with ``recompute``) on ``world_size`` torchrun ranks,
    store them into the cache, and read back every one's row.

    Args:
        context: the step (logs; Pipes for rank 0).
        storage: the data folder and the run's commit guard.
        torchrun: how ranks are launched.
        pipes_subprocess_client: Dagster Pipes.
        table: a ``raw_instructions``-schema table version holding the samples.
        sample_ids: the samples, in the order the rows are returned.
        model_path: the local base model.
        settings: the pass's settings.
        cache_dir: the cache folder (:func:`pass_cache_key`).
        world_size: ranks over all torchrun agents.
        recompute: embed every sample again and replace the cache once the pass finished.
        response_only: ifd's unconditioned pass (``EmbedJob.response_only``).
        gradients: less's gradient pass (``EmbedJob.gradients``) instead of the embedding.
        label: prefixes the log lines (empty for the pool).

    Raises:
        CacheUnreadable: the cache's files are damaged.
        FileNotFoundError: chunks missing or holding other samples.
        dagster.Failure: a rank failed (:meth:`TorchrunResource.run`).
    """
    prefix = f"{label}: " if label else ""
    todo = pending_pass(cache_dir, sample_ids, settings.chunk_size, recompute)
    stats: dict[str, float] = {}
    if todo is not None:
        if not todo.finished:
            context.log.info(
                f"{prefix}embedding {len(todo.sample_ids)} of {len(sample_ids)} samples "
                f"({len(sample_ids) - len(todo.sample_ids)} cached under {cache_dir})"
            )
            job = EmbedJob(
                settings=settings,
                model_path=model_path,
                instructions_uri=table.uri,
                instructions_version=table.version,
                chunk_dir=str(todo.pass_dir),
                sample_ids_file=str(todo.ids_file),
                response_only=response_only,
                gradients=gradients,
            )
            job_file = job.dump(todo.pass_dir / "embed_job.json")
            nproc = world_size // torchrun.agents
            torchrun.run(context, pipes_subprocess_client, RECIPES["embed"], nproc, job_file)
        if storage.guard is not None:
            storage.guard.check(f"add the embedding pass to the cache {cache_dir}")
        try:
            stats = store_pass(
                cache_dir, todo.pass_dir, todo.sample_ids, settings.chunk_size, recompute
            )
        except ValueError as e:  # chunks that hold other samples
            raise FileNotFoundError(str(e)) from e
    else:
        context.log.info(f"{prefix}all {len(sample_ids)} samples cached under {cache_dir}")
    rows = read_cached(cache_dir, sample_ids)
    return CachedPass(rows, cache_dir, len(todo.sample_ids) if todo else 0, stats)
