"""What each stage records about a materialization, as one typed dataclass per stage.

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
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import dagster as dg

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
from cluster_pipeline.storage.tables import TableRef


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
    # What the reader did not keep (data/formats.py, chat rules): turns by reason, and non-null
    # fields no form reads by name (occurrences), over every record read.
    dropped_turns: dict[str, int] = field(default_factory=dict)
    dropped_fields: dict[str, int] = field(default_factory=dict)
    # Rows whose `tools` column holds function schemas.
    samples_with_tools: int = 0
    # Files of the dataset folder in no read format (a .csv, .txt beside the data), by path.
    files_not_read: list[str] = field(default_factory=list)


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
    # The largest rank's peak resident / CUDA memory (MiB) over the passes that filled the
    # cache (None for a cache from before 2026-12-02).
    peak_rss_mib: float | None = None
    peak_cuda_mib: float | None = None


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
    # A targeted selector's (rds, less) target set: its name or folder, and its samples used.
    selection_target: str | None = None
    selection_target_samples: int = 0
    # s2l's proxy: its checkpoints whose losses are the trajectories, and their steps; for less
    # the warm-up's checkpoints whose gradients are scored, and their steps.
    s2l_proxy_checkpoints: list[str] = field(default_factory=list)
    s2l_checkpoint_steps: list[int] = field(default_factory=list)
    # less: each warm-up checkpoint's mean learning rate eta_i (before renormalisation).
    less_learning_rates: list[float] = field(default_factory=list)


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


def read_record(context: dg.AssetExecutionContext, cls: type[R]) -> R:
    """The latest record of ``cls.ASSET`` for this run's partition.

    Raises:
        UpstreamNotMaterialized: never materialized for the partition, or by an older version.
    """
    record = latest_record(context.instance, cls, context.partition_key)
    if record is None:
        raise UpstreamNotMaterialized(
            description=f"{cls.ASSET} has no materialization for partition "
            f"{context.partition_key!r}; materialize {cls.ASSET} first (or the whole chain)."
        )
    return record


def pinned_record(
    context: dg.AssetExecutionContext, cls: type[C], table: TableRef, search: int = 1000
) -> C:
    """The record of the ``cls.ASSET`` materialization that wrote ``table`` (one version).

    Raises:
        UpstreamNotMaterialized: no materialization among the latest ``search`` wrote it.
    """
    return record_that_wrote(context.instance, cls, context.partition_key, table, search)


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
