"""What each stage records about a materialization, as one typed dataclass per stage, and how a
stage builds its record from its results (the ``*_record`` functions at the end).

A stage returns ``record.to_metadata()`` (plus display-only entries: previews, plots) in its
``MaterializeResult``; a downstream stage reads the record back with :func:`read_record` (the
latest materialization of its partition) or :func:`pinned_record` (the materialization that
wrote one exact table version). Every record of the selection chain carries ``inputs``: the
Delta table versions, by asset, that it was computed from, transitively. Downstream stages read
those versions, never "the newest table", so a stage re-run in between cannot mix versions
(docs/design.md, "Versions and lineage").

Metadata keys are the field names; a :class:`TableRef` field ``x`` is stored as ``x_uri`` (a
path) and ``x_version``.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

import dagster as dg
import polars as pl

from cluster_pipeline.selection.clustering import StreamedClusters
from cluster_pipeline.selection.passes import PASS_EMBEDDING, round_mib
from cluster_pipeline.selection.selectors import (
    SelectionKnobs,
    SelectionResult,
    cluster_weights,
    own_knobs,
    record_details,
)
from cluster_pipeline.storage.layout import DATA_DIR_ENV, DataLayout, default_data_dir
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    EVAL_REPORT,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SAMPLE_LINEAGE,
    SHARD_MANIFESTS,
    TRAINED_CHECKPOINT,
)
from cluster_pipeline.storage.provenance import code_identity
from cluster_pipeline.storage.tables import TableRef
from cluster_pipeline.training.checkpointing import Checkpoint


class UpstreamNotMaterialized(dg.Failure):
    """An upstream stage has no (usable) materialization for this partition."""


def _encode(value: Any, as_path: bool) -> Any:
    if isinstance(value, TableRef):
        raise TypeError("TableRef fields are expanded by to_metadata")
    if isinstance(value, dict) and value and all(isinstance(v, TableRef) for v in value.values()):
        return dg.MetadataValue.json(
            {k: {"uri": v.uri, "version": v.version} for k, v in value.items()}
        )
    if isinstance(value, (dict, list, tuple)):
        return dg.MetadataValue.json(value if not isinstance(value, tuple) else list(value))
    if as_path and value is not None:
        return dg.MetadataValue.path(str(value))
    return value


@dataclass(frozen=True, kw_only=True)
class StageRecord:
    """Base of the per-stage records. ``ASSET`` names the asset that writes it."""

    ASSET: ClassVar[str]
    # Fields shown in the UI as paths.
    PATHS: ClassVar[tuple[str, ...]] = ()

    def to_metadata(self) -> dict[str, Any]:
        """Dagster metadata entries: field name -> value (TableRef -> ``_uri``/``_version``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, TableRef):
                out[f"{f.name}_uri"] = dg.MetadataValue.path(value.uri)
                out[f"{f.name}_version"] = value.version
            else:
                out[f.name] = _encode(value, f.name in self.PATHS)
        return out

    @classmethod
    def from_metadata(cls, values: Mapping[str, Any]) -> Self:
        """The record from metadata values (``{key: MetadataValue.value}``).

        Raises:
            KeyError: a field without a default is missing (a materialization written by an
                older version of the stage).
        """
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if hint is TableRef:
                kwargs[f.name] = TableRef(
                    str(values[f"{f.name}_uri"]), int(values[f"{f.name}_version"])
                )
                continue
            if f.name not in values:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise KeyError(f.name)
                continue
            value = values[f.name]
            if f.name == "inputs":
                value = {k: TableRef(str(v["uri"]), int(v["version"])) for k, v in value.items()}
            elif f.name in cls.PATHS and value is not None:
                value = str(value)
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class ChainRecord(StageRecord):
    """A stage that writes one Delta table, computed from pinned upstream table versions."""

    table: TableRef
    seconds: float
    inputs: dict[str, TableRef] = field(default_factory=dict)
    # The stage's run config as it ran, every knob (defaults included), and the code that ran
    # it (storage/provenance.py code_identity): what repeats it. Empty in a materialization
    # recorded before they were (2026-12).
    config: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] = field(default_factory=dict)

    def lineage(self) -> dict[str, TableRef]:
        """``inputs`` plus this stage's own table: what a downstream stage records as its
        inputs."""
        return {**self.inputs, self.ASSET: self.table}


