"""What ``peripheral_subsets`` hands the chosen selector (selection/selectors/base.py,
``SelectionInputs``): the clustering's columns, and only what the selector's registry entry
says it needs beyond them: the pool's representations from the ``proxy_embeddings`` table the
clustering read, and the outputs of the selector's own passes, run as the embedding pass runs
(``embedding_passes``: torchrun, data-parallel over the pool pass's world size, cached per
sample) under the pool pass's model and settings: the target set of ``rds``, the
unconditioned pass of ``ifd`` (the pool's responses without their prompts), and for ``s2l`` a
proxy run (the pool pass's base model trained briefly on the whole pool, under torchrun with the
pool pass's world size, ``recipes/train.py``; reused when finished, resumed when killed;
training/proxy.py) followed by one loss pass under each of its T checkpoints (the embedding
pass with the checkpoint as its model; its ``mean_loss`` is the loss). Everything that can be
refused (a missing target set, a benchmark file not found, a pool pass recorded before its
settings were, a proxy that would not fit in memory) is refused before a pass starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import dagster as dg
import numpy as np
import polars as pl

from cluster_pipeline.data.datasets import samples_fingerprint
from cluster_pipeline.defs.embedding_passes import CachedPass, pass_cache_key, run_cached_pass
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    ProxyEmbeddingsRecord,
    pinned_record,
)
from cluster_pipeline.defs.resources import StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.evaluation.targets import target_samples
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline.selection.selectors import REGISTRY, PassCost, SelectionInputs
from cluster_pipeline.selection.selectors.base import (
    PASS_EMBEDDING,
    PASS_LESS_GRADIENTS,
    PASS_LESS_TARGETS,
    PASS_LESS_WARMUP,
    PASS_S2L_LOSS,
    PASS_S2L_PROXY,
    PASS_TARGETS,
    PASS_UNCONDITIONED,
)
from cluster_pipeline.selection.sharding import Allocation, manifest_set_hash
from cluster_pipeline.storage.embedding_cache import CacheUnreadable
from cluster_pipeline.storage.layout import SHARED_EVAL_DIR
from cluster_pipeline.storage.names import (
    LESS_GRADIENTS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    S2L_TRAJECTORIES,
    SELECTION_TARGETS,
)
from cluster_pipeline.storage.tables import TableRef, series_to_matrix, write_table
from cluster_pipeline.training.checkpointing import finished_for
from cluster_pipeline.training.config import EmbedSettings, GradientPass, TrainJob, TrainSettings
from cluster_pipeline.training.memory import TrainingMemoryError
from cluster_pipeline.training.preflight import check_training_fits, checkpoint_folder
from cluster_pipeline.training.proxy import (
    LessWarmup,
    ProxyCheckpoint,
    ProxyRun,
    mean_learning_rates,
    proxy_checkpoints,
    proxy_cost,
    proxy_settings,
    proxy_shards,
    warmup_checkpoints,
    warmup_settings,
    warmup_share,
)


@dataclass(frozen=True)
class GatheredInputs:
    """The selector's inputs, plus what the record says about them: the target set's name and
    its embedded samples (rds), the proxy's checkpoints and their steps (s2l), the tables of the
    selector's own passes (added to the record's ``inputs``), and the wall seconds those passes
    took in this run."""

    inputs: SelectionInputs
    target: str | None = None
    target_samples: int = 0
    tables: dict[str, TableRef] = field(default_factory=dict)
    pass_wall_seconds: float = 0.0
    proxy_checkpoints: tuple[str, ...] = ()
    proxy_steps: tuple[int, ...] = ()
    less_learning_rates: tuple[float, ...] = ()


def _column(rows: pl.DataFrame, frame: pl.DataFrame, column: str) -> np.ndarray:
    """(N,) float32 ``column`` of ``rows`` (keyed by sample_id) for ``frame``'s samples, in
    its order (nan where null)."""
    joined = frame.select("sample_id").join(rows, on="sample_id", how="left", maintain_order="left")
    return joined[column].cast(pl.Float32).fill_null(float("nan")).to_numpy()


def _pool_settings(pool: ProxyEmbeddingsRecord, dataset: str) -> EmbedSettings:
    if not pool.embed_settings:
        raise dg.Failure(
            description=f"{dataset}: the proxy_embeddings materialization the clustering read "
            "recorded no embedding settings (an older version of the pipeline), which the "
            "selector's own pass must reuse; materialize proxy_embeddings again."
        )
    return EmbedSettings.model_validate(pool.embed_settings)


def gather_inputs(
    context: dg.AssetExecutionContext,
    selector: str,
    target: str | None,
    target_size: int,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    clusters: BalancedClustersRecord,
    frame: pl.DataFrame,
    proxy: ProxyRun | None = None,
    warmup: LessWarmup | None = None,
) -> GatheredInputs:
    """The inputs of ``selector`` for the clustered pool ``frame`` (columns sample_id, cluster,
    sq_distance, n_tokens, n_response_tokens; table order), running its own passes; ``proxy``:
    s2l's proxy run (needed when the selector trains one); ``warmup``: less's warm-up (needed
    for less).

    Raises:
        dagster.Failure: the target set cannot be read, its pass failed, the proxy would not fit
            or its run failed, or the pool pass lacks what the selector needs (each message
            names the dataset).
    """
    spec = REGISTRY[selector]
    embeddings = clusters.inputs[PROXY_EMBEDDINGS]
    pool = pinned_record(context, ProxyEmbeddingsRecord, embeddings)
    passes = [
        PassCost(
            PASS_EMBEDDING,
            samples=frame.height,
            tokens=int(frame["n_tokens"].sum()),
            seconds=pool.selection_seconds,
            run_now=pool.samples_embedded_now,
            peak_rss_mib=pool.peak_rss_mib,
            peak_cuda_mib=pool.peak_cuda_mib,
        )
    ]
    hidden = mean_loss = unconditioned = None
    if "hidden_mean" in spec.needs:
        hidden = embeddings.vectors_for("hidden_mean_normalised", frame["sample_id"])
    if "mean_loss" in spec.needs:
        mean_loss = _column(embeddings.read(["sample_id", "mean_loss"]), frame, "mean_loss")
    targets = None
    start = time.perf_counter()
    if PASS_TARGETS in spec.passes:
        targets = _targets(
            context, target, target_size, storage, torchrun, pipes_subprocess_client, pool
        )
        passes.append(targets.cost)
    if PASS_UNCONDITIONED in spec.passes:
        alone = _unconditioned(context, storage, torchrun, pipes_subprocess_client, pool, frame)
        unconditioned = _column(alone.rows, frame, "mean_loss")
        passes.append(alone.cost(PASS_UNCONDITIONED))
    s2l: _Trajectories | None = None
    if PASS_S2L_PROXY in spec.passes:
        if proxy is None:
            raise dg.Failure(description=f"{context.partition_key}: s2l needs its proxy's knobs")
        s2l = _s2l_trajectories(
            context, storage, torchrun, pipes_subprocess_client, pool, frame, proxy
        )
        passes.extend(s2l.costs)
    less: _LessGradients | None = None
    if PASS_LESS_WARMUP in spec.passes:
        if warmup is None:
            raise dg.Failure(description=f"{context.partition_key}: less needs its warm-up knobs")
        less = _less_gradients(
            context,
            target,
            target_size,
            storage,
            torchrun,
            pipes_subprocess_client,
            pool,
            frame,
            warmup,
        )
        passes.extend(less.costs)
    wall = time.perf_counter() - start
    inputs = SelectionInputs(
        labels=frame["cluster"].to_numpy(),
        k=clusters.num_clusters,
        sq_distance=frame["sq_distance"].to_numpy(),
        lengths=frame["n_tokens"].to_numpy(),
        response_tokens=frame["n_response_tokens"].to_numpy(),
        hidden_mean=hidden,
        mean_loss=mean_loss,
        unconditioned_loss=unconditioned,
        targets=targets.vectors if targets else None,
        loss_trajectories=s2l.trajectories if s2l else None,
        less_gradients=less.pool if less else None,
        less_target_gradients=less.targets if less else None,
        less_learning_rates=np.asarray(less.learning_rates) if less else None,
        passes=tuple(passes),
    )
    if less is not None:
        return GatheredInputs(
            inputs,
            target=target,
            target_samples=len(less.targets),
            tables={SELECTION_TARGETS: less.target_table, LESS_GRADIENTS: less.table},
            pass_wall_seconds=wall,
            proxy_checkpoints=tuple(str(c.path) for c in less.checkpoints),
            proxy_steps=tuple(c.step for c in less.checkpoints),
            less_learning_rates=tuple(less.learning_rates),
        )
    if s2l is not None:
        return GatheredInputs(
            inputs,
            tables={S2L_TRAJECTORIES: s2l.table},
            pass_wall_seconds=wall,
            proxy_checkpoints=tuple(str(c.path) for c in s2l.checkpoints),
            proxy_steps=tuple(c.step for c in s2l.checkpoints),
        )
    if targets is None:
        return GatheredInputs(inputs, pass_wall_seconds=wall)
    return GatheredInputs(
        inputs,
        target=target,
        target_samples=len(targets.vectors),
        tables={SELECTION_TARGETS: targets.table},
        pass_wall_seconds=wall,
    )


@dataclass(frozen=True)
class _TargetSet:
    """The target set's (M, d) float32 L2-normalised hidden_mean, its pass's cost, its table."""

    vectors: np.ndarray
    cost: PassCost
    table: TableRef


def _targets(
    context: dg.AssetExecutionContext,
    target: str | None,
    target_size: int,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
) -> _TargetSet:
    """Read the target set, embed it under the pool pass's model and settings (cached), and
    return its representations."""
    dataset, layout = context.partition_key, storage.layout
    settings = _pool_settings(pool, dataset)
    frame, table = _target_table(context, target, target_size, storage)
    cache_dir = layout.embedding_cache_dir(
        dataset, pass_cache_key(pool.base_model, settings, PASS_TARGETS)
    )
    try:
        done = run_cached_pass(
            context,
            storage,
            torchrun,
            pipes_subprocess_client,
            table=table,
            sample_ids=frame["sample_id"].to_list(),
            model_path=pool.base_model,
            settings=settings,
            cache_dir=cache_dir,
            world_size=pool.world_size,
            label=f"rds target set {target}",
        )
    except (CacheUnreadable, FileNotFoundError) as e:
        raise dg.Failure(description=f"{dataset}: rds target set {target}: {e}") from e
    kept = done.rows.filter(pl.col("skip_reason").is_null())
    if kept.height == 0:
        raise dg.Failure(
            description=f"{dataset}: no sample of the rds target set {target} has a response "
            f"token within max_length={settings.max_length}"
        )
    vectors = l2_normalise(series_to_matrix(kept["hidden_mean"]).astype(np.float32))
    context.log.info(
        f"rds target set {target}: {kept.height} of {frame.height} samples embedded "
        f"({done.embedded_now} now)"
    )
    return _TargetSet(vectors, done.cost(PASS_TARGETS), table)


def _target_table(
    context: dg.AssetExecutionContext,
    target: str | None,
    target_size: int,
    storage: StorageResource,
) -> tuple[pl.DataFrame, TableRef]:
    """The target set (evaluation/targets.py) as an instruction table, written as the
    ``selection_targets`` table (before any model loads, so a bad target fails first)."""
    dataset, layout = context.partition_key, storage.layout
    folders = [layout.eval_dir, SHARED_EVAL_DIR]
    try:
        frame = target_samples(target or "", target_size, folders)
    except ValueError as e:  # DatasetFormatError is one
        raise dg.Failure(description=f"{dataset}: peripheral_subsets.target: {e}") from e
    table = write_table(frame, layout.table_uri(SELECTION_TARGETS, dataset), guard=storage.guard)
    return frame, table


def _unconditioned(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
    frame: pl.DataFrame,
) -> CachedPass:
    """The second pass of ``ifd``: every clustered sample's response without its prompt
    (``EmbedJob.response_only``), read from the raw_instructions version the pool pass read,
    under its model and settings, cached per sample; its ``mean_loss`` is s(A)."""
    dataset, layout = context.partition_key, storage.layout
    settings = _pool_settings(pool, dataset)
    cache_dir = layout.embedding_cache_dir(
        dataset, pass_cache_key(pool.base_model, settings, PASS_UNCONDITIONED)
    )
    try:
        return run_cached_pass(
            context,
            storage,
            torchrun,
            pipes_subprocess_client,
            table=pool.inputs[RAW_INSTRUCTIONS],
            sample_ids=frame["sample_id"].to_list(),
            model_path=pool.base_model,
            settings=settings,
            cache_dir=cache_dir,
            world_size=pool.world_size,
            response_only=True,
            label="ifd unconditioned pass",
        )
    except (CacheUnreadable, FileNotFoundError) as e:
        raise dg.Failure(description=f"{dataset}: ifd unconditioned pass: {e}") from e


@dataclass(frozen=True)
class _Trajectories:
    """s2l's inputs: the (N, T) float32 loss trajectories, the cost of the proxy run and of each
    loss pass (step order), the proxy's T checkpoints and the trajectories' table."""

    trajectories: np.ndarray
    costs: tuple[PassCost, ...]
    checkpoints: tuple[ProxyCheckpoint, ...]
    table: TableRef


def _s2l_trajectories(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
    frame: pl.DataFrame,
    proxy: ProxyRun,
) -> _Trajectories:
    """s2l's passes: the proxy run over the clustered pool ``frame`` (training/proxy.py),
    then one loss pass per checkpoint, cached per sample under the checkpoint's own key; each
    sample's ``mean_loss`` under checkpoint t is entry t of its trajectory."""
    dataset, layout = context.partition_key, storage.layout
    settings = _pool_settings(pool, dataset)
    checkpoints, proxy_pass = _proxy_run(
        context, storage, torchrun, pipes_subprocess_client, pool, frame, proxy, settings
    )
    sample_ids = frame["sample_id"].to_list()
    columns, costs = [], [proxy_pass]
    for ckpt in checkpoints:
        cache_dir = layout.embedding_cache_dir(
            dataset, pass_cache_key(str(ckpt.path), settings, PASS_S2L_LOSS)
        )
        try:
            done = run_cached_pass(
                context,
                storage,
                torchrun,
                pipes_subprocess_client,
                table=pool.inputs[RAW_INSTRUCTIONS],
                sample_ids=sample_ids,
                model_path=str(ckpt.path),
                settings=settings,
                cache_dir=cache_dir,
                world_size=pool.world_size,
                label=f"s2l loss pass, proxy step {ckpt.step}",
            )
        except (CacheUnreadable, FileNotFoundError) as e:
            raise dg.Failure(
                description=f"{dataset}: s2l loss pass at step {ckpt.step}: {e}"
            ) from e
        columns.append(_column(done.rows, frame, "mean_loss"))
        costs.append(done.cost(PASS_S2L_LOSS))
    trajectories = np.stack(columns, axis=1).astype(np.float32)
    table = write_table(
        pl.DataFrame(
            {"sample_id": sample_ids, "loss_trajectory": trajectories.tolist()},
            schema={"sample_id": pl.String, "loss_trajectory": pl.List(pl.Float32)},
        ),
        layout.table_uri(S2L_TRAJECTORIES, dataset),
        guard=storage.guard,
    )
    return _Trajectories(trajectories, tuple(costs), tuple(checkpoints), table)


