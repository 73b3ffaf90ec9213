"""One optimizer step's forward and backward passes on one rank: the loss, the micro-batch
tensors, and where the seconds go.

torch only (no pydantic, polars or Dagster): the throughput benchmark's timing core runs this
same code on machines that have nothing else (``benchmarks/training_throughput.py``).

Rank c's loss for a micro-batch is ``w_c x (cross-entropy summed over the micro-batch's
targets) / (targets of the rank's whole step)``, so the step's gradient is w_c times the
gradient of the token-mean loss over the rank's step however the step is cut into micro-batches
(docs/design.md, step 5). Packed micro-batches carry no attention mask; their position ids keep
the samples apart (data/packing.py), and on a GPU their sample boundaries drive the
variable-length attention kernel (data/attention.py). The model called is either the causal LM
itself (its logits, then :func:`token_loss_sum`) or a
:class:`~cluster_pipeline.training.kernels.CausalLMLoss` around it (the summed loss without
whole-vocabulary logits), either of them possibly inside DDP or FSDP2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cluster_pipeline.data.attention import forward_kwargs
from cluster_pipeline.data.packing import (
    IGNORE_INDEX,
    TokenSample,
    collate_rows,
    padded_tokens,
    real_tokens,
)
from cluster_pipeline.training.kernels import CausalLMLoss, token_loss_sum
from cluster_pipeline.training.plan import MicroBatch, Step


def targets(sample: TokenSample) -> int:
    """Response tokens of a sample that are a prediction target (labels[1:] != -100; the first
    position predicts nothing): what the token-mean loss divides by."""
    return sum(1 for label in sample.labels[1:] if label != IGNORE_INDEX)


def loss_sum(model, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The summed float32 cross-entropy over one collated batch's targets (CPU tensors, moved
    to ``device`` here): through :class:`~cluster_pipeline.training.kernels.CausalLMLoss`
    where ``model`` is one (DDP or FSDP2 around it or not), else from the model's logits. ()
    float32."""
    inputs = forward_kwargs(model, batch, device)
    labels = batch["labels"].to(device)
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if isinstance(inner, CausalLMLoss):
        return model(labels=labels, **inputs)
    return token_loss_sum(model(**inputs).logits, labels)


def weighted_loss(
    model, batch: dict[str, torch.Tensor], weight: float, step_targets: int, device=None
):
    """Rank loss for one micro-batch (module docstring): ``batch`` as collated (CPU tensors;
    ``device`` where the model is, default the batch's own).

    Returns (loss to backpropagate, detached summed cross-entropy, targets in the batch).
    """
    device = device if device is not None else batch["input_ids"].device
    total = loss_sum(model, batch, device)
    return (
        total * (weight / max(step_targets, 1)),
        total.detach(),
        int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()),
    )


def batch_tensors(
    samples: Sequence[TokenSample], mb: MicroBatch, pad_token_id: int, packed: bool
) -> dict[str, torch.Tensor]:
    """The tensors of one planned micro-batch: packed rows (no attention mask), padded rows
    with a mask, or for a placeholder one padding token that is no target."""
    if mb.placeholder:
        one = torch.zeros((1, 1), dtype=torch.long)
        return {
            "input_ids": one + pad_token_id,
            "labels": one + IGNORE_INDEX,
            "position_ids": one,
            "sample_index": one - 1,
        }
    return collate_rows(samples, mb.rows, pad_token_id, packed=packed)


def clock(device: torch.device) -> float:
    """Seconds now, after the device's queued work has finished (GPU kernels run async)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass(frozen=True)
class Accumulated:
    """What one rank's step did: summed cross-entropy and targets, real and tensor tokens
    (padding and placeholders included), and the seconds it waited for the other ranks."""

    loss_sum: float
    targets: int
    real_tokens: int
    padded_tokens: int
    wait_seconds: float


def accumulate(
    model,
    step: Step,
    samples: Sequence[TokenSample],
    pad_token_id: int,
    packed: bool,
    weight: float,
    device: torch.device,
    sync: Callable[[bool], AbstractContextManager],
    bf16: bool = False,
) -> Accumulated:
    """Forward and backward over a step's micro-batches, gradients accumulated in ``.grad``.

    ``sync(last)`` is the context each backward runs in (DDP's ``no_sync`` / FSDP2's gradient
    sync switch: only the last micro-batch synchronises). Before that synchronising backward
    every rank meets at a barrier: the seconds it waits there are the time it idles for the
    slowest rank; communication inside the synchronising backward counts as compute. Under
    FSDP the ranks also meet at every micro-batch's parameter all-gather, so the barrier's wait
    is a lower bound there. Collective when a process group is initialised.
    """
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    step_targets = sum(targets(samples[i]) for i in step.samples)
    loss_sum, tokens, real, padded, wait = 0.0, 0, 0, 0, 0.0
    for j, mb in enumerate(step.micro_batches):
        batch = batch_tensors(samples, mb, pad_token_id, packed)
        real, padded = real + real_tokens(batch), padded + padded_tokens(batch)
        last = j == len(step.micro_batches) - 1
        with sync(last), autocast:
            loss, raw, n_tok = weighted_loss(model, batch, weight, step_targets, device)
            if last and dist.is_initialized():
                arrived = clock(device)
                dist.barrier()
                wait = time.perf_counter() - arrived
            loss.backward()
        loss_sum += float(raw)
        tokens += n_tok
    return Accumulated(loss_sum, tokens, real, padded, wait)