@dataclass(frozen=True, kw_only=True)
class RawInstructionsRecord(ChainRecord):
    """What ``raw_instructions`` records: the source's fingerprint, what was read and kept, the
    split sizes and the benchmarks."""

    ASSET: ClassVar[str] = RAW_INSTRUCTIONS
    source_fingerprint: str
    records_read: int
    duplicates_dropped: int
    train_samples: int
    train_available: int
    heldout_samples: int
    forms: dict[str, int]
    benchmarks: list[str]
    mean_response_chars: float
    records_per_file: dict[str, int] = field(default_factory=dict)
    # What the reader did not keep (data/forms/chat.py): turns by reason, and non-null
    # fields no form reads by name (occurrences), over every record read.
    dropped_turns: dict[str, int] = field(default_factory=dict)
    dropped_fields: dict[str, int] = field(default_factory=dict)
    # Rows whose `tools` column holds function schemas.
    samples_with_tools: int = 0
    # Files of the dataset folder in no read format (a .csv, .txt beside the data), by path.
    files_not_read: list[str] = field(default_factory=list)
    # Every file read (path relative to the dataset's folder) -> its SHA-256; empty for the
    # built-in python_stdlib, named by ``source`` instead.
    source_files: dict[str, str] = field(default_factory=dict)
    # What the source is, where no file names it (the built-in dataset: the interpreter).
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class SelectionRecord(ChainRecord):
    """A stage of the selection chain; ``selection_seconds`` is the cost of selection so far
    (the embedding pass, model load excluded, plus every later selection stage)."""

    selection_seconds: float


@dataclass(frozen=True, kw_only=True)
class ProxyEmbeddingsRecord(SelectionRecord):
    """What ``proxy_embeddings`` records: embedded and skipped samples, the cache, the pass's
    throughput and the base model."""

    ASSET: ClassVar[str] = PROXY_EMBEDDINGS
    PATHS: ClassVar[tuple[str, ...]] = ("base_model",)
    embedded: int
    skipped: dict[str, int]
    # Embedded samples that truncation cut, by kind ("prompt_start", "response_end", both).
    truncated: dict[str, int] = field(default_factory=dict)
    hidden_size: int
    cache_key: str
    # Samples this run embedded, and those read from the per-sample cache.
    samples_embedded_now: int
    samples_reused: int
    # Of this run's pass (0 when every sample was cached).
    embedding_seconds: float
    tokens_per_second: float
    world_size: int
    mean_loss: float
    base_model: str
    # The pass's EmbedSettings: the selectors' own passes (rds's targets, ifd's unconditioned
    # losses) run under the same ones.
    embed_settings: dict[str, Any] = field(default_factory=dict)
    # The base model in terms that travel: hub id and revision, or the built-in model's source
    # package and file hash, or a local folder's weight hashes (models/loading.py
    # model_identity); ``base_model`` is the path this machine loaded.
    base_model_identity: dict[str, Any] = field(default_factory=dict)
    # The base model setting as given (BaseModelResource.model): what a run config repeats.
    base_model_setting: str = ""
    # The largest rank's peak resident / CUDA memory (MiB) over the passes that filled the
    # cache (None for a cache from before 2026-12-02).
    peak_rss_mib: float | None = None
    peak_cuda_mib: float | None = None
    # The pass run now: whether its batches were packed (None: every sample was cached), and
    # the packing gate's refusal where it refused (data/packing.pack_check).
    packed: bool | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class BalancedClustersRecord(SelectionRecord):
    """What ``balanced_clusters`` records: the capacity step, the sizes and weights, the k-means
    search and the quarantined samples."""

    ASSET: ClassVar[str] = BALANCED_CLUSTERS
    centroids: TableRef
    num_clusters: int
    representation: str = "gradient_proxy"
    alpha: float = 1.0
    cap: int
    cluster_sizes: list[int]
    kmeans_cluster_sizes: list[int]
    kmeans_cost: float
    capacity_cost: float
    capacity_cost_increase_pct: float
    # How far above the optimum capacity_cost can be at most (LP dual bound;
    # selection/clustering.py), and how many samples the exact flow assigned.
    capacity_optimality_gap: float = 0.0
    capacity_boundary_samples: int = 0
    # w_c = K n_c / N of the sizes after the capacity step: the loss weights of a re-weighted
    # selector's ranks (docs/design.md, step 5).
    cluster_weights: list[float] = field(default_factory=list)
    # The k-means search: rows it ran on, runs, iteration limit, best and every run's inertia,
    # iterations each run took.
    kmeans_sample_size: int = 0
    kmeans_restarts: int = 1
    kmeans_niter: int = 25
    kmeans_inertia: float = float("nan")
    kmeans_restart_inertias: list[float] = field(default_factory=list)
    kmeans_restart_iterations: list[int] = field(default_factory=list)
    quarantined_count: int
    quarantined_non_finite: list[str]


