"""s2l's proxy run (selection/selectors/s2l.py; docs/design.md, step 3): the base model trained
briefly on the whole clustered pool, saved at T evenly spaced checkpoints whose per-sample
losses are the loss trajectories. Dagster-free: the ``peripheral_subsets`` stage builds the job
from here and launches ``recipes/train.py`` under torchrun as ``trained_checkpoint`` does.

- :func:`proxy_shards`: the pool dealt into random balanced shards, one per rank (token
  balance, every sample once, weight 1: selection/sharding.py's unclustered deal).
- :func:`proxy_settings`: the run's :class:`TrainSettings`: the embedding pass's sequence and
  packing settings (so the proxy sees each sample as the loss passes score it), ``max_steps``
  = S steps, a checkpoint every S / T steps, all T kept, no re-weighting, enough epochs for S
  steps (:func:`epochs_for_steps`).
- :func:`proxy_checkpoints`: the T checkpoints of a finished run, in step order: the
  ``step_<n>/`` intermediates (each a ``save_pretrained`` folder) and the final checkpoint.
- :func:`proxy_cost`: what the run cost, from its metrics file: sample visits (a forward and a
  backward pass each), tokens and training seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster_pipeline.selection.selectors import SelectionResult
from cluster_pipeline.selection.sharding import Allocation, allocate
from cluster_pipeline.training.checkpointing import (
    CheckpointDir,
    intermediate_dir,
    read_checkpoint,
    read_metrics,
)
from cluster_pipeline.training.config import EmbedSettings, TrainSettings

# The training seed of every proxy run: the proxy is shared by every selection seed (which
# seeds the k-means and the draw), so changing that seed reuses the proxy and its loss passes.
PROXY_SEED = 0
PROXY_SELECTOR = "s2l_proxy"  # the manifests' ``selector``


@dataclass(frozen=True)
class ProxyRun:
    """The knobs of one proxy run (``peripheral_subsets.s2l_*``).

    Attributes:
        steps: S, optimizer steps of the run.
        checkpoints: T, checkpoints saved, every S / T steps (S a multiple of T).
        learning_rate: the peak AdamW learning rate.
    """

    steps: int
    checkpoints: int
    learning_rate: float

    def __post_init__(self) -> None:
        if self.checkpoints < 1 or self.steps < 1 or self.steps % self.checkpoints:
            raise ValueError(
                f"the proxy's {self.steps} steps must be a positive multiple of its "
                f"{self.checkpoints} checkpoints"
            )

    @property
    def every(self) -> int:
        """Steps between two checkpoints, S / T."""
        return self.steps // self.checkpoints


def proxy_shards(
    dataset: str, sample_ids: np.ndarray, lengths: np.ndarray, world_size: int
) -> Allocation:
    """The pool dealt into ``world_size`` random balanced shards by tokens (each sample, in a
    seeded shuffle, to the rank with the fewest tokens so far; nothing dropped), weight 1.

    Args:
        dataset: the partition, recorded in the manifests.
        sample_ids: (N,) str the clustered pool.
        lengths: (N,) int64 tokens per sample (the embedding pass's count).
        world_size: W, the pool pass's ranks.

    Raises:
        ValueError: fewer samples than ranks.
    """
    n = len(sample_ids)
    ones = np.ones(n, dtype=np.int64)
    everything = SelectionResult(
        PROXY_SELECTOR,
        np.ones(n, dtype=bool),
        ones,
        np.arange(n, dtype=np.int64),
        np.ones(n),
        np.ones(world_size),
        n,
        "tokens",
    )
    labels = np.zeros(n, dtype=np.int64)
    return allocate(dataset, sample_ids, labels, everything, world_size, PROXY_SEED, lengths)


def epochs_for_steps(steps: int, allocation: Allocation, settings: TrainSettings) -> int:
    """Epochs enough for ``steps`` optimizer steps over these shards, packed or padded
    (training/plan.py's steps per epoch, lower bounds of both: packing falls back to padding
    for a model that cannot pack), plus one to spare."""
    n = [m.n_samples for m in allocation.manifests]
    tokens = allocation.tokens_per_rank
    accumulation = settings.gradient_accumulation_steps
    padded = math.ceil(max(n) / (settings.per_device_batch_size * accumulation))
    packed = max(
        1,
        min(math.ceil(max(tokens) / (accumulation * settings.max_tokens_per_micro_batch)), min(n)),
    )
    return math.ceil(steps / max(1, min(padded, packed))) + 1


def proxy_settings(embed: EmbedSettings, run: ProxyRun, allocation: Allocation) -> TrainSettings:
    """The proxy's training settings (module docstring): the pool pass's sequence, packing and
    bf16 settings; S steps, a checkpoint every S / T, all kept; the project's training defaults
    otherwise (cosine schedule, batch sizes), its learning rate ``run.learning_rate``."""
    base = TrainSettings(
        max_length=embed.max_length,
        truncation=embed.truncation,
        response_turns=embed.response_turns,
        packing=embed.packing,
        max_packed_length=embed.max_packed_length,
        bf16=embed.bf16,
        max_steps=run.steps,
        save_every_steps=run.every,
        keep_checkpoints=run.checkpoints,
        learning_rate=run.learning_rate,
        reweight=False,
        seed=PROXY_SEED,
        grad_cosine_every=None,
    )
    return base.model_copy(update={"epochs": epochs_for_steps(run.steps, allocation, base)})


@dataclass(frozen=True)
class ProxyCheckpoint:
    """One checkpoint of the proxy: its folder (``from_pretrained`` loads it) and its step."""

    path: Path
    step: int


def proxy_checkpoints(output_dir: Path) -> list[ProxyCheckpoint]:
    """The checkpoints of a finished proxy run, in step order: the intermediate ``step_<n>/``
    folders, then the final checkpoint ([] when the run has not finished)."""
    final = read_checkpoint(output_dir)
    if final is None:
        return []
    found = [
        ProxyCheckpoint(p, int(p.name.split("_")[-1]))
        for p in CheckpointDir(intermediate_dir(output_dir)).all()
    ]
    return [*found, ProxyCheckpoint(output_dir, int(final.info.get("steps", 0)))]


@dataclass(frozen=True)
class ProxyCost:
    """What a proxy run cost: sample visits over all steps and ranks (one forward and one
    backward pass each), their real tokens, the training seconds (resumed runs included) and
    the visits of the steps this launch ran (0 when the finished run was reused), and the
    largest rank's peak resident and CUDA memory (bytes; None for a run saved before
    2026-12-02 without them)."""

    samples: int
    tokens: int
    seconds: float
    run_now: int
    peak_rss_bytes: int | None = None
    peak_cuda_bytes: int | None = None


def proxy_cost(output_dir: Path, trained_now: bool) -> ProxyCost:
    """The cost of the finished proxy run at ``output_dir`` from its metrics and
    ``training_info.json``; ``trained_now``: this launch trained (from its resume step on)."""
    history = read_metrics(output_dir)
    ckpt = read_checkpoint(output_dir)
    info = ckpt.info if ckpt is not None else {}
    visits = [sum(h.get("samples_per_rank", [])) for h in history]
    resumed = int(info.get("resumed_from_step") or 0)
    return ProxyCost(
        samples=int(sum(visits)),
        tokens=int(sum(sum(h.get("real_tokens_per_rank", [])) for h in history)),
        seconds=float(info.get("train_seconds") or 0.0),
        run_now=int(sum(visits[resumed:])) if trained_now else 0,
        peak_rss_bytes=_largest(info.get("peak_rss_bytes_per_rank")),
        peak_cuda_bytes=_largest(info.get("peak_cuda_bytes_per_rank")),
    )


def _largest(per_rank: list | None) -> int | None:
    return int(max(per_rank)) if per_rank else None


# less's warm-up (selection/selectors/less.py): the same machinery on a random share of the
# pool (less.warmup_share), with LoRA adapters and the optimizer state kept at every checkpoint.


def warmup_settings(
    embed: EmbedSettings, run: ProxyRun, lora_r: int, allocation: Allocation
) -> TrainSettings:
    """The warm-up's training settings: :func:`proxy_settings` with LoRA rank ``lora_r``, all C
    step folders kept and the last one written too (``save_final_state``), so each of the C
    checkpoints holds its adapter and AdamW state.

    Raises:
        ValueError: ``lora_r`` < 1.
    """
    if lora_r < 1:
        raise ValueError(f"the warm-up's LoRA rank {lora_r} must be >= 1")
    base = proxy_settings(embed, run, allocation)
    return base.model_copy(update={"lora_r": lora_r, "save_final_state": True})


def warmup_checkpoints(output_dir: Path) -> list[ProxyCheckpoint]:
    """The step folders of a finished warm-up (adapter and ``training_state.pt`` each), in step
    order ([] when the run has not finished)."""
    if read_checkpoint(output_dir) is None:
        return []
    return [
        ProxyCheckpoint(p, int(p.name.split("_")[-1]))
        for p in CheckpointDir(intermediate_dir(output_dir)).all()
    ]


def mean_learning_rates(settings: TrainSettings, total_steps: int, steps: list[int]) -> list[float]:
    """eta_i of each checkpoint: the mean learning rate of the optimizer steps since the
    previous checkpoint (steps ``steps[i-1] + 1 .. steps[i]``, 1-based), under the run's
    schedule (training/loop.lr_lambda: the lr of step s is peak x f(s - 1)); LESS's eta-bar_i,
    the mean over the epoch ending at checkpoint i."""
    from cluster_pipeline.training.loop import lr_lambda

    f = lr_lambda(settings.schedule, int(settings.warmup_ratio * total_steps), total_steps)
    out, previous = [], 0
    for step in steps:
        rates = [settings.learning_rate * f(s - 1) for s in range(previous + 1, step + 1)]
        out.append(float(np.mean(rates)) if rates else 0.0)
        previous = step
    return out
