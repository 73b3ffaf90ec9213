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
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import recheck_settings
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.evaluation import plots
from cluster_pipeline.launch.torchrun import RECIPES
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)
from cluster_pipeline.storage.tables import markdown_table
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
) -> dg.MaterializeResult:
    """A fine-tuned checkpoint: ``save_pretrained`` folder (safetensors + tokenizer) that
    ``AutoModelForCausalLM.from_pretrained`` loads, plus ``training_info.json`` naming the shard
    manifests (by content hash), base model, settings and git commit. Trained by ``torchrun``
    with one rank per shard manifest, on the raw_instructions version the manifests were
    selected from; rank c's loss is multiplied by w_c. docs/design.md, step 5.
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
        memory_per_rank = check_training_fits(
            model_path, settings, shards.world_size, torchrun.agents, torchrun.launcher == "slurm"
        )
    except (ValueError, TrainingMemoryError) as e:
        raise dg.Failure(f"dataset {dataset!r}: {e}") from e
    run_dir = storage.layout.checkpoints_dir(dataset)
    sample_ids = set(shards.table.read(["sample_id"])["sample_id"].to_list())
    data = samples_fingerprint(instructions.uri, instructions.version, sample_ids)
    output_dir = checkpoint_folder(run_dir, shards.manifest_set_sha256, model_path, data, settings)
    job = TrainJob(
        settings=settings,
        model_path=model_path,
        instructions_uri=instructions.uri,
        instructions_version=instructions.version,
        manifests=shards.manifest_paths,
        output_dir=str(output_dir),
        provenance=_provenance(context, shards, subsets, clusters, settings),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    job_file = job.dump(run_dir / f"{output_dir.name}.job.json")
    reused = not config.retrain and finished_for(output_dir, shards.manifest_sha256) is not None
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
    return dg.MaterializeResult(
        metadata={
            **reported,
            **record.to_metadata(),
            "estimated_memory_per_rank_gib": round(memory_per_rank / 2**30, 3),
            **training_display(record.selection_seconds, record.train_seconds, history),
        }
    )


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


def training_display(
    selection_seconds: float, train_seconds: float, history: list[dict[str, Any]]
) -> dict[str, Any]:
    """The asset page's tables and plots: selection against training seconds, the loss per
    rank and the useful-compute fraction over steps.

    Args:
        selection_seconds: the selection's cost (embedding pass + clustering + subsets +
            shards), s.
        train_seconds: training's measured seconds.
        history: the metrics file's records, one per optimizer step (``step``,
            ``loss_per_rank``, ``useful_compute_fraction``).
    """
    steps = [h["step"] for h in history]
    curve = plots.loss_curves_figure(steps, [h["loss_per_rank"] for h in history])
    measured = [h for h in history if "useful_compute_fraction" in h]
    useful = plots.useful_compute_figure(
        [h["step"] for h in measured], [h["useful_compute_fraction"] for h in measured]
    )
    seconds = [
        [
            "selection (embedding pass + clustering + subsets + shards)",
            f"{selection_seconds:.1f}",
        ],
        ["training", f"{train_seconds:.1f}"],
    ]
    return {
        "selection_vs_training": dg.MetadataValue.md(markdown_table(["stage", "seconds"], seconds)),
        "loss_curve": dg.MetadataValue.md(plots.markdown_image(plots.png(curve), "loss per rank")),
        "useful_compute": dg.MetadataValue.md(
            plots.markdown_image(plots.png(useful), "useful compute fraction per step")
        ),
    }


def _rounded(value: float | None, digits: int) -> float | None:
    """``value`` rounded for display (None stays None)."""
    return None if value is None else round(float(value), digits)