@dataclass(frozen=True, kw_only=True)
class PeripheralSubsetsRecord(SelectionRecord):
    """What ``peripheral_subsets`` records: the selector, budget, weights and the subset's
    diversity."""

    ASSET: ClassVar[str] = PERIPHERAL_SUBSETS
    selector: str
    ratio: float
    seed: int
    per_cluster: int
    pool_size: int
    selected_samples: int
    data_fraction: float
    cluster_weights: list[float]
    # samples or tokens (selection/selectors/base.py); the token budget per cluster under token
    # balance; what each cluster kept (copies counted).
    balance: str = "samples"
    token_budget: int | None = None
    samples_per_cluster: list[int] = field(default_factory=list)
    tokens_per_cluster: list[int] = field(default_factory=list)
    # Where the selection gives less than its knobs ask (SelectionResult.notes; the step's
    # warnings), kept with the selection: ifd's budget unfilled, cluster_ifd's fills.
    selection_notes: list[str] = field(default_factory=list)
    # Of the subset as trained (copies counted), from its proxy embeddings; see
    # evaluation/statistics.gradient_diversity. The pool's, for scale.
    gradient_diversity: float = float("nan")
    pool_gradient_diversity: float = float("nan")
    # The selector's cost record (selection/selectors/base.py, SelectionCost): its own seconds,
    # the per-sample forward and backward passes of the model passes its inputs needed, and
    # those passes (name, samples, tokens, seconds at the measured rate, backward, run_now).
    selector_seconds: float = 0.0
    forward_passes: int = 0
    backward_passes: int = 0
    selection_passes: list[dict[str, Any]] = field(default_factory=list)
    # The largest rank's peak resident / CUDA memory (MiB) over those passes (None: unrecorded).
    selection_peak_rss_mib: float | None = None
    selection_peak_cuda_mib: float | None = None
    # What the selectors' own passes leave in the record (each selector's spec declares its
    # keys, e.g. a targeted selector's ``selection_target``): every selector's keys, those of
    # the others at their defaults, each a metadata entry of its own.
    details: dict[str, Any] = field(default_factory=record_details)

    def to_metadata(self) -> dict[str, Any]:
        """The record's entries, each of :attr:`details` as an entry of its own."""
        out = super().to_metadata()
        del out["details"]
        return {**out, **{k: _encode(v, False) for k, v in self.details.items()}}

    @classmethod
    def from_metadata(cls, values: Mapping[str, Any]) -> Self:
        """The record from metadata values, :attr:`details` from the registry's keys."""
        record = super().from_metadata(values)
        details = {k: values.get(k, v) for k, v in record_details().items()}
        return dataclasses.replace(record, details=details)


@dataclass(frozen=True, kw_only=True)
class ShardManifestsRecord(SelectionRecord):
    """What ``shard_manifests`` records: the manifests (paths, hashes), their samples, tokens and
    weights per rank."""

    ASSET: ClassVar[str] = SHARD_MANIFESTS
    world_size: int
    shard_size: int
    dropped_for_equal_shards: int
    selector: str
    manifest_paths: list[str]
    manifest_sha256: list[str]
    manifest_set_sha256: str
    rank_weights: list[float]
    balance: str = "samples"
    samples_per_rank: list[int] = field(default_factory=list)
    # Tokens per rank as the embedding pass counted them, and (max - min) / max.
    tokens_per_rank: list[int] = field(default_factory=list)
    token_spread: float = 0.0


