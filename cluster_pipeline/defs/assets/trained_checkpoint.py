"""Stage 5: DDP fine-tuning under torchrun, one rank per cluster, losses re-weighted."""

import time
from typing import Any

import dagster as dg
from pydantic import Field

from cluster_pipeline.data.datasets import samples_fingerprint
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    PeripheralSubsetsRecord,
    ShardManifestsRecord,
    TrainedCheckpointRecord,
    pinned_record,
    read_record,
)
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    StorageResource,
    TorchrunResource,
    TrackingResource,
    run_tags,
)
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.selection.sharding import read_recorded_manifests
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)
from cluster_pipeline.storage.tables import markdown_table
from cluster_pipeline.tracking.tracker import TAG_CHECKPOINT, TAG_SELECTOR, Tracker, step_metrics
from cluster_pipeline.training.checkpointing import (
    Checkpoint,
    finished_for,
    read_checkpoint,
    read_metrics,
)
from cluster_pipeline.training.config import TrainJob, TrainSettings, settings_of
from cluster_pipeline.training.memory import TrainingMemoryError
from cluster_pipeline.training.preflight import check_training_fits, checkpoint_folder


class TrainedCheckpointConfig(dg.Config, TrainSettings):
    """The training knobs (:class:`~cluster_pipeline.training.config.TrainSettings`) plus
    whether to reuse a finished checkpoint."""

    retrain: bool = Field(
        default=False,
        description="Train again even if a finished "
        "checkpoint of the same manifests, data, model and settings exists.",
    )


