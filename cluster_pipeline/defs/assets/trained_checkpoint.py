"""Stage 5: DDP fine-tuning under torchrun, one rank per cluster, losses re-weighted."""

import time

import dagster as dg

from cluster_pipeline.defs.configs import TrainedCheckpointConfig
from cluster_pipeline.defs.metadata import (
    memory_display,
    start_training_run,
    track_training,
    training_display,
    training_plots,
)
from cluster_pipeline.defs.pass_runner import plan_training
from cluster_pipeline.defs.records import (
    BalancedClustersRecord,
    PeripheralSubsetsRecord,
    ShardManifestsRecord,
    checkpoint_record,
    pinned_record,
    read_record,
    training_params,
    training_provenance,
)
from cluster_pipeline.defs.resources import (
    BaseModelResource,
    StorageResource,
    TorchrunResource,
    TrackingResource,
)
from cluster_pipeline.defs.stages import stage_asset
from cluster_pipeline.storage.names import (
    BALANCED_CLUSTERS,
    PERIPHERAL_SUBSETS,
    RAW_INSTRUCTIONS,
    SHARD_MANIFESTS,
)
from cluster_pipeline.training.checkpointing import read_checkpoint, read_metrics
from cluster_pipeline.training.config import TrainSettings, settings_of


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
    MLflow run (the tracking resource), a child of the Dagster run's pipeline run: settings,
    selection and every earlier stage's config as params, the pool and the selection as its
    dataset inputs, every step's metrics from rank 0, the plots, ``training_info.json`` and the
    whole run's config as artifacts.
    """
    dataset, start = context.partition_key, time.perf_counter()
    shards = read_record(context, ShardManifestsRecord)
    subsets = pinned_record(context, PeripheralSubsetsRecord, shards.inputs[PERIPHERAL_SUBSETS])
    clusters = pinned_record(context, BalancedClustersRecord, subsets.inputs[BALANCED_CLUSTERS])
    settings = settings_of(config, TrainSettings)
    model_path = base_model.local_path(storage, context.log.info)
    # Before any process starts: the rules, the manifests, the fit; and the checkpoint's folder.
    plan = plan_training(context, storage, torchrun, shards, settings, model_path, config.retrain)
    output_dir, reused = plan.output_dir, plan.reused
    # Before anything else of the run's: a resumable checkpoint this run does not resume.
    if (set_aside := plan.set_aside_note(dataset, shards.manifest_set_sha256)) is not None:
        context.log.warning(set_aside)
    tracker = tracking.tracker(storage.layout, context.log.warning)
    run_id, earlier, pipeline_run = start_training_run(
        tracker,
        context,
        output_dir,
        reused,
        training_params(settings, shards, subsets, clusters),
        f"{dataset} {subsets.selector} r={subsets.ratio} seed={settings.seed}",
        shards,
        config,
    )
    provenance = training_provenance(
        context.run.run_id, dataset, shards, subsets, clusters, settings.seed
    )
    target = None if reused else tracker.target(run_id)
    job_file = plan.write_job(shards, settings, model_path, provenance, target)
    with tracker.ending(run_id, pipeline_run):
        reported = plan.train_or_reuse(
            context, torchrun, pipes_subprocess_client, shards.world_size, job_file
        )
        ckpt = read_checkpoint(output_dir)
        if ckpt is None:
            raise dg.Failure(f"training finished but {output_dir} holds no training_info.json")
        history = read_metrics(output_dir)
        seconds = time.perf_counter() - start
        record = checkpoint_record(shards, ckpt, history, model_path, reused, seconds)
        pngs = training_plots(history)
        track_training(tracker, run_id, record, ckpt, history, pngs, backfill=reused)
    mlflow_run = run_id or earlier
    measured = None if reused else ckpt.info.get("peak_rss_bytes_per_rank")
    return dg.MaterializeResult(
        metadata={
            **reported,
            **record.to_metadata(),
            **memory_display(plan.memory_per_rank, measured, context.log.info),
            **training_display(record.selection_seconds, record.train_seconds, pngs),
            **({"mlflow_run_id": mlflow_run} if mlflow_run else {}),
            **plan.set_aside_metadata(),
        }
    )