def _train_briefly(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
    frame: pl.DataFrame,
    build: Callable[[Allocation], TrainSettings],
    purpose: str,
    steps: int,
    every: int,
) -> tuple[Path, bool]:
    """Train the pool pass's base model on ``frame``'s samples (random token-balanced shards
    over the pool pass's world size, ``build`` giving the settings) under torchrun, or reuse
    the finished run of the same shards, data, model and settings (a killed run resumes from
    its latest checkpoint); returns its folder and whether this call trained."""
    dataset, layout = context.partition_key, storage.layout
    model_path = pool.base_model
    recheck_settings(context, layout, model_path, torchrun.agents)  # before any model loads
    instructions = pool.inputs[RAW_INSTRUCTIONS]
    sample_ids = frame["sample_id"].to_numpy()
    try:
        allocation = proxy_shards(
            dataset, sample_ids, frame["n_tokens"].to_numpy(), pool.world_size
        )
        settings = build(allocation)
        check_training_fits(
            model_path, settings, pool.world_size, torchrun.agents, torchrun.launcher == "slurm"
        )
    except (ValueError, TrainingMemoryError) as e:
        raise dg.Failure(description=f"{dataset}: {purpose}: {e}") from e
    set_hash = manifest_set_hash(allocation.manifests)
    root = layout.proxies_dir(dataset)
    paths = [str(m.write(root / "shards" / set_hash[:16])) for m in allocation.manifests]
    data = samples_fingerprint(instructions.uri, instructions.version, set(sample_ids.tolist()))
    output_dir = checkpoint_folder(root, set_hash, model_path, data, settings)
    hashes = [m.sha256 for m in allocation.manifests]
    trained_now = finished_for(output_dir, hashes) is None
    if trained_now:
        job = TrainJob(
            settings=settings,
            model_path=model_path,
            instructions_uri=instructions.uri,
            instructions_version=instructions.version,
            manifests=paths,
            output_dir=str(output_dir),
            provenance={"dataset": dataset, "purpose": purpose, "steps": steps},
        )
        root.mkdir(parents=True, exist_ok=True)
        job_file = job.dump(root / f"{output_dir.name}.job.json")
        context.log.info(
            f"{purpose}: training {model_path} on {len(sample_ids)} samples for {steps} steps "
            f"on {pool.world_size} rank(s), a checkpoint every {every} steps, into {output_dir}"
        )
        torchrun.run(
            context,
            pipes_subprocess_client,
            RECIPES["train"],
            pool.world_size // torchrun.agents,
            job_file,
        )
    else:
        context.log.info(f"{purpose}: reusing the finished run {output_dir}")
    return output_dir, trained_now