@stage_asset(
    "training",
    deps=[SHARD_MANIFESTS, PERIPHERAL_SUBSETS, RAW_INSTRUCTIONS],
    kinds={"pytorch", "huggingface"},
)
def trained_checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainedCheckpointConfig,
    storage: StorageResource,
    base_model: BaseModelResource,
    torchrun: TorchrunResource,
    pipes_subprocess_client: dg.PipesSubprocessClient,
    tracking: TrackingResource,
) -> dg.MaterializeResult:
    """A fine-tuned checkpoint: ``save_pretrained`` folder (safetensors + tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads, plus ``training_info.json`` naming the shard
    manifests (by content hash), base model, settings and git commit. Trained by ``torchrun``
    with one rank per shard manifest, on the raw_instructions version the manifests were
    selected from; rank c's loss is multiplied by w_c. docs/design.md, step 5. Tracked as an
    MLflow run (the tracking resource): settings and selection as params, every step's metrics
    from rank 0, the plots and ``training_info.json`` as artifacts.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    shards = read_record(context, ShardManifestsRecord)
    subsets = pinned_record(context, PeripheralSubsetsRecord, shards.inputs[PERIPHERAL_SUBSETS])
    clusters = pinned_record(context, BalancedClustersRecord, subsets.inputs[BALANCED_CLUSTERS])
    instructions = shards.inputs[RAW_INSTRUCTIONS]
    settings = settings_of(config, TrainSettings)
    model_path = base_model.local_path(storage)
    recheck_settings(context, storage.layout, model_path, torchrun.agents)  # before any model loads
    try:  # before any process starts
        # The files the ranks will read must be the ones shard_manifests recorded (a manifest
        # copied in or edited would otherwise fail only inside torchrun, or train on it).
        read_recorded_manifests(shards.manifest_paths, shards.manifest_sha256, dataset)
        memory_per_rank = check_training_fits(
            model_path, settings, shards.world_size, torchrun.agents, torchrun.launcher == "slurm"
        )
    except (ValueError, TrainingMemoryError) as e:
        raise dg.Failure(f"dataset {dataset!r}: {e}") from e
    run_dir = storage.layout.checkpoints_dir(dataset)
    sample_ids = set(shards.table.read(["sample_id"])["sample_id"].to_list())
    data = samples_fingerprint(instructions.uri, instructions.version, sample_ids)
    output_dir = checkpoint_folder(run_dir, shards.manifest_set_sha256, model_path, data, settings)
    reused = not config.retrain and finished_for(output_dir, shards.manifest_sha256) is not None
    tracker = tracking.tracker(storage.layout, context.log.warning)
    tags = run_tags(context, **{TAG_CHECKPOINT: output_dir, TAG_SELECTOR: subsets.selector})
    # A reused checkpoint keeps the run that trained it; one trained untracked gets a run now.
    earlier = tracker.find_run({TAG_CHECKPOINT: output_dir}) if reused else None
    run_id = None
    if earlier is None:
        name = f"{dataset} {subsets.selector} r={subsets.ratio} seed={settings.seed}"
        run_id = tracker.start_run(name, tags, _params(settings, shards, subsets, clusters))
    job = TrainJob(
        settings=settings,
        model_path=model_path,
        instructions_uri=instructions.uri,
        instructions_version=instructions.version,
        manifests=shards.manifest_paths,
        output_dir=str(output_dir),
        provenance=_provenance(context, shards, subsets, clusters, settings),
        tracking=None if reused else tracker.target(run_id),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = job.dump(run_dir / f"{output_dir.name}.job.json")
    with tracker.ending(run_id):
        if reused:
            # Training is deterministic given these inputs: the finished checkpoint is the answer.
            context.log.info(
                f"reusing {output_dir}: same manifests, data, model and settings "
                "(set retrain: true to train again)"
            )
            reported = {}
        else:
            reported = (
                torchrun.run(
                    context,
                    pipes_subprocess_client,
                    RECIPES["train"],
                    shards.world_size // torchrun.agents,
                    job_file,
                )
                .get_materialize_result()
                .metadata
                or {}
            )
        ckpt = read_checkpoint(output_dir)
        if ckpt is None:
            raise dg.Failure(f"training finished but {output_dir} holds no training_info.json")
        history = read_metrics(output_dir)
        record = _record(shards, ckpt, history, model_path, reused, time.perf_counter() - start)
        pngs = training_plots(history)
        _track_outcome(tracker, run_id, record, ckpt, history, pngs, backfill=reused)
    mlflow_run = run_id or earlier
    return dg.MaterializeResult(
        metadata={
            **reported,
            **record.to_metadata(),
            "estimated_memory_per_rank_gib": round(memory_per_rank / 2**30, 3),
            **training_display(record.selection_seconds, record.train_seconds, pngs),
            **({"mlflow_run_id": mlflow_run} if mlflow_run else {}),
        }
    )


def _params(
    settings: TrainSettings,
    shards: ShardManifestsRecord,
    subsets: PeripheralSubsetsRecord,
    clusters: BalancedClustersRecord,
) -> dict[str, Any]:
    """The MLflow params of a training run: every training setting, then how its data was
    selected (selector, r, K, alpha, balance, the rank weights w_c, the selection seed)."""
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


def _track_outcome(
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


def _provenance(
    context: dg.AssetExecutionContext,
    shards: ShardManifestsRecord,
    subsets: PeripheralSubsetsRecord,
    clusters: BalancedClustersRecord,
    settings: TrainSettings,
) -> dict[str, Any]:
    """What ``training_info.json`` records of how the shards were made (the report groups
    checkpoints by it)."""
    return {
        "dagster_run_id": context.run.run_id,
        "dataset": context.partition_key,
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
        # A targeted selector's target set (rds), which the report names in the group.
        **({"selection_target": subsets.selection_target} if subsets.selection_target else {}),
        "training_seed": settings.seed,
        **{f"{asset}_version": ref.version for asset, ref in shards.lineage().items()},
    }


def _record(
    shards: ShardManifestsRecord,
    ckpt: Checkpoint,
    history: list[dict[str, Any]],
    model_path: str,
    reused: bool,
    seconds: float,
) -> TrainedCheckpointRecord:
    info = ckpt.info
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
        rank_weights=list(info.get("rank_weights", [])),
        packed=bool(info.get("packed", False)),
        useful_compute_fraction=_rounded(info.get("useful_compute_fraction"), 4),
        wait_seconds_per_rank=[round(s, 2) for s in info.get("wait_seconds_per_rank", [])],
        selection_seconds=shards.selection_seconds,
        config=ckpt.settings,
    )


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


def _rounded(value: float | None, digits: int) -> float | None:
    """``value`` rounded for display (None stays None)."""
    return None if value is None else round(float(value), digits)