@dataclass(frozen=True, kw_only=True)
class TrainedCheckpointRecord(StageRecord):
    """What ``trained_checkpoint`` records: the checkpoint, what it was trained on, and the cost
    and shape of its training."""

    ASSET: ClassVar[str] = TRAINED_CHECKPOINT
    PATHS: ClassVar[tuple[str, ...]] = ("checkpoint_path", "base_model")
    checkpoint_path: str
    inputs: dict[str, TableRef]
    base_model: str
    world_size: int
    manifest_sha256: list[str]
    manifest_set_sha256: str
    reused_checkpoint: bool
    git_commit: str
    resumed_from_step: int | None
    steps: int
    final_loss: float
    seconds: float
    train_seconds: float
    samples_per_rank: int
    # The loss multiplier each rank applied (w_c, or 1 with reweight: false), in rank order.
    rank_weights: list[float] = field(default_factory=list)
    # Whether batches were packed, and Σ real tokens / Σ (world size x busiest rank's padded
    # tokens) over the run's steps (training/plan.py); seconds each rank waited for the others.
    packed: bool = False
    useful_compute_fraction: float | None = None
    wait_seconds_per_rank: list[float] = field(default_factory=list)
    selection_seconds: float
    config: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class EvalReportRecord(StageRecord):
    """What ``eval_report`` records: the report, the current run's verdicts, costs and both
    models' metrics."""

    ASSET: ClassVar[str] = EVAL_REPORT
    item_scores: TableRef
    PATHS: ClassVar[tuple[str, ...]] = ("report_path", "checkpoint_path")
    report_path: str
    checkpoint_path: str
    models_compared: int
    train_seconds: float
    full_training_seconds: float
    full_training_measured: bool
    data_fraction: float
    # The current run against its references: reference, metric, difference, low, high, p_value,
    # verdict.
    verdicts: list[dict[str, Any]]
    # Held-out samples skipped (by reason) and truncated (by kind) under the sequence settings.
    heldout_sequences: dict[str, dict[str, int]] = field(default_factory=dict)
    base: dict[str, float]
    tuned: dict[str, float]
    # The stage's run config as it ran (empty: recorded before it was).
    config: dict[str, Any] = field(default_factory=dict)

    def to_metadata(self) -> dict[str, Any]:
        """The record's entries, plus each metric as its own numeric entry (``base/heldout_loss``),
        which the UI plots across materializations."""
        # Each metric also as its own numeric entry (``base/heldout_loss``), which the UI plots
        # across materializations.
        flat = {
            f"{label}/{name}": value
            for label, metrics in (("base", self.base), ("tuned", self.tuned))
            for name, value in metrics.items()
        }
        return {**super().to_metadata(), **flat}


@dataclass(frozen=True, kw_only=True)
class SampleLineageRecord(ChainRecord):
    """What ``sample_lineage`` records: how many samples were selected and trained on."""

    ASSET: ClassVar[str] = SAMPLE_LINEAGE
    selected_samples: int
    samples_in_a_checkpoint: int


R = typing.TypeVar("R", bound=StageRecord)
C = typing.TypeVar("C", bound=ChainRecord)


def _materializations(
    instance: dg.DagsterInstance, asset: str, partition: str, limit: int
) -> list[dg.AssetMaterialization]:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]),
        limit=limit,
    ).records
    return [r.asset_materialization for r in records if r.asset_materialization is not None]


def _values(materialization: dg.AssetMaterialization) -> dict[str, Any]:
    return {k: v.value for k, v in materialization.metadata.items()}


def _parse(cls: type[R], materialization: dg.AssetMaterialization, partition: str) -> R:
    try:
        return cls.from_metadata(_values(materialization))
    except (KeyError, TypeError, ValueError) as e:
        raise UpstreamNotMaterialized(
            description=f"the latest {cls.ASSET} materialization of partition {partition!r} "
            f"lacks {e} (written by an older version of the pipeline); materialize {cls.ASSET} "
            "again."
        ) from e