def _proxy_run(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
    frame: pl.DataFrame,
    proxy: ProxyRun,
    embed: EmbedSettings,
) -> tuple[list[ProxyCheckpoint], PassCost]:
    """Train s2l's proxy on the whole pool (or reuse it, :func:`_train_briefly`) and return
    its T checkpoints and its cost."""
    output_dir, trained_now = _train_briefly(
        context,
        storage,
        torchrun,
        pipes_subprocess_client,
        pool,
        frame,
        lambda allocation: proxy_settings(embed, proxy, allocation),
        "s2l proxy",
        proxy.steps,
        proxy.every,
    )
    checkpoints = _checked_steps(
        context.partition_key, "the s2l proxy run", output_dir, proxy_checkpoints(output_dir), proxy
    )
    return checkpoints, _training_cost(PASS_S2L_PROXY, output_dir, trained_now)


def _checked_steps(
    dataset: str, what: str, output_dir: Path, checkpoints: list[ProxyCheckpoint], run: ProxyRun
) -> list[ProxyCheckpoint]:
    """``checkpoints`` of the finished brief run at ``output_dir``, checked to sit at steps
    ``every, 2 every, ..., C every`` of ``run``.

    Raises:
        dagster.Failure: the run holds checkpoints at other steps (it was trained with other
            settings, or edited by hand).
    """
    steps = [c.step for c in checkpoints]
    want = [run.every * (t + 1) for t in range(run.checkpoints)]
    if steps != want:
        raise dg.Failure(
            description=f"{dataset}: {what} {output_dir} holds checkpoints at steps {steps}, "
            f"expected {want}"
        )
    return checkpoints


