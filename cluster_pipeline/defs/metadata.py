"""What a stage shows beyond its record: display-only metadata of its table (row count, column
schema and a preview), the results of its asset checks, its plots and the few lines of its run
log, and what it logs into its MLflow run (the tracking resource's :class:`Tracker`).

What downstream stages read back lives in :mod:`cluster_pipeline.defs.records`.
"""

import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import polars as pl
import yaml

from cluster_pipeline.data.datasets import read_instructions
from cluster_pipeline.defs.configs import (
    RUN_CONFIG_ARTIFACT,
    STAGE_CONFIGS,
    repeatable_config,
    tracked_knobs,
)
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    ChainRecord,
    EvalReportRecord,
    PeripheralSubsetsRecord,
    ProxyEmbeddingsRecord,
    RawInstructionsRecord,
    ShardManifestsRecord,
    StageRecord,
    TrainedCheckpointRecord,
    chain_run_config,
    pinned_record,
)
from cluster_pipeline.defs.resources import run_tags
from cluster_pipeline.defs.stages import STAGES
from cluster_pipeline.evaluation import plots
from cluster_pipeline.evaluation.report import Report
from cluster_pipeline.models.loading import describe_model
from cluster_pipeline.selection.embedding_table import REPRESENTATIONS, l2_normalise
from cluster_pipeline.selection.selectors import CLUSTER_SELECTORS
from cluster_pipeline.storage.columns import describe
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    EVAL_REPORT,
    PERIPHERAL_SUBSETS,
    PROXY_EMBEDDINGS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
    TRAINED_CHECKPOINT,
)
from cluster_pipeline.storage.provenance import code_identity, rows_sha256
from cluster_pipeline.storage.tables import TableRef, markdown_preview, markdown_table
from cluster_pipeline.tracking.tracker import (
    DIGEST_CHARS,
    TAG_CHECKPOINT,
    TAG_DAGSTER_RUN,
    TAG_GIT_COMMIT,
    TAG_PARTITION,
    TAG_SELECTOR,
    TAG_SOURCE_NAME,
    TAG_SOURCE_TYPE,
    Tracker,
    step_metrics,
)
from cluster_pipeline.training.checkpointing import Checkpoint
from cluster_pipeline.training.memory import GIB, MemoryEstimate

_DAGSTER_TYPES = {
    pl.String: "string",
    pl.Int64: "int64",
    pl.Int32: "int32",
    pl.Float32: "float32",
    pl.Float64: "float64",
    pl.Boolean: "bool",
}


def error_checks(checks: dict[str, tuple[bool, str]]) -> list[dg.AssetCheckResult]:
    """One ERROR-severity check result per ``name: (passed, description)`` of ``checks``."""
    return [
        dg.AssetCheckResult(
            check_name=name,
            passed=passed,
            description=text,
            severity=dg.AssetCheckSeverity.ERROR,
        )
        for name, (passed, text) in checks.items()
    ]


