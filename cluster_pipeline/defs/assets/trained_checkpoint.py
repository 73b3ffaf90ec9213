"""Stage 5: DDP fine-tuning under torchrun, one rank per cluster, losses re-weighted."""


import hashlib
import json
import time
from pathlib import Path
from typing import Literal

import dagster as dg
from pydantic import Field

from cluster_pipeline.core import plots
from cluster_pipeline.defs.launch import run_torchrun
from cluster_pipeline.defs.metadata import latest_metadata
from cluster_pipeline.defs.partitions import dataset_partitions
from cluster_pipeline.defs.resources import BaseModelResource, StorageResource, TorchrunResource
from cluster_pipeline.training.train import TrainConfig

TRAIN_MODULE = "cluster_pipeline.training.train"


class TrainedCheckpointConfig(dg.Config):
    max_length: int = Field(default=512, ge=2, description="Max tokens per training sample.")
    per_device_batch_size: int = Field(default=4, ge=1, description="Samples per rank per "
                                       "micro-batch.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Micro-batches per "
                                             "optimizer step.")
    epochs: int = Field(default=1, ge=1, description="Passes over each rank's shard.")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many "
                                  "optimizer steps (None = all epochs).")
    learning_rate: float = Field(default=5e-5, gt=0.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    warmup_ratio: float = Field(default=0.1, ge=0.0, lt=1.0, description="Fraction of steps "
                                "of linear warmup.")
    schedule: Literal["cosine", "linear", "constant"] = Field(default="cosine",
                                                              description="Decay after warmup.")
    max_grad_norm: float = Field(default=1.0, gt=0.0, description="Gradient clipping norm.")
    bf16: bool = Field(default=False, description="bfloat16 autocast.")
    reweight: bool = Field(default=True, description="Multiply rank c's loss by w_c = n_c K / N "
                           "(DESIGN.md step 5); off = plain balanced training.")
    seed: int = Field(default=0, description="Training seed (rank r uses seed + r).")
    save_every_steps: int | None = Field(default=None, ge=1, description="Save a resumable "
                                         "checkpoint every N optimizer steps (None = only at the end).")
    keep_checkpoints: int = Field(default=2, ge=1, description="Intermediate checkpoints kept.")
    resume: bool = Field(default=True, description="Resume from the latest intermediate "
                         "checkpoint of the same manifests and config, if one exists.")
    retrain: bool = Field(default=False, description="Train again even if a finished "
                          "checkpoint of the same manifests, data, model and settings exists.")


@dg.asset(
    partitions_def=dataset_partitions,
    deps=["shard_manifests"],
    group_name="training",
    kinds={"pytorch", "huggingface"},
    code_version="1",
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
    manifests (by content hash), base model, config and git commit. Trained by ``torchrun`` with
    one rank per shard manifest; rank c's loss is multiplied by w_c. DESIGN.md step 5.
    """
    dataset = context.partition_key
    start = time.perf_counter()
    shards = latest_metadata(context, "shard_manifests")
    instructions = latest_metadata(context, "raw_instructions")
    subsets = latest_metadata(context, "peripheral_subsets")
    manifests = list(shards["manifest_paths"])
    world_size = len(manifests)
    if world_size % torchrun.nnodes:
        raise dg.Failure(f"{world_size} ranks cannot be split over {torchrun.nnodes} nodes")
    model_path = base_model.local_path(storage)
    run_dir = storage.work_dir("checkpoints", dataset)
    # Same manifests, data, model and settings -> same folder, so a re-executed run resumes
    # from the interrupted one's latest checkpoint.
    settings = json.dumps([model_path, instructions["table_version"],
                           config.model_dump(exclude={"retrain"})], sort_keys=True)
    output_dir = run_dir / (f"{shards['manifest_set_sha256'][:12]}-"
                            f"{hashlib.sha256(settings.encode()).hexdigest()[:8]}")
    train_cfg = TrainConfig(
        model_path=model_path,
        instructions_uri=str(instructions["table_uri"]),
        instructions_version=int(instructions["table_version"]),
        manifests=manifests,
        output_dir=str(output_dir),
        provenance={
            "dagster_run_id": context.run.run_id,
            "dataset": dataset,
            "manifest_set_sha256": shards["manifest_set_sha256"],
            "selector": subsets["selector"],
            "ratio": subsets["ratio"],
            "selection_seed": subsets.get("seed"),
            "data_fraction": subsets["data_fraction"],
            "pool_size": subsets["dagster/row_count"],
            "raw_instructions_version": instructions["table_version"],
            "peripheral_subsets_version": subsets["table_version"],
            "shard_manifests_version": shards["table_version"],
        },
        **config.model_dump(exclude={"retrain"}),
    )
    train_cfg.validate()
    cfg_path = run_dir / f"{output_dir.name}.config.json"
    train_cfg.dump(cfg_path)
    finished = output_dir / "training_info.json"
    reused = (
        not config.retrain and finished.exists()
        and [m["sha256"] for m in json.loads(finished.read_text())["manifests"]]
        == list(shards["manifest_sha256"])
    )
    if reused:
        # Training is deterministic given these inputs: the finished checkpoint is the answer.
        context.log.info(f"reusing {output_dir}: same manifests, data, model and settings "
                         "(set retrain: true to train again)")
        reported = {}
    else:
        reported = run_torchrun(context, pipes_subprocess_client, torchrun, TRAIN_MODULE,
                                world_size // torchrun.nnodes,
                                cfg_path).get_materialize_result().metadata or {}
    seconds = time.perf_counter() - start

    history = [json.loads(line) for line in Path(f"{output_dir}.metrics.jsonl").read_text().splitlines()]
    info = json.loads((output_dir / "training_info.json").read_text())
    selection_s = float(latest_metadata(context, "proxy_embeddings").get("embedding_seconds", 0.0))
    selection_s += sum(float(latest_metadata(context, a).get("seconds", 0.0))
                       for a in ("balanced_clusters", "peripheral_subsets", "shard_manifests"))
    curve = plots.loss_curves([h["step"] for h in history], [h["loss_per_rank"] for h in history])
    return dg.MaterializeResult(
        metadata={
            **reported,
            "reused_checkpoint": reused,
            "checkpoint_path": dg.MetadataValue.path(str(output_dir)),
            "base_model": model_path,
            "world_size": world_size,
            "manifest_sha256": dg.MetadataValue.json([m["sha256"] for m in info["manifests"]]),
            "manifest_set_sha256": shards["manifest_set_sha256"],
            "git_commit": str(info.get("git_commit")),
            "config": dg.MetadataValue.json(
                {k: v for k, v in info["config"].items() if k not in ("manifests", "provenance")}),
            "resumed_from_step": str(info.get("resumed_from_step")),
            "seconds": round(seconds, 2),
            "train_seconds": round(info["train_seconds"], 2),
            "samples_per_rank": int(shards["shard_size"]),
            "selection_seconds": round(selection_s, 2),
            "selection_vs_training": dg.MetadataValue.md(
                "| stage | seconds |\n|---|---|\n"
                f"| selection (embedding pass + clustering + subsets + shards) | {selection_s:.1f} |\n"
                f"| training | {info['train_seconds']:.1f} |\n"
            ),
            "loss_curve": dg.MetadataValue.md(plots.markdown_image(curve, "loss per rank")),
        },
    )