def _training_cost(name: str, output_dir: Path, trained_now: bool) -> PassCost:
    """The cost record of a brief training run (s2l's proxy, less's warm-up): one forward and
    one backward per sample visit, its seconds and peak memory."""
    cost = proxy_cost(output_dir, trained_now)
    return PassCost(
        name,
        samples=cost.samples,
        tokens=cost.tokens,
        seconds=cost.seconds,
        backward=cost.samples,
        run_now=cost.run_now,
        peak_rss_mib=None if cost.peak_rss_bytes is None else cost.peak_rss_bytes / 2**20,
        peak_cuda_mib=None if cost.peak_cuda_bytes is None else cost.peak_cuda_bytes / 2**20,
    )


@dataclass(frozen=True)
class _LessGradients:
    """The inputs of less: the pool's (N, C, d) and the targets' (M, C, d) float32 normalised
    projected gradients, the checkpoints' learning rates, the costs (the warm-up, then per
    checkpoint the pool's and the targets' gradient passes), the warm-up's C checkpoints, the
    target set's table and the ``less_gradients`` table."""

    pool: np.ndarray
    targets: np.ndarray
    learning_rates: list[float]
    costs: tuple[PassCost, ...]
    checkpoints: tuple[ProxyCheckpoint, ...]
    target_table: TableRef
    table: TableRef


