"""Stage 5: DDP fine-tuning under torchrun, one rank per cluster, losses re-weighted."""

import sys
import time

import dagster as dg
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.core.cache import stable_hash
from cluster_pipeline.core.checkpoints import finished_for, read_checkpoint, read_metrics
from cluster_pipeline.core.datasets import samples_fingerprint
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    PeripheralSubsetsRecord,
    ShardManifestsRecord,
    TrainedCheckpointRecord,
    pinned_record,
    read_record,
)
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.defs.run_checks import preflight
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.training.config import TrainJob, TrainSettings, settings_of
from cluster_pipeline.training.parallel import (
    TrainingMemoryError,
    activation_bytes,
    available_bytes_per_rank,
    check_lora_targets,
    check_training_memory,
    parameter_count,
)

TRAIN_MODULE = "cluster_pipeline.training.train"


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
    deps=["shard_manifests", "peripheral_subsets", "raw_instructions"],
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
    subsets = pinned_record(context, PeripheralSubsetsRecord, shards.inputs["peripheral_subsets"])
    clusters = pinned_record(context, BalancedClustersRecord, subsets.inputs["balanced_clusters"])
    instructions = shards.inputs["raw_instructions"]
    if shards.world_size % torchrun.agents:
        raise dg.Failure(
            f"{shards.world_size} ranks cannot be split over {torchrun.agents} torchrun agents "
            "(nodes): make the number of clusters a multiple of it"
        )
    settings = settings_of(config, TrainSettings)
    model_path = base_model.local_path(storage)
    preflight(context, storage.layout, model_path, torchrun.agents)  # before any model loads
    # Fail before any process starts when the model cannot fit (weights, gradients, AdamW,
    # activations). Slurm's nodes are not this machine: their memory is only estimated.
    available = (
        sys.maxsize
        if torchrun.launcher == "slurm"
        else available_bytes_per_rank(shards.world_size // torchrun.agents)
    )
    try:
        memory_per_rank = check_training_memory(
            parameter_count(model_path),
            settings,
            shards.world_size,
            available,
            activations=activation_bytes(model_path, settings),
            checkpointed_activations=activation_bytes(
                model_path, settings.model_copy(update={"gradient_checkpointing": True})
            ),
        )
    except TrainingMemoryError as e:
        raise dg.Failure(f"dataset {dataset!r}: {e}") from e
    try:
        check_lora_targets(model_path, settings)
    except ValueError as e:
        raise dg.Failure(f"dataset {dataset!r}: {e}") from e
    run_dir = storage.layout.checkpoints_dir(dataset)
    # Same manifests, sample contents, model and settings -> same folder, so a re-executed run
    # resumes from the interrupted one's latest checkpoint and a finished one is reused, also
    # after raw_instructions was re-materialized with unchanged data (a new table version).
    sample_ids = set(shards.table.read(["sample_id"])["sample_id"].to_list())
    data = samples_fingerprint(instructions.uri, instructions.version, sample_ids)
    output_dir = run_dir / (
        f"{shards.manifest_set_sha256[:12]}-"
        f"{stable_hash(model_path, data, settings.model_dump(), length=8)}"
    )
    job = TrainJob(
        settings=settings,
        model_path=model_path,
        instructions_uri=instructions.uri,
        instructions_version=instructions.version,
        manifests=shards.manifest_paths,
        output_dir=str(output_dir),
        provenance={
            "dagster_run_id": context.run.run_id,
            "dataset": dataset,
            "manifest_set_sha256": shards.manifest_set_sha256,
            "selector": subsets.selector,
            "ratio": subsets.ratio,
            "alpha": clusters.alpha,
            "representation": clusters.representation,
            "selection_seed": subsets.seed,
            "data_fraction": subsets.data_fraction,
            "pool_size": subsets.pool_size,
            "gradient_diversity": subsets.gradient_diversity,
            "selection_seconds": shards.selection_seconds,
            "training_seed": settings.seed,
            **{f"{asset}_version": ref.version for asset, ref in shards.lineage().items()},
        },
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
                TRAIN_MODULE,
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
    record = TrainedCheckpointRecord(
        checkpoint_path=str(output_dir),
        inputs=shards.lineage(),
        base_model=model_path,
        world_size=shards.world_size,
        manifest_sha256=ckpt.manifest_sha256,
        manifest_set_sha256=shards.manifest_set_sha256,
        reused_checkpoint=reused,
        git_commit=str(ckpt.info.get("git_commit")),
        resumed_from_step=ckpt.info.get("resumed_from_step"),
        steps=int(ckpt.info.get("steps", len(history))),
        final_loss=float(ckpt.info.get("final_loss", float("nan"))),
        seconds=round(time.perf_counter() - start, 2),
        train_seconds=round(float(ckpt.train_seconds or 0.0), 2),
        samples_per_rank=shards.shard_size,
        rank_weights=list(ckpt.info.get("rank_weights", [])),
        packed=bool(ckpt.info.get("packed", False)),
        useful_compute_fraction=ckpt.info.get("useful_compute_fraction"),
        wait_seconds_per_rank=list(ckpt.info.get("wait_seconds_per_rank", [])),
        selection_seconds=shards.selection_seconds,
        config=ckpt.settings,
    )
    curve = plots.loss_curves([h["step"] for h in history], [h["loss_per_rank"] for h in history])
    useful = plots.named_curves(
        {
            "useful compute fraction": [
                (h["step"], h["useful_compute_fraction"])
                for h in history
                if "useful_compute_fraction" in h
            ]
        },
        "optimizer step",
        "real tokens / (ranks x busiest rank's tensor tokens)",
    )
    return dg.MaterializeResult(
        metadata={
            **reported,
            **record.to_metadata(),
            "estimated_memory_per_rank_gib": round(memory_per_rank / 2**30, 3),
            "selection_vs_training": dg.MetadataValue.md(
                "| stage | seconds |\n|---|---|\n"
                f"| selection (embedding pass + clustering + subsets + shards) | "
                f"{record.selection_seconds:.1f} |\n| training | {record.train_seconds:.1f} |\n"
            ),
            "loss_curve": dg.MetadataValue.md(plots.markdown_image(curve, "loss per rank")),
            "useful_compute": dg.MetadataValue.md(
                plots.markdown_image(useful, "useful compute fraction per step")
            ),
        }
    )