def latest_record(instance: dg.DagsterInstance, cls: type[R], partition: str) -> R | None:
    """The record of the latest materialization of ``cls.ASSET`` for ``partition``, or None."""
    found = _materializations(instance, cls.ASSET, partition, limit=1)
    return _parse(cls, found[0], partition) if found else None


def _data_root(context: dg.AssetExecutionContext) -> Path:
    """The data folder the step works in (its storage resource's, else the default one)."""
    storage = getattr(context.resources, "storage", None)
    layout = getattr(storage, "layout", None)
    return layout.root if isinstance(layout, DataLayout) else DataLayout.at(default_data_dir()).root


def check_tables_exist(record: StageRecord, partition: str, data_root: Path) -> None:
    """Every table ``record`` names (its own and its inputs) is still where it was written.

    A record names its tables by absolute path under the data folder of the run that wrote
    it; when ``$CLUSTER_PIPELINE_DATA_DIR`` (the data folder) has moved since, they are not
    there, and reading one would end in deltalake's ``TableNotFoundError`` (issue 43).

    Raises:
        UpstreamNotMaterialized: a table is gone; names it, the data folder it was written
            under and this run's, and what to do (point ``$CLUSTER_PIPELINE_DATA_DIR`` back, or
            materialize again here).
    """
    tables = [getattr(record, "table", None), *getattr(record, "inputs", {}).values()]
    for ref in tables:
        if not isinstance(ref, TableRef) or (Path(ref.uri) / "_delta_log").is_dir():
            continue
        written_under = Path(ref.uri).parents[2]  # <data>/tables/<asset>/<dataset>
        where = (
            f"the latest {record.ASSET} materialization of partition {partition!r} names the "
            f"table {ref.uri} (version {ref.version}), which does not exist"
        )
        if written_under != data_root:
            env = os.environ.get(DATA_DIR_ENV)
            now = f"${DATA_DIR_ENV} = {env}" if env else f"${DATA_DIR_ENV} is not set"
            raise UpstreamNotMaterialized(
                description=f"{where}: it was written under the data folder {written_under}, "
                f"and this run's data folder is {data_root} ({now}). If the data folder moved, "
                f"run with {DATA_DIR_ENV}={shlex.quote(str(written_under))} (where `make dev` "
                "or dagster runs), or move it back; to start over in "
                f"{data_root}, materialize {record.ASSET} and the stages before it again."
            )
        raise UpstreamNotMaterialized(
            description=f"{where} (deleted from the data folder {data_root}?); materialize "
            f"{record.ASSET} and the stages before it again."
        )


def read_record(context: dg.AssetExecutionContext, cls: type[R]) -> R:
    """The latest record of ``cls.ASSET`` for this run's partition, whose tables exist
    (:func:`check_tables_exist`).

    Raises:
        UpstreamNotMaterialized: never materialized for the partition, by an older version, or
            its tables are gone (a moved data folder).
    """
    record = latest_record(context.instance, cls, context.partition_key)
    if record is None:
        raise UpstreamNotMaterialized(
            description=f"{cls.ASSET} has no materialization for partition "
            f"{context.partition_key!r}; materialize {cls.ASSET} first (or the whole chain)."
        )
    check_tables_exist(record, context.partition_key, _data_root(context))
    return record


def pinned_record(
    context: dg.AssetExecutionContext, cls: type[C], table: TableRef, search: int = 1000
) -> C:
    """The record of the ``cls.ASSET`` materialization that wrote ``table`` (one version).

    Raises:
        UpstreamNotMaterialized: no materialization among the latest ``search`` wrote it, or its
            tables are gone (:func:`check_tables_exist`).
    """
    record = record_that_wrote(context.instance, cls, context.partition_key, table, search)
    check_tables_exist(record, context.partition_key, _data_root(context))
    return record