def _gradient_rows(done: CachedPass, d: int) -> tuple[np.ndarray, np.ndarray]:
    """((rows, d) float32 gradients, zeros where skipped; (rows,) bool had a gradient)."""
    ok = done.rows["skip_reason"].is_null().to_numpy()
    out = np.zeros((done.rows.height, d), dtype=np.float32)
    if ok.any():
        out[ok] = series_to_matrix(done.rows.filter(pl.Series(ok))["embedding"])
    return out, ok


def _less_gradients(
    context: dg.AssetExecutionContext,
    target: str | None,
    target_size: int,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    pool: ProxyEmbeddingsRecord,
    frame: pl.DataFrame,
    warm: LessWarmup,
) -> _LessGradients:
    """The passes of less (selection/selectors/less.py): the target set read first (a bad one
    fails before any model loads), the LoRA warm-up on a seeded share of the pool, then per
    warm-up checkpoint the pool's Adam-preconditioned and the targets' plain gradient passes
    (the embedding pass's recipe with ``EmbedJob.gradients``, cached per sample under the
    checkpoint's own key); the pool's gradients written as the ``less_gradients`` table."""
    dataset, layout = context.partition_key, storage.layout
    settings = _pool_settings(pool, dataset)
    targets_frame, target_table = _target_table(context, target, target_size, storage)
    share = frame[warmup_share(frame.height, warm.fraction).tolist()]
    run = warm.run
    train: dict[str, TrainSettings] = {}

    def build(allocation):
        train["settings"] = warmup_settings(settings, warm, allocation)
        return train["settings"]

    output_dir, trained_now = _train_briefly(
        context,
        storage,
        torchrun,
        pipes_subprocess_client,
        pool,
        share,
        build,
        "less warm-up",
        run.steps,
        run.every,
    )
    checkpoints = _checked_steps(
        dataset, "the less warm-up", output_dir, warmup_checkpoints(output_dir), run
    )
    steps = [c.step for c in checkpoints]
    rates = mean_learning_rates(train["settings"], run.steps, steps)
    costs = [_training_cost(PASS_LESS_WARMUP, output_dir, trained_now)]
    pool_ids, target_ids = frame["sample_id"].to_list(), targets_frame["sample_id"].to_list()
    d = warm.projection_dim
    pool_columns, target_columns, kept = [], [], None
    for ckpt in checkpoints:
        passes: tuple[tuple[Literal["adam", "sgd"], list[str], TableRef, str], ...] = (
            ("adam", pool_ids, pool.inputs[RAW_INSTRUCTIONS], PASS_LESS_GRADIENTS),
            ("sgd", target_ids, target_table, PASS_LESS_TARGETS),
        )
        for kind, ids, table, name in passes:
            spec = GradientPass(checkpoint=str(ckpt.path), preconditioner=kind, projection_dim=d)
            key = f"{name}-{kind}-d{d}-s{spec.projection_seed}"
            cache_dir = layout.embedding_cache_dir(
                dataset, pass_cache_key(str(ckpt.path), settings, key)
            )
            label = f"less {'pool' if kind == 'adam' else 'target'} gradients, step {ckpt.step}"
            try:
                done = run_cached_pass(
                    context,
                    storage,
                    torchrun,
                    pipes_subprocess_client,
                    table=table,
                    sample_ids=ids,
                    model_path=pool.base_model,
                    settings=settings,
                    cache_dir=cache_dir,
                    world_size=pool.world_size,
                    gradients=spec,
                    label=label,
                )
            except (CacheUnreadable, FileNotFoundError) as e:
                raise dg.Failure(description=f"{dataset}: {label}: {e}") from e
            vectors, ok = _gradient_rows(done, d)
            passed = done.cost(name)
            costs.append(replace(passed, backward=passed.samples))
            if kind == "adam":
                pool_columns.append(vectors)
            else:
                target_columns.append(vectors)
                kept = ok if kept is None else kept & ok
    assert kept is not None  # at least one checkpoint
    if not kept.any():
        raise dg.Failure(
            description=f"{dataset}: no sample of the less target set {target} has a response "
            f"token within max_length={settings.max_length}"
        )
    grads = np.stack(pool_columns, axis=1)
    table = write_table(
        pl.DataFrame(
            {
                "sample_id": pool_ids,
                "gradients": grads.reshape(len(pool_ids), -1).tolist(),
            },
            schema={"sample_id": pl.String, "gradients": pl.List(pl.Float32)},
        ),
        layout.table_uri(LESS_GRADIENTS, dataset),
        guard=storage.guard,
    )
    context.log.info(
        f"less: {len(pool_ids)} pool and {int(kept.sum())} target gradients at warm-up steps "
        f"{steps} (learning rates {[f'{r:.3g}' for r in rates]}), projected to d = {d}"
    )
    return _LessGradients(
        grads,
        np.stack(target_columns, axis=1)[kept],
        rates,
        tuple(costs),
        tuple(checkpoints),
        target_table,
        table,
    )