def memory_display(
    estimate: MemoryEstimate,
    measured: list[int] | None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """A stage's memory per rank, estimated before launch and measured (issue 44): the entries
    ``memory_per_rank`` (one line: the estimate with its parts, each rank's measured peak and
    measured / estimated) and the numbers ``estimated_memory_per_rank_gib`` and
    ``measured_memory_per_rank_gib`` (a list, rank order; absent when not measured, as for a
    stage that ran nothing now).

    Args:
        estimate: training/memory.py's estimate for the stage's settings.
        measured: each rank's peak resident memory (bytes; ``VmHWM``), or None.
        log: where the line also goes (``context.log.info``), or None.
    """
    out: dict[str, Any] = {"estimated_memory_per_rank_gib": round(estimate.total / GIB, 2)}
    measured_text = ""
    if measured:
        gib = [round(b / GIB, 2) for b in measured]
        measured_text = (
            f"measured peak {gib} GiB ({max(measured) / estimate.total:.2f} of the estimate)"
        )
        out["measured_memory_per_rank_gib"] = gib
    if log is not None:  # two lines, each short enough to read whole
        now = measured_text or "not measured now"
        log(f"memory per rank: estimated {estimate.total / GIB:.2f} GiB, {now}")
        log(f"memory estimate per rank: {estimate.text()}")
    line = f"estimated {estimate.text()}" + (f"; {measured_text}" if measured_text else "")
    return {"memory_per_rank": line, **out}


def table_display(
    frame: pl.DataFrame, table: str, preview_columns: list[str] | None = None
) -> dict:
    """``dagster/row_count``, ``dagster/column_schema`` (each column's type and its description
    from :mod:`cluster_pipeline.storage.columns`) and a Markdown ``preview`` of ``frame`` (first
    rows, ``preview_columns`` only if given).

    Args:
        frame: the table as written (or the rows shown of it).
        table: the table's name (:mod:`cluster_pipeline.storage.names`).
        preview_columns: the preview's columns; None = all.

    Raises:
        KeyError: a column of ``frame`` has no description (:func:`~cluster_pipeline.storage.
            columns.describe`).
    """
    descriptions = describe(table, frame.columns)
    schema = dg.TableSchema(
        columns=[
            dg.TableColumn(
                name, _DAGSTER_TYPES.get(dtype, str(dtype)), description=descriptions[name]
            )
            for name, dtype in frame.schema.items()
        ]
    )
    preview = frame.select(preview_columns) if preview_columns else frame
    return {
        "dagster/row_count": frame.height,
        "dagster/column_schema": schema,
        "preview": dg.MetadataValue.md(markdown_preview(preview)),
    }


# --- proxy_embeddings ---------------------------------------------------------------------------


def log_skipped(log, frame: pl.DataFrame, instructions: RawInstructionsRecord, truncation: str):
    """Where the first skipped samples of an embedding pass's table ``frame`` come from (source
    file and line), into ``log`` (the run log's ``info``)."""
    skipped = frame.filter(pl.col("skip_reason").is_not_null())
    if not skipped.height:
        return
    sources = read_instructions(
        instructions.table.uri,
        instructions.table.version,
        ["sample_id", "source_file", "source_line"],
    )
    for row in skipped.head(5).join(sources, on="sample_id").iter_rows(named=True):
        log(
            f"skipped {row['sample_id']} ({row['skip_reason']}, truncation={truncation}): "
            f"{row['source_file']}:{row['source_line']}"
        )


# --- every tracked stage: the pipeline run, provenance, datasets ---------------------------------

# The chain's records by stage, for reading the upstream ones a run depends on.
_CHAIN_RECORDS: dict[str, type[ChainRecord]] = {
    RAW_INSTRUCTIONS: RawInstructionsRecord,
    PROXY_EMBEDDINGS: ProxyEmbeddingsRecord,
    BALANCED_CLUSTERS: BalancedClustersRecord,
    PERIPHERAL_SUBSETS: PeripheralSubsetsRecord,
    SHARD_MANIFESTS: ShardManifestsRecord,
}


def source_tags(asset: str) -> dict[str, Any]:
    """The tags MLflow's UI shows as a run's source: ``mlflow.source.name`` (the asset),
    ``mlflow.source.type`` (``JOB``) and ``mlflow.source.git.commit``, with ``git_dirty`` and
    ``cluster_pipeline_version`` beside them (:func:`~cluster_pipeline.storage.provenance.
    code_identity`; None values are left out)."""
    code = code_identity()
    return {
        TAG_SOURCE_NAME: f"cluster_pipeline {asset}",
        TAG_SOURCE_TYPE: "JOB",
        TAG_GIT_COMMIT: code["git_commit"],
        "git_dirty": code["git_dirty"],
        "cluster_pipeline_version": code["version"],
    }


def open_pipeline_run(tracker: Tracker, context: dg.AssetExecutionContext) -> str | None:
    """The parent MLflow run of this Dagster run (one per pipeline run; the stages' runs are
    its children), found by the Dagster run id or opened now, and marked RUNNING. None when
    tracking is off."""
    run = context.run
    return tracker.pipeline_run(
        f"{context.partition_key} {run.job_name} {run.run_id[:8]}",
        {TAG_DAGSTER_RUN: run.run_id},
        {TAG_PARTITION: context.partition_key, "dagster_job": run.job_name, **source_tags("run")},
    )


def upstream_records(
    context: dg.AssetExecutionContext, lineage: Mapping[str, TableRef]
) -> dict[str, ChainRecord]:
    """The records of the chain stages that wrote ``lineage``'s table versions, in pipeline
    order; a stage whose record cannot be found is left out (tracking never fails a step)."""
    out: dict[str, ChainRecord] = {}
    for stage, cls in _CHAIN_RECORDS.items():
        if stage in lineage:
            try:
                out[stage] = pinned_record(context, cls, lineage[stage])
            except Exception:  # no such materialization: that stage's params are not logged
                continue
    return out


def stage_params(records: Mapping[str, StageRecord]) -> dict[str, Any]:
    """Every recorded stage config as MLflow params, ``<stage>.<knob>``
    (``peripheral_subsets``: only the knobs its selector reads), and the base model:
    ``base_model`` (the setting) and ``base_model_id`` (its portable identity)."""
    out: dict[str, Any] = {}
    for stage, record in records.items():
        config = dict(getattr(record, "config", {}) or {})
        if stage == PERIPHERAL_SUBSETS and config.get("selector"):
            config = tracked_knobs(config)
        out.update({f"{stage}.{k}": v for k, v in config.items()})
    embeddings = records.get(PROXY_EMBEDDINGS)
    if isinstance(embeddings, ProxyEmbeddingsRecord):
        out["base_model"] = embeddings.base_model_setting or embeddings.base_model
        if embeddings.base_model_identity:
            out["base_model_id"] = describe_model(embeddings.base_model_identity)
    return out


def run_stages(context: dg.AssetExecutionContext) -> list[str]:
    """The pipeline stages this Dagster run materializes (its asset selection, else its
    job's), in pipeline order; empty where Dagster does not say."""
    try:
        keys = context.run.asset_selection or context.job_def.asset_layer.selected_asset_keys
    except Exception:  # an execution context without a job
        return []
    names = {key.to_user_string() for key in keys}
    return [stage for stage in STAGES if stage in names]


def _with_defaults(stage: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's config as launched, every knob filled in with its default (as given where it
    cannot be read: an ``{env: NAME}`` value)."""
    try:
        values = STAGE_CONFIGS[stage](**given).model_dump(mode="json")
    except Exception:
        values = dict(given)
    return repeatable_config(stage, values)


def whole_run_config(
    context: dg.AssetExecutionContext,
    records: Mapping[str, StageRecord],
    stage: str,
    config: dg.Config,
) -> dict[str, Any]:
    """The run config of the whole pipeline run this stage is part of (``ops:`` in pipeline
    order, ``resources: base_model``), which ``cluster-pipeline rerun`` takes: every stage it
    depends on as its record says it ran (``records``), this ``stage`` with its ``config``, and
    the other stages of this Dagster run (:func:`run_stages`) as it was launched, defaults
    filled in."""
    recorded = chain_run_config(records)
    ops = dict(recorded["ops"])
    ops[stage] = {"config": repeatable_config(stage, config.model_dump(mode="json"))}
    run_config: Mapping[str, Any] = context.run.run_config or {}
    launched = run_config.get("ops")
    launched = launched if isinstance(launched, Mapping) else {}
    for name in run_stages(context):
        given = launched.get(name)
        if name not in ops:
            config_given = given.get("config") if isinstance(given, Mapping) else None
            ops[name] = {"config": _with_defaults(name, config_given or {})}
    out: dict[str, Any] = {"ops": {name: ops[name] for name in STAGES if name in ops}}
    embeddings = records.get(PROXY_EMBEDDINGS)
    if isinstance(embeddings, ProxyEmbeddingsRecord) and embeddings.base_model_setting:
        out["resources"] = {"base_model": {"config": {"model": embeddings.base_model_setting}}}
    return out


def run_config_text(config: dict[str, Any], context: dg.AssetExecutionContext) -> str:
    """``config`` as the YAML file an MLflow run keeps, headed by how to run it again."""
    d = context.partition_key
    # The command as a shell reads it: a name with spaces or quotes stays one word.
    again = shlex.join(["cluster-pipeline", "rerun", "run_config.yaml", "--dataset", d])
    head = (
        f"# The run config of Dagster run {context.run.run_id} for dataset {d!r}: every\n"
        "# stage's settings, as it ran (the stages before) or was launched (the stages after).\n"
        f"# Run it again: {again}\n"
    )
    return head + yaml.safe_dump(config, sort_keys=False)


def log_run_config(
    tracker: Tracker,
    context: dg.AssetExecutionContext,
    runs: list[str | None],
    records: Mapping[str, StageRecord],
    stage: str,
    config: dg.Config,
) -> None:
    """The whole run's config (:func:`whole_run_config`) as ``run_config.yaml`` of each of
    ``runs`` (a stage's run and the pipeline run; each stage writes the parent's again with
    what it knows, the last one everything)."""
    if not tracker.enabled:
        return
    text = run_config_text(whole_run_config(context, records, stage, config), context)
    for run_id in runs:
        tracker.log_bytes(run_id, text, RUN_CONFIG_ARTIFACT)


def _digest(sha256: str) -> str:
    return sha256[: DIGEST_CHARS - 4]  # 32 hex digits, within MLflow's limit of 36


def pool_dataset(dataset: str, subsets: TableRef):
    """The clustered pool as an MLflow dataset (``mlflow.data.from_polars`` of the
    ``peripheral_subsets`` table version: one row per clustered sample; its source the Delta
    table at that version), digest: the SHA-256 of its sorted sample ids, which are content
    hashes of the samples."""
    from mlflow.data.delta_dataset_source import DeltaDatasetSource
    from mlflow.data.polars_dataset import from_polars

    frame = subsets.read()
    digest = rows_sha256(frame.select("sample_id"), ["sample_id"])
    source = DeltaDatasetSource(path=subsets.uri, delta_table_version=subsets.version)
    return from_polars(frame, source=source, name=f"{dataset} pool", digest=_digest(digest))


def selection_dataset(dataset: str, shards: ShardManifestsRecord):
    """The selection as an MLflow dataset (the ``shard_manifests`` table version: one row per
    shard entry, rank, position, weight), digest: the manifest set's content hash."""
    from mlflow.data.delta_dataset_source import DeltaDatasetSource
    from mlflow.data.polars_dataset import from_polars

    source = DeltaDatasetSource(path=shards.table.uri, delta_table_version=shards.table.version)
    return from_polars(
        shards.table.read(),
        source=source,
        name=f"{dataset} selection ({shards.selector})",
        digest=_digest(shards.manifest_set_sha256),
    )


# --- peripheral_subsets -------------------------------------------------------------------------


def selection_log_lines(record: PeripheralSubsetsRecord) -> list[str]:
    """Two lines for the run's log: what was kept per cluster with the weights; the subset's
    gradient diversity and the selection's cost."""
    r = record
    passes = ", ".join(p["name"] for p in r.selection_passes) or "no model pass"
    # An unclustered selector's subset is dealt into balanced shards (shard_manifests): its
    # per-cluster counts are not the ranks' (a README trial read [81, 63] against [72, 72]).
    where = (
        "per cluster"
        if r.selector in CLUSTER_SELECTORS
        else "per k-means cluster (shard_manifests deals it evenly over the ranks)"
    )
    return [
        f"{r.selector} r={r.ratio}, balance by {r.balance}: {r.selected_samples} of "
        f"{r.pool_size} samples ({100 * r.data_fraction:.1f}%); {where} "
        f"{r.samples_per_cluster} samples, {r.tokens_per_cluster} tokens; weights "
        f"{[round(w, 4) for w in r.cluster_weights]}",
        f"gradient diversity {r.gradient_diversity:.4f} (pool {r.pool_gradient_diversity:.4f}); "
        f"selection cost {r.selector_seconds:.3f} s and {r.forward_passes} forward / "
        f"{r.backward_passes} backward passes ({passes}), peak memory per rank "
        f"{_memory(r.selection_peak_rss_mib, r.selection_peak_cuda_mib)}",
    ]


def log_selection(
    log: Any, record: PeripheralSubsetsRecord, notes: Sequence[str], dataset: str
) -> None:
    """The selection's lines in the run's log: :func:`selection_log_lines` as info, then each
    of the selector's notes (``SelectionResult.notes``: where it gives less than its knobs ask)
    as a warning, prefixed with the dataset."""
    for line in selection_log_lines(record):
        log.info(line)
    for note in notes:
        log.warning(f"{dataset}: {note}")


def _memory(rss_mib: float | None, cuda_mib: float | None) -> str:
    if rss_mib is None:
        return "not recorded"
    return f"{rss_mib:.0f} MiB resident" + (f", {cuda_mib:.0f} MiB CUDA" if cuda_mib else "")


def subset_display(frame: pl.DataFrame, summary: pl.DataFrame, map_png: bytes) -> dict[str, Any]:
    """``peripheral_subsets``' display metadata: the selected rows' preview and columns
    (:func:`table_display`), the pool's row count, the per-cluster summary table and the PCA
    map with the selected samples ringed."""
    return {
        **table_display(frame.filter(pl.col("selected")), PERIPHERAL_SUBSETS),
        "dagster/row_count": frame.height,
        "per_cluster_table": dg.MetadataValue.md(
            markdown_preview(summary, max_rows=64, inline=False)
        ),
        "pca_map_selected": dg.MetadataValue.md(plots.markdown_image(map_png, "selected")),
    }


def selection_map(
    frame: pl.DataFrame,
    embeddings: TableRef,
    representation: str,
    selected: np.ndarray,
    title: str,
) -> bytes:
    """The PCA map (PNG) of a seeded sample of at most 20,000 rows of ``frame``, in the
    representation that was clustered, selected samples marked.

    Args:
        frame: the clustered pool (``sample_id``, ``cluster``), table order.
        embeddings: the ``proxy_embeddings`` table version that was clustered.
        representation: ``gradient_proxy`` or ``hidden_mean``.
        selected: (N,) bool, in ``frame``'s order.
        title: the plot's title.
    """
    shown = frame.with_row_index("row").sample(min(frame.height, 20000), seed=0)
    if representation == "gradient_proxy":
        mapped = l2_normalise(embeddings.vectors_for("embedding", shown["sample_id"]))
    else:
        column = f"{REPRESENTATIONS[representation]}_normalised"
        mapped = embeddings.vectors_for(column, shown["sample_id"])
    rows = shown["row"].to_numpy()
    return plots.png(
        plots.pca_map_figure(
            mapped,
            frame["cluster"].to_numpy()[rows],
            selected[rows],
            title=f"{title} ({representation})",
        )
    )


def start_selection_run(
    tracker: Tracker,
    context: dg.AssetExecutionContext,
    config: Any,
    clusters: BalancedClustersRecord,
) -> tuple[str | None, str | None]:
    """Open the selection's MLflow run, a child of this Dagster run's pipeline run: the knobs
    its selector reads (:func:`~cluster_pipeline.defs.configs.tracked_knobs`) and the
    clustering's K, alpha and representation as params, every earlier stage's config
    (``<stage>.<knob>``) and the base model too, the source tags (git commit), and the whole
    run's config as ``run_config.yaml`` (of this run and the pipeline run).

    Returns:
        (the selection's run, the pipeline run); None where untracked.
    """
    if not tracker.enabled:
        return None, None
    parent = open_pipeline_run(tracker, context)
    upstream = upstream_records(context, clusters.lineage())
    run_id = tracker.start_run(
        f"{context.partition_key} {config.selector} r={config.ratio} seed={config.seed} selection",
        run_tags(context, **{TAG_SELECTOR: config.selector}, **source_tags(PERIPHERAL_SUBSETS)),
        {
            **tracked_knobs(config),
            "K": clusters.num_clusters,
            "alpha": clusters.alpha,
            "representation": clusters.representation,
            **stage_params(upstream),
        },
        parent_run_id=parent,
    )
    log_run_config(tracker, context, [run_id, parent], upstream, PERIPHERAL_SUBSETS, config)
    return run_id, parent


def track_selection(
    tracker: Tracker,
    run_id: str | None,
    record: PeripheralSubsetsRecord,
    map_png: bytes,
    dataset: str,
) -> None:
    """Into the selection's MLflow run: its cost (seconds, model passes, peak memory per rank)
    and the subset's figures (size, data fraction, gradient diversity), the PCA map, and the
    clustered pool as its dataset input (:func:`pool_dataset`, context ``pool``)."""
    metrics = {
        "selection_seconds": record.selection_seconds,
        "stage_seconds": record.seconds,
        "selector_seconds": record.selector_seconds,
        "forward_passes": record.forward_passes,
        "backward_passes": record.backward_passes,
        "peak_rss_mib": record.selection_peak_rss_mib,
        "peak_cuda_mib": record.selection_peak_cuda_mib,
        "pool_size": record.pool_size,
        "selected_samples": record.selected_samples,
        "data_fraction": record.data_fraction,
        "gradient_diversity": record.gradient_diversity,
        "pool_gradient_diversity": record.pool_gradient_diversity,
    }
    tracker.log_metrics(run_id, metrics)
    tracker.log_bytes(run_id, map_png, "pca_map_selected.png", "plots")
    tracker.log_inputs(run_id, lambda: [(pool_dataset(dataset, record.table), "pool")])


# --- trained_checkpoint -------------------------------------------------------------------------


def training_plots(history: list[dict[str, Any]]) -> dict[str, bytes]:
    """The loss per rank and the useful-compute fraction over steps, as PNG files by name
    (shown on the asset page and logged to the run's MLflow run).

    Args:
        history: the metrics file's records, one per optimizer step (``step``,
            ``loss_per_rank``, ``useful_compute_fraction``).
    """
    steps = [h["step"] for h in history]
    curve = plots.loss_curves_figure(steps, [h["loss_per_rank"] for h in history])
    measured = [h for h in history if "useful_compute_fraction" in h]
    useful = plots.useful_compute_figure(
        [h["step"] for h in measured], [h["useful_compute_fraction"] for h in measured]
    )
    return {"loss_per_rank.png": plots.png(curve), "useful_compute.png": plots.png(useful)}


def training_display(
    selection_seconds: float, train_seconds: float, pngs: dict[str, bytes]
) -> dict[str, Any]:
    """The asset page's tables and plots: selection against training seconds, and the
    :func:`training_plots` ``pngs``.

    Args:
        selection_seconds: the selection's cost (its model passes + clustering + subsets +
            shards), s.
        train_seconds: training's measured seconds.
        pngs: :func:`training_plots`' figures.
    """
    seconds = [
        [
            "selection (its model passes + clustering + subsets + shards)",
            f"{selection_seconds:.1f}",
        ],
        ["training", f"{train_seconds:.1f}"],
    ]
    return {
        "selection_vs_training": dg.MetadataValue.md(markdown_table(["stage", "seconds"], seconds)),
        "loss_curve": dg.MetadataValue.md(
            plots.markdown_image(pngs["loss_per_rank.png"], "loss per rank")
        ),
        "useful_compute": dg.MetadataValue.md(
            plots.markdown_image(pngs["useful_compute.png"], "useful compute fraction per step")
        ),
    }


def start_training_run(
    tracker: Tracker,
    context: dg.AssetExecutionContext,
    output_dir: Path,
    reused: bool,
    params: dict[str, Any],
    name: str,
    shards: ShardManifestsRecord,
    config: dg.Config,
) -> tuple[str | None, str | None, str | None]:
    """The checkpoint's MLflow run: a reused checkpoint keeps the run that trained it (found
    by its folder's tag); otherwise (or for one trained untracked) a run named ``name`` is
    opened now, a child of this Dagster run's pipeline run, tagged with the folder, the
    selector and the source (git commit), with ``params``, every stage's config before it
    (``<stage>.<knob>``) and the base model; its dataset inputs are the pool (context
    ``pool``) and the selection it trains on (``training``, digest: the manifest set hash),
    and the whole run's config is ``run_config.yaml`` of it and of the pipeline run.

    Returns:
        (the run opened now, the earlier run found, the pipeline run); the first two are not
        both set; all None when untracked.
    """
    if not tracker.enabled:
        return None, None, None
    parent = open_pipeline_run(tracker, context)
    upstream = upstream_records(context, shards.lineage())
    earlier = tracker.find_run({TAG_CHECKPOINT: output_dir}) if reused else None
    if earlier is not None:
        tracker.set_tags(parent, {"checkpoint_run_id": earlier})
        log_run_config(tracker, context, [parent], upstream, TRAINED_CHECKPOINT, config)
        return None, earlier, parent
    tags = run_tags(
        context,
        **{TAG_CHECKPOINT: output_dir, TAG_SELECTOR: shards.selector},
        **source_tags(TRAINED_CHECKPOINT),
    )
    run_id = tracker.start_run(name, tags, {**params, **stage_params(upstream)}, parent)
    subsets = upstream.get(PERIPHERAL_SUBSETS)
    dataset = context.partition_key

    def inputs() -> list[tuple[Any, str]]:
        pool = [(pool_dataset(dataset, subsets.table), "pool")] if subsets is not None else []
        return [*pool, (selection_dataset(dataset, shards), "training")]

    tracker.log_inputs(run_id, inputs)
    log_run_config(tracker, context, [run_id, parent], upstream, TRAINED_CHECKPOINT, config)
    return run_id, None, parent


def track_training(
    tracker: Tracker,
    run_id: str | None,
    record: TrainedCheckpointRecord,
    ckpt: Checkpoint,
    history: list[dict[str, Any]],
    pngs: dict[str, bytes],
    backfill: bool,
) -> None:
    """Into the checkpoint's MLflow run: the run's totals (``summary/...``), the plots and
    ``training_info.json``; with ``backfill`` (a checkpoint trained untracked) first every
    step's metrics from its metrics file, as rank 0 would have logged them."""
    if run_id is None:
        return
    if backfill:
        for entry in history:
            tracker.log_metrics(run_id, step_metrics(entry), step=entry["step"])
    summary = {
        "steps": record.steps,
        "final_loss": record.final_loss,
        "train_seconds": record.train_seconds,
        "useful_compute_fraction": record.useful_compute_fraction,
        "selection_seconds": record.selection_seconds,
    }
    tracker.log_metrics(run_id, {f"summary/{k}": v for k, v in summary.items()}, record.steps)
    for name, png in pngs.items():
        tracker.log_bytes(run_id, png, name, "plots")
    tracker.log_artifact(run_id, ckpt.path / "training_info.json")


# --- eval_report --------------------------------------------------------------------------------


def report_markdown(report: Report) -> dg.MetadataValue:
    """The whole report as one Markdown entry, its figures inline (the answer's first)."""
    return dg.MetadataValue.md(
        report.summary
        + "\n"
        + "\n".join(plots.markdown_image(p, n) for n, p in report.pngs.items())
    )


def answer_first(report: Report) -> dict[str, dg.MetadataValue]:
    """The entries the asset page lists first: ``was_it_worth_it``, the answer in a few lines
    (short Markdown, which Dagster 1.13 shows inline), and ``decision_plot``, the figure that
    answers it (a PNG is too long to show inline: Dagster opens it from "[Show Markdown]")."""
    out: dict[str, dg.MetadataValue] = {"was_it_worth_it": dg.MetadataValue.md(report.answer)}
    if "decision.png" in report.pngs:
        out["decision_plot"] = dg.MetadataValue.md(
            plots.markdown_image(report.pngs["decision.png"], "was the subset worth it?")
        )
    return out


def heldout_dataset(dataset: str, instructions: TableRef, heldout: pl.DataFrame):
    """The held-out split as an MLflow dataset (its rows of the ``raw_instructions`` version the
    checkpoint was trained from), digest: the SHA-256 of its sorted sample ids."""
    from mlflow.data.delta_dataset_source import DeltaDatasetSource
    from mlflow.data.polars_dataset import from_polars

    digest = rows_sha256(heldout.select("sample_id"), ["sample_id"])
    source = DeltaDatasetSource(path=instructions.uri, delta_table_version=instructions.version)
    return from_polars(
        heldout, source=source, name=f"{dataset} held-out split", digest=_digest(digest)
    )


def track_evaluation(
    tracker: Tracker,
    context: dg.AssetExecutionContext,
    record: EvalReportRecord,
    path: Path,
    pngs: dict[str, bytes],
    trained: TrainedCheckpointRecord,
    config: dg.Config,
    heldout: pl.DataFrame,
) -> str | None:
    """The evaluation into MLflow, in two runs. The current checkpoint's run (the newest run
    tagged with its folder; a run of its own, ended at once, for a checkpoint trained
    untracked) gets both models' metrics (``eval/base/...``, ``eval/tuned/...``), the
    differences against each reference (``eval/difference/<reference>/<metric>``) with their
    verdicts as tags, and the report (Markdown, JSON, plots) under ``eval_report/``: a table of
    checkpoint runs compares them. The evaluation's own run, a child of this Dagster run's
    pipeline run, gets the same metrics and verdicts, the held-out split as its dataset input
    (context ``evaluation``), the source tags and the whole run's ``run_config.yaml`` (of it and
    of the pipeline run). Returns the checkpoint's run id (None: untracked)."""
    if not tracker.enabled:
        return None
    run_id = tracker.find_run({TAG_CHECKPOINT: record.checkpoint_path})
    opened = run_id is None
    if opened:
        run_id = tracker.start_run(
            f"{context.partition_key} eval {Path(record.checkpoint_path).name}",
            run_tags(context, **{TAG_CHECKPOINT: record.checkpoint_path}),
        )
    metrics: dict[str, float | None] = {
        **{f"eval/base/{m}": v for m, v in record.base.items()},
        **{f"eval/tuned/{m}": v for m, v in record.tuned.items()},
        "eval/train_seconds": record.train_seconds,
        "eval/full_training_seconds": record.full_training_seconds,
        "eval/data_fraction": record.data_fraction,
    }
    for v in record.verdicts:
        metrics[f"eval/difference/{v['reference']}/{v['metric']}"] = v["difference"]
    verdicts = {f"verdict/{v['reference']}/{v['metric']}": v["verdict"] for v in record.verdicts}
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(run_id, {"eval_dagster_run_id": context.run.run_id, **verdicts})
    for name in (path.name, "eval_report.json"):
        tracker.log_artifact(run_id, path.parent / name, "eval_report")
    for name, png in pngs.items():
        tracker.log_bytes(run_id, png, name, "eval_report")
    if opened:
        tracker.end_run(run_id)

    parent = open_pipeline_run(tracker, context)
    upstream = upstream_records(context, trained.inputs)
    tags = run_tags(
        context,
        **{TAG_CHECKPOINT: record.checkpoint_path, "checkpoint_run_id": run_id},
        **source_tags(EVAL_REPORT),
    )
    evaluation = tracker.start_run(
        f"{context.partition_key} eval {Path(record.checkpoint_path).name}",
        {**tags, **verdicts},
        {
            **{f"{EVAL_REPORT}.{k}": v for k, v in config.model_dump(mode="json").items()},
            **stage_params(upstream),
        },
        parent,
    )
    with tracker.ending(evaluation, parent):
        tracker.log_metrics(evaluation, metrics)
        instructions = trained.inputs[RAW_INSTRUCTIONS]
        tracker.log_inputs(
            evaluation,
            lambda: [(heldout_dataset(context.partition_key, instructions, heldout), "evaluation")],
        )
        records: dict[str, StageRecord] = {**upstream, TRAINED_CHECKPOINT: trained}
        log_run_config(tracker, context, [evaluation, parent], records, EVAL_REPORT, config)
    return run_id
