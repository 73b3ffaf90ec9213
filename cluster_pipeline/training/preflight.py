"""What the ``trained_checkpoint`` stage checks and decides before any process starts: that the
ranks divide over the torchrun agents, that the model fits (memory, LoRA targets), and the
deterministic folder a run's checkpoint goes to. Dagster-free, so tests call it directly. (That
each rank's manifest file is the one ``shard_manifests`` recorded is checked first, by
``selection/sharding.read_recorded_manifests``, the function the export uses too.)

The rules about settings (each knob's bounds, rules across stages) are not here: they are
``defs/run_checks.py``'s, which the run's executor and each GPU stage apply."""

from __future__ import annotations

import sys
from pathlib import Path

from cluster_pipeline.storage.cache import stable_hash
from cluster_pipeline.training.config import SPEED_ONLY_SETTINGS, TrainSettings
from cluster_pipeline.training.memory import (
    MemoryEstimate,
    ModelShape,
    available_bytes_per_rank,
    check_training_memory,
)


def check_training_fits(
    model_path: str, settings: TrainSettings, world_size: int, agents: int, remote: bool
) -> MemoryEstimate:
    """Refuse a run that cannot start: ``world_size`` ranks not divisible over ``agents``
    torchrun agents, a model that does not fit in this machine's memory per rank (weights,
    gradients, AdamW state, activations; ``remote`` machines such as Slurm nodes are not
    checked), or LoRA target modules that match nothing.

    Returns:
        The estimated peak per rank (:func:`~cluster_pipeline.training.memory.
        training_estimate`).

    Raises:
        ValueError: the ranks do not divide, or unknown LoRA targets (the message lists the
            model's linear modules).
        TrainingMemoryError: it would not fit; the message gives each way to fit.
    """
    from cluster_pipeline.training.parallel import check_lora_targets  # torch.distributed

    if world_size % agents:
        raise ValueError(
            f"{world_size} ranks cannot be split over {agents} torchrun agents (nodes): make "
            "the number of clusters a multiple of it"
        )
    available = sys.maxsize if remote else available_bytes_per_rank(world_size // agents)
    needed = check_training_memory(ModelShape.of(model_path), settings, world_size, available)
    check_lora_targets(model_path, settings)
    return needed


def checkpoint_folder(
    run_dir: Path,
    manifest_set_sha256: str,
    model_path: str,
    data_fingerprint: str,
    settings: TrainSettings,
) -> Path:
    """``<run_dir>/<manifest set hash[:12]>-<hash of model, data and settings>``: the same
    manifests, sample contents, model and settings give the same folder, so a re-executed run
    resumes from the interrupted one's latest checkpoint and a finished one is reused, also after
    raw_instructions was re-materialized with unchanged data (a new table version). The
    settings that change only a step's speed (:data:`~cluster_pipeline.training.config.
    SPEED_ONLY_SETTINGS`) are left out: the folder of a run is the one it had before they
    existed."""
    identity = settings.model_dump(exclude=set(SPEED_ONLY_SETTINGS))
    digest = stable_hash(model_path, data_fingerprint, identity, length=8)
    return run_dir / f"{manifest_set_sha256[:12]}-{digest}"
