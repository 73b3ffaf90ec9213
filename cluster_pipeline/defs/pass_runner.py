"""The model passes a stage launches, each a torchrun job (docs/design.md, step 1 and
"Incremental refresh"): the embedding pass over the samples a per-sample cache folder lacks
(:func:`run_cached_pass`; ``proxy_embeddings`` runs it over the pool), any selector's own
passes (:class:`DagsterPassRunner`, the :class:`~cluster_pipeline.selection.passes.PassRunner`
of ``peripheral_subsets``), what ``trained_checkpoint`` decides before its training job
starts (:func:`plan_training`), and the evaluation of the models ``eval_report`` compares
(:func:`evaluate_models`).

A selector declares its passes as requests (selection/passes.py); this module carries them out
the same way for every selector, under the pool pass's model and settings and on its world
size: a forward pass is the embedding recipe (``recipes/embed.py``) over the pool (the
``raw_instructions`` version the pool pass read) or the target set, cached per sample under
its own key (the pass's kind is part of the cache key, so a selector's pass is paid once per
sample and model, and the pool's cache counts only pool passes); a brief training run is the
training recipe (``recipes/train.py``) on random token-balanced shards of pool samples, reused
when finished and resumed when killed (training/proxy.py). Launching and its failures are the
torchrun resource's (one place formats a failed launch); a pass that cannot be read back fails
here, naming the dataset and the pass. Nothing here names a selector.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import polars as pl

from cluster_pipeline.data.datasets import samples_fingerprint
from cluster_pipeline.data.folders import file_group, record_field_values
from cluster_pipeline.data.stdlib_dataset import DATASET_NAME as STDLIB_DATASET
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    ProxyEmbeddingsRecord,
    ShardManifestsRecord,
    pinned_record,
)
from cluster_pipeline.defs.resources import StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import recheck_settings, refused_in_step
from cluster_pipeline.evaluation.report import evaluate_entries
from cluster_pipeline.evaluation.suites import EvalJob, EvalModel, EvalSettings, plan_suites
from cluster_pipeline.evaluation.targets import target_samples, target_tasks
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.selection.embedding_table import EmbeddingTable, assemble_table
from cluster_pipeline.selection.passes import (
    PASS_EMBEDDING,
    BriefTraining,
    ForwardPass,
    PassCost,
    PassOutput,
    Pool,
    RunCheckpoint,
    TrainedRun,
    mib_of,
)
from cluster_pipeline.selection.sharding import manifest_set_hash, read_recorded_manifests
from cluster_pipeline.storage.cache import JsonCache, stable_hash
from cluster_pipeline.storage.disk import DiskFull, require_space
from cluster_pipeline.storage.embedding_cache import (
    CacheUnreadable,
    cache_key,
    cached_pass_stats,
    pending_pass,
    pool_seconds,
    read_cached,
    store_pass,
)
from cluster_pipeline.storage.layout import SHARED_EVAL_DIR
from cluster_pipeline.storage.names import PROXY_EMBEDDINGS, RAW_INSTRUCTIONS, SELECTION_TARGETS
from cluster_pipeline.storage.tables import TableRef, series_to_matrix, write_table
from cluster_pipeline.tracking.tracker import TrackingTarget
from cluster_pipeline.training.checkpointing import (
    Checkpoint,
    ResumableRun,
    checkpoint_bytes,
    finished_for,
    list_checkpoints,
    read_checkpoint,
    resumable_runs,
)
from cluster_pipeline.training.config import (
    EmbedJob,
    EmbedSettings,
    GradientPass,
    TrainJob,
    TrainSettings,
)
from cluster_pipeline.training.memory import (
    MemoryEstimate,
    TrainingMemoryError,
    parameter_count,
)
from cluster_pipeline.training.preflight import check_training_fits, checkpoint_folder
from cluster_pipeline.training.proxy import (
    ProxyRun,
    mean_learning_rates,
    proxy_checkpoints,
    proxy_cost,
    proxy_settings,
    proxy_shards,
    warmup_checkpoints,
    warmup_settings,
)


def pass_cache_key(model_path: str, settings: EmbedSettings, kind: str = "") -> str:
    """The cache folder's key of a pass: the pool's (``kind=""``) or a selector pass's, which
    adds its kind."""
    fields = settings.cache_fields()
    return cache_key(model_path, {**fields, "pass": kind} if kind else fields)


def hidden_size(model_path: str) -> int:
    """The model's hidden size d from its ``config.json`` (0 when it does not say)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = config.get("hidden_size") or config.get("n_embd") or config.get("d_model") or 0
    return int(value) if isinstance(value, int) else 0