def record_that_wrote(
    instance: dg.DagsterInstance, cls: type[C], partition: str, table: TableRef, search: int = 1000
) -> C:
    """:func:`pinned_record` outside a run (the CLI): the record of the ``cls.ASSET``
    materialization of ``partition`` that wrote ``table``.

    Raises:
        UpstreamNotMaterialized: no materialization among the latest ``search`` wrote it.
    """
    for m in _materializations(instance, cls.ASSET, partition, search):
        values = _values(m)
        if (
            str(values.get("table_uri")) == table.uri
            and values.get("table_version") == table.version
        ):
            return _parse(cls, m, partition)
    raise UpstreamNotMaterialized(
        description=f"no {cls.ASSET} materialization of partition {partition!r} "
        f"wrote {table.uri}@v{table.version}; materialize the chain from {cls.ASSET} again."
    )


def chain_run_config(
    records: Mapping[str, StageRecord | None], base_model: str | None = None
) -> dict[str, Any]:
    """The Dagster run config that repeats the stages of ``records`` (stage -> its record, in
    pipeline order; None or a record without a config is left out): ``ops: <stage>: config:``
    each stage's config as it ran (:func:`~cluster_pipeline.defs.configs.repeatable_config`),
    and, given ``base_model`` (the model setting), ``resources:
    base_model: config: model:``. What ``cluster-pipeline rerun`` takes."""
    from cluster_pipeline.defs.configs import repeatable_config

    ops = {}
    for stage, record in records.items():
        config = getattr(record, "config", None)
        if config:
            ops[stage] = {"config": repeatable_config(stage, config)}
    out: dict[str, Any] = {"ops": ops}
    if base_model:
        out["resources"] = {"base_model": {"config": {"model": base_model}}}
    return out


# --- Building the records from a stage's results ---------------------------------------------


def clusters_record(
    config: Any,
    streamed: StreamedClusters,
    embeddings: ProxyEmbeddingsRecord,
    table: TableRef,
    centroids: TableRef,
    seconds: float,
) -> BalancedClustersRecord:
    """The record of a clustering (``config``: the stage's config) that took ``seconds``,
    written as ``table`` and ``centroids``."""
    result, fit = streamed.result, streamed.result.kmeans_fit
    return BalancedClustersRecord(
        table=table,
        centroids=centroids,
        inputs=embeddings.lineage(),
        config=config.model_dump(mode="json"),
        code=code_identity(),
        seconds=round(seconds, 3),
        selection_seconds=round(embeddings.selection_seconds + seconds, 2),
        num_clusters=config.num_clusters,
        representation=config.representation,
        alpha=config.alpha,
        cap=result.cap,
        cluster_sizes=result.sizes.tolist(),
        kmeans_cluster_sizes=result.kmeans_sizes.tolist(),
        kmeans_cost=round(result.kmeans_cost, 4),
        capacity_cost=round(result.cost, 4),
        capacity_cost_increase_pct=round(100 * result.cost_increase, 3),
        capacity_optimality_gap=float(f"{result.optimality_gap:.3g}"),
        capacity_boundary_samples=result.boundary_samples,
        cluster_weights=[round(float(w), 6) for w in cluster_weights(result.sizes)],
        kmeans_sample_size=fit.sample_size,
        kmeans_restarts=fit.restarts,
        kmeans_niter=fit.niter,
        kmeans_inertia=round(fit.inertia, 6),
        kmeans_restart_inertias=[round(v, 6) for v in fit.restart_inertias],
        kmeans_restart_iterations=list(fit.restart_iterations),
        quarantined_count=streamed.quarantined.len(),
        quarantined_non_finite=streamed.quarantined.to_list()[:100],
    )


@dataclass(frozen=True)
class SelectionOutcome:
    """What a selection produced beyond its result: the selector's record details, the tables
    its passes wrote and the wall seconds they took in this run, its own table, the stage's
    seconds, its per-cluster summary (``per_cluster_summary``) and the subset's and the pool's
    gradient diversity."""

    details: Mapping[str, Any]
    pass_tables: Mapping[str, TableRef]
    pass_wall_seconds: float
    table: TableRef
    seconds: float
    summary: pl.DataFrame
    diversity: tuple[float, float]


