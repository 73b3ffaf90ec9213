"""How a training rank holds the model: a DDP replica or FSDP2 shards, optionally LoRA adapters
(peft) and activation checkpointing; and how such a model is synchronised, saved and resumed.

The CluSTER method does not depend on any of it: rank c still reads cluster c and multiplies its
loss by w_c, and both DDP and FSDP2 average the ranks' gradients (DDP by all-reduce, FSDP2 by
reduce-scatter), so one step follows sum_c (n_c / N) g_c either way.

Memory per rank for full fine-tuning with AdamW in float32 (weights 4 + gradients 4 + Adam's two
moments 8 bytes per parameter, activations aside; the ZeRO paper's accounting, Rajbhandari et
al. 2020, section 3.1): DDP holds 16 bytes x P on every rank, FSDP2 16 x P / world size.
Activations (:func:`activation_bytes`) and the process itself are the same on every rank under
both. For FSDP2 to hold only its shards from the start, the model is built on the meta device,
sharded, and each rank reads its own rows of the weights (:func:`load_into_shards`); the
optimizer is created after that, so AdamW's moments are sharded too.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from cluster_pipeline.training.config import TrainSettings
from cluster_pipeline.training.kernels import decoder_layers


def apply_lora(model, cfg: TrainSettings):
    """Wrap ``model`` in peft LoRA adapters (rank ``lora_r``), seeded with ``cfg.seed`` so every
    rank starts from the same adapters; the base weights are frozen."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def check_lora_targets(model_path: str, cfg: TrainSettings) -> None:
    """Apply ``cfg``'s LoRA (:func:`apply_lora`, peft's own matching) to the model built on the
    meta device, no weights read, as every rank will: a target module that matches nothing
    fails here, before any process starts. A no-op without LoRA.

    Raises:
        ValueError: a target matches no module; names ``lora_target_modules`` and the model's
            linear modules.
    """
    if not cfg.lora_r:
        return
    from cluster_pipeline.models.loading import empty_model

    model = empty_model(model_path)
    try:
        apply_lora(model, cfg)
    except ValueError as e:
        linear = sorted(
            {
                n.rsplit(".", 1)[-1]
                for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
        )
        raise ValueError(
            f"lora_target_modules {cfg.lora_target_modules}: {str(e).splitlines()[0]} The "
            f"model's linear modules are {', '.join(linear)}."
        ) from e


def wrap(model, cfg: TrainSettings, device: torch.device):
    """The module a rank calls: ``model`` itself on one process, ``DistributedDataParallel``
    for ``parallelism: ddp``, or ``model`` sharded in place with FSDP2 ``fully_shard`` (each
    decoder layer inside it, then ``model`` as the root) for ``fsdp``, with bfloat16
    parameters and float32 gradient reduction when ``bf16`` is set on a GPU. ``model`` is the
    module whose forward a step calls: the training loop passes its
    :class:`~cluster_pipeline.training.kernels.CausalLMLoss` (decoder and loss in one
    forward), so DDP's and FSDP2's hooks see the loss's use of the head."""
    if not dist.is_initialized():
        return model
    if cfg.parallelism == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.bf16 and device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_fsdp(module) -> bool:
    """Whether ``module`` is sharded by FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def gradient_sync(module, enabled: bool) -> AbstractContextManager:
    """A context in which backward passes do (``enabled``) or do not synchronise gradients
    across ranks: DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return nullcontext() if enabled else module.no_sync()
    if is_fsdp(module):
        module.set_requires_gradient_sync(enabled)  # pyright: ignore[reportAttributeAccessIssue]
    return nullcontext()


def total_norm(norm) -> float:
    """``clip_grad_norm_``'s result as a float (a DTensor under FSDP2)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