def pass_row_bytes(width: int) -> int:
    """Bytes one sample's row of a pass takes on disk: two float32 vectors of ``width``
    (``embedding``, ``hidden_mean``: incompressible) and the scalar columns (about 64 bytes)."""
    return 2 * 4 * width + 64


@dataclass(frozen=True)
class CachedPass:
    """A finished pass: the cached rows (:data:`~cluster_pipeline.storage.embedding_cache.
    CHUNK_SCHEMA`) of the samples asked for, in their order; its cache folder; the samples
    embedded by this run; this run's pass statistics ({} when every sample was cached)."""

    rows: pl.DataFrame
    cache_dir: Path
    embedded_now: int
    stats: dict[str, Any]

    def packing(self) -> dict[str, Any]:
        """``packed`` (whether this run's pass packed its batches; None when every sample was
        cached) and ``warnings`` (the packing gate's refusal, where it refused), from the
        pass's figures (training/embedding_pass.py)."""
        if not self.embedded_now:
            return {"packed": None, "warnings": []}
        return {
            "packed": self.stats.get("packed"),
            "warnings": list(self.stats.get("warnings") or []),
        }

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
    end_of_turn: bool = True,
    pooling: str = "response_mean",
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
        response_only: each sample's response without its prompt (``EmbedJob.response_only``).
        gradients: a gradient pass (``EmbedJob.gradients``) instead of the embedding.
        label: prefixes the log lines (empty for the pool).
        end_of_turn: score the trained turns' closing tokens (``EmbedJob.end_of_turn``).
        pooling: what ``hidden_mean`` pools (``EmbedJob.pooling``).

    Raises:
        CacheUnreadable: the cache's files are damaged.
        FileNotFoundError: chunks missing or holding other samples.
        DiskFull: the cache's disk lacks the room for the pass's chunks and their copy into
            the cache (2 x samples x :func:`pass_row_bytes`), checked before torchrun starts.
        dagster.Failure: a rank failed (:meth:`TorchrunResource.run`).
    """
    prefix = f"{label}: " if label else ""
    todo = pending_pass(cache_dir, sample_ids, settings.chunk_size, recompute)
    stats: dict[str, Any] = {}
    if todo is not None:
        if not todo.finished:
            # Before any rank starts: room for the chunks and their copy into the cache.
            width = gradients.projection_dim if gradients is not None else hidden_size(model_path)
            needed = 2 * len(todo.sample_ids) * pass_row_bytes(width)
            require_space(cache_dir, needed, f"{prefix}embed {len(todo.sample_ids)} samples")
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
                end_of_turn=end_of_turn,
                pooling="position_weighted" if pooling == "position_weighted" else "response_mean",
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


def pool_embeddings(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    table: TableRef,
    sample_ids: list[str],
    model_path: str,
    settings: EmbedSettings,
    world_size: int,
    recompute: bool,
) -> tuple[CachedPass, EmbeddingTable, Path]:
    """``proxy_embeddings``' pass (:func:`run_cached_pass` over the pool, cached under the
    model and settings' key) and its table (:func:`assemble_table`); also the cache folder.

    Raises:
        dagster.Failure: the cache is damaged, its chunks are missing (re-run with recompute:
            true) or a sample cannot be embedded at ``max_length``, naming the dataset; a
            rank's failure as :func:`run_cached_pass` raises it.
    """
    dataset = context.partition_key
    cache_dir = storage.layout.embedding_cache_dir(dataset, pass_cache_key(model_path, settings))
    try:
        done = run_cached_pass(
            context,
            storage,
            torchrun,
            pipes_subprocess_client,
            table=table,
            sample_ids=sample_ids,
            model_path=model_path,
            settings=settings,
            cache_dir=cache_dir,
            world_size=world_size,
            recompute=recompute,
        )
        return done, assemble_table(done.rows), cache_dir
    except CacheUnreadable as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    except FileNotFoundError as e:
        raise dg.Failure(f"{dataset}: {e}; re-run with recompute: true") from e
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e} (max_length={settings.max_length})") from e


def _values(rows: pl.DataFrame, ran: np.ndarray, column: str, width: int | None) -> np.ndarray:
    """(n,) float32 ``mean_loss`` (nan where null), or the (n, d) float32 rows of a vector
    column (zero rows where the sample was not passed; d = ``width`` or the vectors')."""
    if column == "mean_loss":
        return rows[column].cast(pl.Float32).fill_null(float("nan")).to_numpy()
    kept = series_to_matrix(rows.filter(pl.Series(ran))[column]) if ran.any() else None
    d = width if width is not None else (kept.shape[1] if kept is not None else 0)
    out = np.zeros((rows.height, d), dtype=np.float32)
    if kept is not None:
        out[ran] = kept
    return out


@dataclass
class DagsterPassRunner:
    """Runs a selector's passes for the clustered pool of ``clusters`` under the pool pass's
    model and settings (the ``proxy_embeddings`` materialization the clustering read), on its
    world size.

    Attributes:
        frame: the clustered pool, read when the runner is made: columns sample_id, cluster,
            sq_distance (the clustering's table), n_tokens, n_response_tokens (the pool
            pass's); table order.
        tables: the tables its passes wrote (the selection records them among its inputs).
        wall_seconds: wall seconds spent in its passes in this run.
    """

    context: dg.AssetExecutionContext
    storage: StorageResource
    torchrun: TorchrunResource
    pipes_subprocess_client: dg.PipesSubprocessClient
    clusters: BalancedClustersRecord
    tables: dict[str, TableRef] = field(default_factory=dict)
    wall_seconds: float = 0.0
    _targets: tuple[TableRef, list[str]] | None = None
    _target_name: str = ""

    def __post_init__(self) -> None:
        self.embeddings = self.clusters.inputs[PROXY_EMBEDDINGS]
        self.frame = self.clusters.table.read(["sample_id", "cluster", "sq_distance"]).join(
            self.embeddings.read(["sample_id", "n_tokens", "n_response_tokens"]),
            on="sample_id",
            how="left",
            maintain_order="left",
        )
        self.record = pinned_record(self.context, ProxyEmbeddingsRecord, self.embeddings)
        self.dataset = self.context.partition_key

    @property
    def pool(self) -> Pool:
        """The clustered pool, with the pool pass's world size, max_length and cost."""
        frame, record = self.frame, self.record
        return Pool(
            dataset=self.dataset,
            sample_ids=frame["sample_id"].to_numpy(),
            labels=frame["cluster"].to_numpy(),
            k=self.clusters.num_clusters,
            sq_distance=frame["sq_distance"].to_numpy(),
            lengths=frame["n_tokens"].to_numpy(),
            response_tokens=frame["n_response_tokens"].to_numpy(),
            world_size=record.world_size,
            max_length=int(record.embed_settings.get("max_length", 0)),
            cost=PassCost(
                PASS_EMBEDDING,
                samples=frame.height,
                tokens=int(frame["n_tokens"].sum()),
                seconds=record.selection_seconds,
                run_now=record.samples_embedded_now,
                peak_rss_mib=record.peak_rss_mib,
                peak_cuda_mib=record.peak_cuda_mib,
            ),
        )

    @property
    def settings(self) -> EmbedSettings:
        """The pool pass's settings, which a selector's own passes reuse.

        Raises:
            dagster.Failure: the pool pass recorded none (an older version of the pipeline).
        """
        if not self.record.embed_settings:
            raise dg.Failure(
                description=f"{self.dataset}: the proxy_embeddings materialization the "
                "clustering read recorded no embedding settings (an older version of the "
                "pipeline), which the selector's own pass must reuse; materialize "
                "proxy_embeddings again."
            )
        return EmbedSettings.model_validate(self.record.embed_settings)

    def pool_column(self, column: str) -> np.ndarray:
        """(N,) float32 ``column`` of the pool pass's table, pool order, nan where null."""
        rows = self.embeddings.read(["sample_id", column])
        joined = self.frame.select("sample_id").join(
            rows, on="sample_id", how="left", maintain_order="left"
        )
        return joined[column].cast(pl.Float32).fill_null(float("nan")).to_numpy()

    def pool_vectors(self, column: str) -> np.ndarray:
        """(N, d) float32 vectors of the pool pass's table, pool order."""
        return self.embeddings.vectors_for(column, self.frame["sample_id"])

    def pool_sources(self) -> np.ndarray:
        """(N,) str each pool sample's source (:func:`record_sources`: its record's ``source``
        or ``dataset`` field, else its ``source_file``; the ``raw_instructions`` version the
        pool pass read), pool order; the built-in dataset is one source (its samples' files are
        the standard library's modules, not files of a dataset folder).

        Raises:
            ValueError: a pool file is gone or changed since ``raw_instructions`` read it.
        """
        if self.dataset == STDLIB_DATASET:
            return np.full(self.frame.height, STDLIB_DATASET)
        rows = self.record.inputs[RAW_INSTRUCTIONS].read(
            ["sample_id", "source_file", "source_index"]
        )
        joined = self.frame.select("sample_id").join(
            rows.unique("sample_id", keep="first"),
            on="sample_id",
            how="left",
            maintain_order="left",
        )
        files = joined["source_file"].fill_null("").to_list()
        sources = record_sources(
            files,
            joined["source_index"].to_list(),
            (self.storage.layout.raw_dir / self.dataset, joined["sample_id"].to_list()),
        )
        line = fallback_line(files, sources)
        if line:
            self.log(line)
        return sources

    def target_tasks(self) -> np.ndarray:
        """(M,) str the task of each target sample (evaluation/targets.target_tasks).

        Raises:
            ValueError: no target set was read.
        """
        if self._targets is None:
            raise ValueError("read the target set first")
        table, _ = self._targets
        frame = table.read()  # at most target_size rows; source_index where the table has it
        return np.asarray(target_tasks(frame, self._target_name), dtype=str)

    def target_set(self, target: str | None, size: int) -> int:
        """Read the target set (evaluation/targets.py) as an instruction table and write it as
        the ``selection_targets`` table, before any model loads; its sample count."""
        start, layout = time.perf_counter(), self.storage.layout
        try:
            frame = target_samples(target or "", size, [layout.eval_dir, SHARED_EVAL_DIR])
        except ValueError as e:  # DatasetFormatError is one
            problem = f"{self.dataset}: peripheral_subsets.target: {e}"
            raise refused_in_step(self.context, layout, problem) from e
        table = write_table(
            frame, layout.table_uri(SELECTION_TARGETS, self.dataset), guard=self.storage.guard
        )
        self.tables[SELECTION_TARGETS] = table
        self._targets = (table, frame["sample_id"].to_list())
        self._target_name = target or ""
        self.wall_seconds += time.perf_counter() - start
        return frame.height

    def forward(self, request: ForwardPass) -> PassOutput:
        """One cached pass of the embedding recipe (module docstring)."""
        start, settings = time.perf_counter(), self.settings
        if request.over == "pool":
            table, ids = self.record.inputs[RAW_INSTRUCTIONS], self.frame["sample_id"].to_list()
            if request.samples is not None:
                ids = [ids[i] for i in request.samples]
        elif self._targets is not None:
            table, ids = self._targets
        else:
            raise ValueError(f"{request.label or request.name}: read the target set first")
        base = self.record.base_model
        grad = request.gradients
        # The cache is keyed by the weights that make the rows: the model, or the checkpoint
        # whose adapter and optimizer state a gradient pass loads.
        keyed_by = request.model or (grad.checkpoint if grad else base)
        # What the rows hold is part of the key, whatever the request's name.
        kind = request.key or request.name
        kind += "" if request.end_of_turn else "+no_end_of_turn"
        kind += "" if request.pooling == "response_mean" else f"+{request.pooling}"
        cache_dir = self.storage.layout.embedding_cache_dir(
            self.dataset, pass_cache_key(keyed_by, settings, kind)
        )
        gradients = None
        if grad is not None:
            gradients = GradientPass(
                checkpoint=grad.checkpoint,
                preconditioner=grad.preconditioner,
                projection_dim=grad.projection_dim,
                projection_seed=grad.projection_seed,
            )
        label = request.label or request.name
        try:
            done = run_cached_pass(
                self.context,
                self.storage,
                self.torchrun,
                self.pipes_subprocess_client,
                table=table,
                sample_ids=ids,
                model_path=request.model or base,
                settings=settings,
                cache_dir=cache_dir,
                world_size=self.record.world_size,
                response_only=request.response_only,
                gradients=gradients,
                label=label,
                end_of_turn=request.end_of_turn,
                pooling=request.pooling,
            )
        except (CacheUnreadable, FileNotFoundError) as e:
            raise dg.Failure(description=f"{self.dataset}: {label}: {e}") from e
        ran = done.rows["skip_reason"].is_null().to_numpy()
        width = grad.projection_dim if grad is not None else None
        values = {c: _values(done.rows, ran, c, width) for c in request.read}
        self.wall_seconds += time.perf_counter() - start
        return PassOutput(ran, values, done.cost(request.name), done.embedded_now)

    def train(self, request: BriefTraining) -> TrainedRun:
        """One brief training run (module docstring), its checkpoints checked to sit at steps
        ``every, 2 every, ..., S``."""
        start, dataset, layout = time.perf_counter(), self.dataset, self.storage.layout
        model_path, world_size = self.record.base_model, self.record.world_size
        recheck_settings(self.context, layout, model_path, self.torchrun.agents)  # before loading
        embed = self.settings
        frame = self.frame if request.samples is None else self.frame[request.samples.tolist()]
        instructions = self.record.inputs[RAW_INSTRUCTIONS]
        sample_ids = frame["sample_id"].to_numpy()
        try:
            run = ProxyRun(request.steps, request.checkpoints, request.learning_rate)
            allocation = proxy_shards(dataset, sample_ids, frame["n_tokens"].to_numpy(), world_size)
            settings = (
                warmup_settings(embed, run, request.lora_r, allocation)
                if request.lora_r
                else proxy_settings(embed, run, allocation)
            )
            check_training_fits(
                model_path, settings, world_size, self.torchrun.agents, self.torchrun.remote
            )
        except (ValueError, TrainingMemoryError) as e:
            problem = f"{dataset}: {request.purpose}: {e}"
            raise refused_in_step(self.context, self.storage.layout, problem) from e
        set_hash = manifest_set_hash(allocation.manifests)
        root = layout.proxies_dir(dataset)
        paths = [str(m.write(root / "shards" / set_hash[:16])) for m in allocation.manifests]
        data = samples_fingerprint(instructions.uri, instructions.version, set(sample_ids.tolist()))
        output_dir = checkpoint_folder(root, set_hash, model_path, data, settings)
        trained_now = finished_for(output_dir, [m.sha256 for m in allocation.manifests]) is None
        if trained_now:
            job = TrainJob(
                settings=settings,
                model_path=model_path,
                instructions_uri=instructions.uri,
                instructions_version=instructions.version,
                manifests=paths,
                output_dir=str(output_dir),
                provenance={"dataset": dataset, "purpose": request.purpose, "steps": run.steps},
            )
            root.mkdir(parents=True, exist_ok=True)
            job_file = job.dump(root / f"{output_dir.name}.job.json")
            self.context.log.info(
                f"{request.purpose}: training {model_path} on {len(sample_ids)} samples for "
                f"{run.steps} steps on {world_size} rank(s), a checkpoint every {run.every} "
                f"steps, into {output_dir}"
            )
            self.torchrun.run(
                self.context,
                self.pipes_subprocess_client,
                RECIPES["train"],
                world_size // self.torchrun.agents,
                job_file,
            )
        else:
            self.context.log.info(f"{request.purpose}: reusing the finished run {output_dir}")
        found = (warmup_checkpoints if request.optimizer_states else proxy_checkpoints)(output_dir)
        steps = [c.step for c in found]
        want = [run.every * (t + 1) for t in range(run.checkpoints)]
        if steps != want:
            raise dg.Failure(
                description=f"{dataset}: the {request.purpose} run {output_dir} holds "
                f"checkpoints at steps {steps}, expected {want}"
            )
        rates = mean_learning_rates(settings, run.steps, steps) if request.learning_rates else []
        self.wall_seconds += time.perf_counter() - start
        return TrainedRun(
            tuple(RunCheckpoint(str(c.path), c.step) for c in found),
            tuple(rates),
            _training_cost(request.name, output_dir, trained_now),
        )

    def write_table(self, name: str, frame: pl.DataFrame) -> None:
        """Write a selector's own table under the dataset; recorded in :attr:`tables`."""
        start, layout = time.perf_counter(), self.storage.layout
        self.tables[name] = write_table(
            frame, layout.table_uri(name, self.dataset), guard=self.storage.guard
        )
        self.wall_seconds += time.perf_counter() - start

    def log(self, message: str) -> None:
        """One line in the run's log."""
        self.context.log.info(message)


def _training_cost(name: str, output_dir: Path, trained_now: bool) -> PassCost:
    """The cost record of a brief training run: one forward and one backward per sample
    visit, its seconds and peak memory."""
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
class TrainingPlan:
    """Where ``trained_checkpoint``'s checkpoint goes (``output_dir``: the same manifests,
    data, model and settings give the same folder), whether a finished one there is reused,
    the estimated peak memory per rank, and the other runs of the dataset that could resume
    but will not (``set_aside``: a new selection, or other training settings, replaced what
    they trained on)."""

    output_dir: Path
    reused: bool
    memory_per_rank: MemoryEstimate
    set_aside: tuple[ResumableRun, ...] = ()

    def set_aside_note(self, dataset: str, manifest_set_sha256: str) -> str | None:
        """One line naming each resumable checkpoint this run will not resume, why, that it is
        kept, how to resume it and how to free its space; None when there is none."""
        if not self.set_aside:
            return None
        parts = []
        for run in self.set_aside:
            by = f"run {run.run_id[:8]}" if run.run_id else "an earlier run"
            if run.manifest_set_sha256 and run.manifest_set_sha256 != manifest_set_sha256:
                why = (
                    f"trained on shard manifests {run.manifest_set_sha256[:12]}, which a new "
                    f"selection ({manifest_set_sha256[:12]}) replaced"
                )
            else:
                why = "trained with other training settings, data or base model"
            parts.append(
                f"{by}'s resumable checkpoint {run.latest} (step {run.step}, "
                f"{run.bytes / 2**30:.2f} GiB) was {why}"
            )
        return (
            f"dataset {dataset!r}: this run trains {self.output_dir.name} from the start and "
            "does not resume: " + "; ".join(parts) + ". Each is kept: to resume one, materialize "
            "the selection again with the settings of the run that made it (the same settings "
            "give the same manifests) and re-execute it; to free its space, delete its "
            f"folder ({', '.join(str(r.intermediate) for r in self.set_aside)})"
        )

    def set_aside_metadata(self) -> dict[str, Any]:
        """``resumable_not_resumed``: each set-aside run's facts, for the asset's metadata
        (empty when none)."""
        if not self.set_aside:
            return {}
        return {"resumable_not_resumed": [r.to_metadata() for r in self.set_aside]}

    def train_or_reuse(
        self,
        context: dg.AssetExecutionContext,
        torchrun: TorchrunResource,
        pipes_client: dg.PipesSubprocessClient,
        world_size: int,
        job_file: Path,
    ) -> dict[str, Any]:
        """Train the job (``world_size`` ranks over the torchrun agents) unless the finished
        checkpoint is reused (training is deterministic given these inputs: the checkpoint is
        the answer, and a line says so); what rank 0 reported, ``{}`` when reused."""
        if self.reused:
            context.log.info(
                f"reusing {self.output_dir}: same manifests, data, model and settings "
                "(set retrain: true to train again)"
            )
            return {}
        nproc = world_size // torchrun.agents
        launched = torchrun.run(context, pipes_client, RECIPES["train"], nproc, job_file)
        return dict(launched.get_materialize_result().metadata or {})

    def write_job(
        self,
        shards: ShardManifestsRecord,
        settings: TrainSettings,
        model_path: str,
        provenance: dict[str, Any],
        tracking: TrackingTarget | None,
    ) -> Path:
        """The training job (the shards' manifests on the raw_instructions version they were
        selected from, into :attr:`output_dir`), written beside the checkpoint's folder."""
        instructions = shards.inputs[RAW_INSTRUCTIONS]
        job = TrainJob(
            settings=settings,
            model_path=model_path,
            instructions_uri=instructions.uri,
            instructions_version=instructions.version,
            manifests=shards.manifest_paths,
            output_dir=str(self.output_dir),
            provenance=provenance,
            tracking=tracking,
        )
        self.output_dir.parent.mkdir(parents=True, exist_ok=True)
        return job.dump(self.output_dir.parent / f"{self.output_dir.name}.job.json")


def plan_training(
    context: dg.AssetExecutionContext,
    storage: StorageResource,
    torchrun: TorchrunResource,
    shards: ShardManifestsRecord,
    settings: TrainSettings,
    model_path: str,
    retrain: bool,
) -> TrainingPlan:
    """What is checked and decided before a training job's process starts: the run's rules
    again with what the step knows by now, the manifest files are the ones ``shard_manifests``
    recorded (a manifest copied in or edited would otherwise fail only inside torchrun, or be
    trained on), the ranks divide over the torchrun agents and the model fits; and which
    resumable checkpoints of the dataset this run leaves aside (:attr:`TrainingPlan.set_aside`).

    Raises:
        dagster.Failure: any of those refused, naming the dataset.
    """
    dataset = context.partition_key
    recheck_settings(context, storage.layout, model_path, torchrun.agents)  # before any model
    try:
        read_recorded_manifests(shards.manifest_paths, shards.manifest_sha256, dataset)
        memory = check_training_fits(
            model_path, settings, shards.world_size, torchrun.agents, torchrun.remote
        )
    except (ValueError, TrainingMemoryError) as e:
        raise refused_in_step(context, storage.layout, f"dataset {dataset!r}: {e}") from e
    instructions = shards.inputs[RAW_INSTRUCTIONS]
    sample_ids = set(shards.table.read(["sample_id"])["sample_id"].to_list())
    data = samples_fingerprint(instructions.uri, instructions.version, sample_ids)
    run_dir = storage.layout.checkpoints_dir(dataset)
    output_dir = checkpoint_folder(run_dir, shards.manifest_set_sha256, model_path, data, settings)
    reused = not retrain and finished_for(output_dir, shards.manifest_sha256) is not None
    if not reused:  # room for the checkpoint, whose size the model gives, before any rank starts
        n = parameter_count(model_path)
        needed = checkpoint_bytes(n, 0 if settings.lora_r else n, bool(settings.save_every_steps))
        try:
            require_space(run_dir, needed, f"train {output_dir.name}")
        except DiskFull as e:
            raise dg.Failure(f"dataset {dataset!r}: {e}") from e
    others = tuple(r for r in resumable_runs(run_dir) if r.output_dir != output_dir)
    return TrainingPlan(output_dir, reused, memory, others)


def models_to_compare(checkpoint_path: str, compare: bool) -> tuple[Checkpoint, list[Checkpoint]]:
    """The trained checkpoint, and every finished checkpoint of its folder's runs when
    ``compare`` (itself among them in any case).

    Raises:
        dagster.Failure: ``checkpoint_path`` is not a finished checkpoint.
    """
    current = read_checkpoint(checkpoint_path)
    if current is None:
        raise dg.Failure(
            f"{checkpoint_path} is not a finished checkpoint; materialize trained_checkpoint again"
        )
    checkpoints = list_checkpoints(current.path.parent) if compare else []
    if current.path not in [c.path for c in checkpoints]:
        checkpoints.append(current)
    return current, checkpoints


def eval_suites(
    context: dg.AssetExecutionContext, storage: StorageResource, settings: EvalSettings
) -> tuple[dict[str, list], dict[str, str], list[Path]]:
    """The partition's benchmarks and their items, before any model is loaded
    (:func:`~cluster_pipeline.evaluation.suites.plan_suites`, from the data folder's
    ``eval/`` or the shared one); each skipped benchmark logged with its reason.

    Returns:
        (benchmark -> items, benchmark -> why it was skipped, the folders searched).

    Raises:
        dagster.Failure: the dataset's eval.json is malformed, names an unknown benchmark, or
            the sandbox cannot isolate generated code (plan_suites' refusals), naming the
            dataset.
    """
    dataset, layout = context.partition_key, storage.layout
    try:
        suites, skipped, folders = plan_suites(
            dataset, settings, layout.raw_dir, [layout.eval_dir, SHARED_EVAL_DIR]
        )
    except ValueError as e:
        raise dg.Failure(f"{dataset}: {e}") from e
    for name, reason in skipped.items():
        context.log.info(f"benchmark {name} skipped: {reason}")
    return suites, skipped, folders


def evaluate_models(
    context: dg.AssetExecutionContext,
    torchrun: TorchrunResource,
    pipes_client: dg.PipesSubprocessClient,
    entries: list[Any],
    job_of: Callable[[list[EvalModel]], EvalJob],
    cache_dir: Path,
    settings_key: str,
    current: str,
) -> tuple[list[Any], dict[str, Any]]:
    """Every model of ``entries`` evaluated, each read from the cache in ``cache_dir`` under
    ``settings_key`` when there (:func:`~cluster_pipeline.evaluation.report.evaluate_entries`),
    the others in one process (:func:`evaluator`, job files under ``cache_dir/jobs``);
    ``current``: the trained checkpoint's folder.

    Returns:
        (each model's result, the held-out split's statistics).
    """
    evaluate = evaluator(context, torchrun, pipes_client, job_of, cache_dir / "jobs")
    return evaluate_entries(
        entries,
        evaluate,
        JsonCache(cache_dir),
        settings_key=settings_key,
        current=current,
        log=context.log.info,
    )


def evaluator(
    context: dg.AssetExecutionContext,
    torchrun: TorchrunResource,
    pipes_client: dg.PipesSubprocessClient,
    job_of: Callable[[list[EvalModel]], EvalJob],
    run_dir: Path,
) -> Callable[[list[str], Callable[[str, dict], None]], None]:
    """``(paths, done)``: the models at ``paths`` evaluated in one process (torchrun, one rank,
    on this machine), its job file and logs (``<job>.logs/``) under ``run_dir``, and one outcome
    file per model (``<hash of its path>.outcome.json``; a new evaluation of the same model
    replaces it: the cache keeps outcomes). ``done(path, outcome)`` is called for each model
    whose outcome the process wrote, also when the process then failed on a later one."""
    run_dir.mkdir(parents=True, exist_ok=True)

    def evaluate(paths: list[str], done: Callable[[str, dict], None]) -> None:
        models = [
            EvalModel(
                model_path=p, output=str(run_dir / f"{stable_hash(p, length=12)}.outcome.json")
            )
            for p in paths
        ]
        for model in models:  # an outcome left by an earlier evaluation is not this one's
            Path(model.output).unlink(missing_ok=True)
        job_file = job_of(models).dump(run_dir / f"{stable_hash(paths, length=12)}.job.json")
        try:
            torchrun.run(context, pipes_client, RECIPES["evaluate"], 1, job_file, local=True)
        finally:
            for model in models:
                out = Path(model.output)
                if out.exists():
                    done(model.model_path, json.loads(out.read_text()))

    return evaluate


# The record fields that name a sample's source, first found wins: S2L's data (``source``,
# BigML-CS-UCLA/S2L schedules/s2l.py:21) and RDS+'s Tulu mixtures (``dataset``,
# hamishivi/automated-instruction-selection scripts/construct_downsampled_balanced.py:28).
SOURCE_FIELDS = ("source", "dataset")


def fallback_line(files: list[str], sources: np.ndarray) -> str | None:
    """The line saying how many samples took their file as their source beside others that a
    record field names (None when all or none did): a `source` field missing from some
    records mixes file names into the sources."""
    fell_back = sum(str(s) == file_group(f) for f, s in zip(files, sources, strict=True))
    if 0 < fell_back < len(files):
        return (
            f"{fell_back} of the pool's {len(files)} samples have no usable `source` or `dataset` "
            "field (missing, empty, or not a string or number): their file is their source, "
            "beside the field's values"
        )
    return None


def record_sources(
    files: list[str],
    indices: list[int | None],
    identity: tuple[Path, list[str]] | None = None,
) -> np.ndarray:
    """Each sample's source, as S2L's per-source split and ``balanced_random`` read it: its
    record's ``source`` field, else its ``dataset`` field (:data:`SOURCE_FIELDS`; a string or
    number, not empty), else the file it was read from
    (:func:`~cluster_pipeline.data.folders.record_field_values`), the shards of one sharded
    file being one source (:func:`~cluster_pipeline.data.folders.file_group`).

    Args:
        files: (N,) each sample's ``source_file`` ("" for none).
        indices: (N,) each sample's ``source_index`` (0-based place among the file's records;
            None for a table written before that column, whose samples keep their file).
        identity: (the dataset folder, (N,) each sample's ``sample_id``): each record read must
            still be that sample (:func:`~cluster_pipeline.data.folders.record_field_values`).

    Returns:
        (N,) str array of sources.

    Raises:
        ValueError: a file is gone, holds fewer records than an index names, or another sample
            at an index (it changed since ``raw_instructions`` read it): naming the file and
            what to do.
    """
    values = record_field_values(files, indices, SOURCE_FIELDS, "the pool's sources", identity)
    return np.array(
        [
            file_group(file) if value is None else value
            for file, value in zip(files, values, strict=True)
        ],
        dtype=str,
    )