def selection_record(
    config: Any,
    result: SelectionResult,
    clusters: BalancedClustersRecord,
    outcome: SelectionOutcome,
) -> PeripheralSubsetsRecord:
    """The record of a selection (``config``: the stage's config) of ``clusters``."""
    cost = result.cost
    assert cost is not None  # run_selector records it
    seconds = outcome.seconds
    return PeripheralSubsetsRecord(
        table=outcome.table,
        inputs={**clusters.lineage(), **outcome.pass_tables},
        config=config.model_dump(mode="json"),
        code=code_identity(),
        seconds=round(seconds, 3),
        # A selector's own passes count at their measured rate, cached or run now.
        selection_seconds=round(
            clusters.selection_seconds
            + seconds
            - outcome.pass_wall_seconds
            + sum(p.seconds for p in cost.passes if p.name != PASS_EMBEDDING),
            2,
        ),
        selector=config.selector,
        ratio=config.ratio,
        seed=config.seed,
        per_cluster=result.per_cluster,
        pool_size=len(result.selected),
        selected_samples=result.n_selected,
        data_fraction=round(result.data_fraction, 4),
        cluster_weights=[round(float(w), 6) for w in result.cluster_weights],
        balance=config.balance,
        token_budget=result.token_budget,
        samples_per_cluster=outcome.summary["kept"].to_list(),
        tokens_per_cluster=outcome.summary["kept_tokens"].to_list(),
        selection_notes=list(result.notes),
        gradient_diversity=round(outcome.diversity[0], 6),
        pool_gradient_diversity=round(outcome.diversity[1], 6),
        selector_seconds=round(cost.seconds, 4),
        forward_passes=cost.forward_passes,
        backward_passes=cost.backward_passes,
        selection_passes=[p.to_dict() for p in cost.passes],
        selection_peak_rss_mib=round_mib(cost.peak_rss_mib),
        selection_peak_cuda_mib=round_mib(cost.peak_cuda_mib),
        details={**record_details(), **outcome.details},  # every selector's keys
    )


def training_params(
    settings: Any,
    shards: ShardManifestsRecord,
    subsets: PeripheralSubsetsRecord,
    clusters: BalancedClustersRecord,
) -> dict[str, Any]:
    """The MLflow params of a training run: every training setting (``settings``, the
    ``TrainSettings``), then how its data was selected (selector, r, K, alpha, balance, the
    rank weights w_c, the selection seed)."""
    selection = {
        "selector": subsets.selector,
        "ratio": subsets.ratio,
        "K": shards.world_size,
        "alpha": clusters.alpha,
        "balance": subsets.balance,
        "rank_weights": [round(w, 6) for w in shards.rank_weights],
        "selection_seed": subsets.seed,
        "representation": clusters.representation,
        "manifest_set_sha256": shards.manifest_set_sha256,
    }
    return {**settings.model_dump(), **selection}


def selector_knobs(selector: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The values in a ``peripheral_subsets`` ``config`` of ``selector``'s own knobs
    (:func:`~cluster_pipeline.selection.selectors.own_knobs` but the knobs every selector has,
    which provenance records apart, and the target set, which the report names apart); {} for
    a selector without knobs."""
    own = own_knobs(selector) - set(SelectionKnobs.model_fields) - {"target"}
    return {k: config[k] for k in sorted(own) if k in config}


def training_provenance(
    run_id: str,
    dataset: str,
    shards: ShardManifestsRecord,
    subsets: PeripheralSubsetsRecord,
    clusters: BalancedClustersRecord,
    training_seed: int,
) -> dict[str, Any]:
    """What ``training_info.json`` records of how the shards were made (the report groups
    checkpoints by it), for the Dagster run ``run_id`` of ``dataset``."""
    target = subsets.details.get("selection_target")
    return {
        "dagster_run_id": run_id,
        "dataset": dataset,
        "manifest_set_sha256": shards.manifest_set_sha256,
        "selector": subsets.selector,
        "ratio": subsets.ratio,
        "alpha": clusters.alpha,
        "representation": clusters.representation,
        "balance": subsets.balance,
        "selection_seed": subsets.seed,
        "data_fraction": subsets.data_fraction,
        "pool_size": subsets.pool_size,
        "gradient_diversity": subsets.gradient_diversity,
        "selection_seconds": shards.selection_seconds,
        # What the selection cost in model passes (the report's cost table names them).
        "selection_passes": subsets.selection_passes,
        "selection_forward_passes": subsets.forward_passes,
        "selection_backward_passes": subsets.backward_passes,
        "selection_peak_rss_mib": subsets.selection_peak_rss_mib,
        "selection_peak_cuda_mib": subsets.selection_peak_cuda_mib,
        # A targeted selector's target set (rds, less), which the report names in the group.
        **({"selection_target": target} if target else {}),
        # The selector's own knobs (ifd_end_of_turn, s2l_sources, ...): runs of one selector
        # under other knobs are other setups, which the report keeps apart.
        "selector_knobs": selector_knobs(subsets.selector, subsets.config),
        "training_seed": training_seed,
        **{f"{asset}_version": ref.version for asset, ref in shards.lineage().items()},
    }


def checkpoint_record(
    shards: ShardManifestsRecord,
    ckpt: Checkpoint,
    history: list[dict[str, Any]],
    model_path: str,
    reused: bool,
    seconds: float,
) -> TrainedCheckpointRecord:
    """The record of a checkpoint trained (or ``reused``) on ``shards``, from its
    ``training_info.json`` and metrics ``history``, in ``seconds``."""
    info = ckpt.info
    fraction = info.get("useful_compute_fraction")
    return TrainedCheckpointRecord(
        checkpoint_path=str(ckpt.path),
        inputs=shards.lineage(),
        base_model=model_path,
        world_size=shards.world_size,
        manifest_sha256=ckpt.manifest_sha256,
        manifest_set_sha256=shards.manifest_set_sha256,
        reused_checkpoint=reused,
        git_commit=str(info.get("git_commit")),
        resumed_from_step=info.get("resumed_from_step"),
        steps=int(info.get("steps", len(history))),
        final_loss=round(float(info.get("final_loss", float("nan"))), 4),
        seconds=round(seconds, 2),
        train_seconds=round(float(ckpt.train_seconds or 0.0), 2),
        samples_per_rank=shards.shard_size,
        rank_weights=[round(float(w), 6) for w in info.get("rank_weights", [])],
        packed=bool(info.get("packed", False)),
        useful_compute_fraction=None if fraction is None else round(float(fraction), 4),
        wait_seconds_per_rank=[round(s, 2) for s in info.get("wait_seconds_per_rank", [])],
        selection_seconds=shards.selection_seconds,
        config=ckpt.settings,
    )


def eval_record(
    report: Any,
    results: list[Any],
    scores: TableRef,
    path: Path,
    checkpoint: str,
    heldout_stats: dict[str, Any],
    config: dict[str, Any] | None = None,
) -> EvalReportRecord:
    """The record of an evaluation: the current run's verdicts, cost figures and both models'
    metrics (``report``: the rendered :class:`~cluster_pipeline.evaluation.report.Report`;
    ``results``: each model's result, the base model first; ``scores``: the item scores' table;
    ``path``: the report's file; ``checkpoint``: the current checkpoint's folder; ``config``:
    the stage's run config)."""
    current = next(r for r in results if r.current)
    kept = ("reference", "metric", "difference", "low", "high", "p_value", "verdict")
    return EvalReportRecord(
        item_scores=scores,
        verdicts=[
            {k: v for k, v in c.to_dict().items() if k in kept}
            for c in report.comparisons
            if c.candidate == current.group
        ],
        report_path=str(path),
        checkpoint_path=checkpoint,
        models_compared=len(results),
        train_seconds=round(report.train_seconds, 2),
        full_training_seconds=round(report.full_training_seconds, 2),
        full_training_measured=report.full_training_measured,
        data_fraction=report.data_fraction,
        heldout_sequences=heldout_stats["sequences"],
        base={m: round(float(v), 5) for m, v in results[0].metrics.items()},
        tuned={m: round(float(v), 5) for m, v in current.metrics.items()},
        config=config or {},
    )
