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

import copy
import math
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cluster_pipeline.training.config import TrainSettings

ADAPTER_DIR = "adapter"  # the LoRA adapter, beside the merged weights of a checkpoint
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name for adapter weights
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint files of an FSDP intermediate checkpoint
BYTES_PER_PARAMETER = {"weights": 4, "gradients": 4, "adam": 8}
# Values a transformer layer keeps for backward per token and hidden unit: 34 bytes in 16-bit
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# section 4.1, eq. 1, without its 5as/h term: fused attention keeps no score matrix).
ACTIVATION_VALUES_PER_HIDDEN = 17


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


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a ``transformers`` model (its ``_no_split_modules`` classes,
    e.g. ``LlamaDecoderLayer``): the units FSDP2 shards one by one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap(model, cfg: TrainSettings, device: torch.device):
    """The module a rank calls: the model itself on one process, ``DistributedDataParallel``
    for ``parallelism: ddp``, or the model sharded in place with FSDP2 ``fully_shard`` (each
    decoder layer, then the root) for ``fsdp``, with bfloat16 parameters and float32 gradient
    reduction when ``bf16`` is set on a GPU."""
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


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


class SafetensorsRows:
    """Reads row ranges of the tensors in safetensors files with plain reads, not ``mmap``:
    pages of a mapped file count in the reader's resident memory (and its peak) until it is
    unmapped, read pages do not. Format: an 8-byte little-endian header length, a JSON header
    giving each tensor's dtype, shape and byte offsets, then the data, row-major
    (huggingface/safetensors, README "Format")."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def entry(self, name: str) -> tuple[Path, int, dict[str, Any]]:
        """(file, byte offset of the tensor's data, its header entry)."""
        import json
        import struct

        if name not in self.files:
            raise KeyError(f"the checkpoint has no tensor {name!r} for the model's parameter")
        file = self.files[name]
        if file not in self.headers:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self.headers[file] = (8 + length, json.loads(f.read(length)))
        data_start, header = self.headers[file]
        meta = header[name]
        return file, data_start + meta["data_offsets"][0], meta

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entry(name)[2]["shape"])

    def read_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Copy rows ``start : start + out.shape[0]`` of tensor ``name`` into ``out`` (a
        CPU or GPU tensor of the tensor's trailing shape, any float dtype)."""
        file, offset, meta = self.entry(name)
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        row_bytes = math.prod(meta["shape"][1:]) * dtype.itemsize
        direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        buffer = out if direct else torch.empty(out.shape, dtype=dtype)
        with open(file, "rb", buffering=0) as f:
            f.seek(offset + start * row_bytes)
            f.readinto(buffer.reshape(-1).view(torch.uint8).numpy())  # pyright: ignore[reportArgumentType]
        if not direct:
            out.copy_(buffer)


@torch.no_grad()
def load_into_shards(model, files: dict[str, Path], device: torch.device) -> None:
    """Fill the parameters of a model built on the meta device (``modeling.empty_model``) and
    sharded with :func:`wrap`, each rank reading from the safetensors ``files`` (tensor name ->
    file) only the rows of its own shard (:class:`SafetensorsRows`): no rank ever holds the
    full weights, only its shards. Buffers keep the values they were built with. Works
    unsharded too (every row). What torchtune's ``load_from_full_model_state_dict`` does,
    without a full state dict on rank 0 to scatter from.

    Raises:
        KeyError: a parameter of the model has no tensor in ``files``.
        ValueError: a tensor's shape differs from its parameter's, or a parameter is sharded
            otherwise than FSDP2's default (rows, dim 0).
    """
    from torch.distributed.tensor import DTensor, Shard

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    for name, b in model.named_buffers():
        b.copy_(buffers[name])
    reader = SafetensorsRows(files)
    for name, param in model.named_parameters():
        if reader.shape(name) != tuple(param.shape):
            raise ValueError(
                f"{name}: {reader.shape(name)} in the checkpoint, {tuple(param.shape)} in the model"
            )
        local, start = param, 0
        if isinstance(param, DTensor):
            if tuple(param.placements) != (Shard(0),):
                raise ValueError(f"{name} is sharded as {param.placements}, not by rows")
            local = param.to_local()
            rows = -(-param.shape[0] // param.device_mesh.size())  # torch.chunk's chunk size
            start = param.device_mesh.get_local_rank() * rows
        if local.numel():
            reader.read_into(name, start, local)


def is_fsdp(module) -> bool:
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


def full_state_dict(model) -> dict[str, Any]:
    """The unsharded model state on CPU (collective under FSDP2: every rank must call it; rank 0
    gets the tensors)."""
    if not is_fsdp(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def export_model(model, state: dict[str, Any]):
    """A plain ``transformers`` model holding ``state`` that ``save_pretrained`` writes as the
    base architecture (an FSDP2-sharded model's class is a generated subclass; LoRA adapters are
    merged into the weights)."""
    from transformers import AutoModelForCausalLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # A copy: peft's merge below edits the config it is given.
    config = copy.deepcopy(base.config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    lora = getattr(model, "peft_config", None)
    if lora:  # load into a peft copy, then merge the adapters into the weights
        from peft import get_peft_model

        plain = get_peft_model(plain, lora["default"])
    # strict=False: a state gathered from shards may list tied weights (lm_head) once.
    plain.load_state_dict(state, strict=False, assign=True)
    if lora:
        plain = plain.merge_and_unload()
    plain.tie_weights()
    if tied:
        # The gathered state holds the tied matrices as two tensors, and peft's merge then
        # unties them (clearing the config flag): tie them again, so the export keeps the base
        # architecture (one embedding matrix, not two).
        plain.config.tie_word_embeddings = True
        output = plain.get_output_embeddings()
        if output is not None:
            output.weight = plain.get_input_embeddings().weight
    empty = [name for name, p in plain.named_parameters() if p.is_meta]
    if empty:
        raise RuntimeError(f"the gathered state has no value for {empty[:3]} ({len(empty)} in all)")
    return plain


def adapter_config(model) -> dict[str, Any] | None:
    """A LoRA model's peft adapter config as a JSON-ready dict (sets as sorted lists; None for
    a model without adapters)."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    return {
        k: sorted(v) if isinstance(v, set) else v for k, v in configs["default"].to_dict().items()
    }


def save_adapter(model, state: dict[str, Any], out_dir: Path) -> None:
    """Save a LoRA model's adapter in peft's format (``adapter_config.json``,
    ``adapter_model.safetensors``) under ``out_dir/adapter``; nothing for other models."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = out_dir / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    configs["default"].save_pretrained(str(folder))
    adapter = get_peft_model_state_dict(model, state_dict=state)
    save_file({k: v.contiguous() for k, v in adapter.items()}, str(folder / ADAPTER_WEIGHTS))


def load_adapter(model, folder: Path) -> None:
    """Load the adapter weights a peft ``save_pretrained`` wrote to ``folder`` into ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(str(folder / ADAPTER_WEIGHTS)))


def save_sharded(model, optimizer, folder: Path) -> None:
    """Model and optimizer state, sharded as FSDP2 holds them, with
    ``torch.distributed.checkpoint`` (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model_state, optim_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))


def load_sharded(model, optimizer, folder: Path) -> None:
    """Restore what :func:`save_sharded` wrote into an FSDP2 model and its optimizer
    (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def parameter_count(model_path: str) -> int:
    """Parameters of the model at ``model_path`` (built on the meta device: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def training_bytes_per_rank(
    n_parameters: int, n_trainable: int, parallelism: str, world_size: int
) -> int:
    """Estimated bytes one rank holds for fine-tuning with AdamW in float32, activations aside
    (see the module docstring): 4 x P for the weights plus (4 + 8) x T for the gradients and
    Adam's moments of the T trainable parameters (T = P for full fine-tuning, the adapters'
    count, about 0, for LoRA); all of it on every rank under DDP, divided by world_size under
    FSDP2."""
    total = (
        BYTES_PER_PARAMETER["weights"] * n_parameters
        + (BYTES_PER_PARAMETER["gradients"] + BYTES_PER_PARAMETER["adam"]) * n_trainable
    )
    return total // world_size if parallelism == "fsdp" else total


def activation_bytes(model_path: str, cfg: TrainSettings) -> int:
    """Estimated bytes of activations one rank keeps for backward, the same under DDP and
    FSDP2 (each rank runs its own micro-batch), a stated approximation: tokens per micro-batch
    (packed: ``max_tokens_per_micro_batch``, or ``max_length`` for a longer sample alone;
    padded: ``per_device_batch_size`` x ``max_length``, an upper bound: batches are padded to
    their longest sample) x 4 bytes x (layers x hidden x :data:`ACTIVATION_VALUES_PER_HIDDEN`,
    the layers' activations, + 2 x vocabulary, the float32 logits and the log-softmax the loss
    keeps). With gradient checkpointing the layers keep only their inputs (hidden values per
    token) and one layer at a time its full activations. Measured on SmolLM2-135M at 2 x 128
    tokens: 0.37 GiB estimated, about 0.3 GiB of RSS growth in the forward pass besides FSDP2's
    gathered embedding (benchmarks/RESULTS.md, training_memory)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    layers, hidden = config.num_hidden_layers, config.hidden_size
    tokens = (
        max(cfg.max_tokens_per_micro_batch, cfg.max_length)
        if cfg.packing
        else cfg.per_device_batch_size * cfg.max_length
    )
    per_layer = ACTIVATION_VALUES_PER_HIDDEN * hidden
    values = (
        layers * hidden + per_layer if cfg.gradient_checkpointing else layers * per_layer
    ) + 2 * config.vocab_size
    return tokens * values * 4


class TrainingMemoryError(RuntimeError):
    """The estimated training memory per rank exceeds what the machine has."""


def available_bytes_per_rank(local_ranks: int) -> int:
    """Memory one of ``local_ranks`` ranks on this machine can use: the smallest GPU's total
    memory when CUDA is available, else the available host memory (``psutil``) / local_ranks."""
    if torch.cuda.is_available():
        return min(
            torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())
        )
    import psutil

    return psutil.virtual_memory().available // max(local_ranks, 1)


def check_training_memory(
    n_parameters: int,
    cfg: TrainSettings,
    world_size: int,
    available_per_rank: int,
    activations: int = 0,
    checkpointed_activations: int | None = None,
) -> int:
    """The estimated bytes per rank (:func:`training_bytes_per_rank`; LoRA counts no trainable
    parameters) plus ``activations`` (:func:`activation_bytes`; 0: left aside), checked against
    ``available_per_rank``. A lower bound: the process itself (Python, torch, the tokenizer:
    about 0.5 GiB on the CPU) is not counted.

    Raises:
        TrainingMemoryError: the estimate exceeds ``available_per_rank``; the message gives
            both in GiB and each way to fit with its own estimate, saying which would not fit
            alone: fsdp, LoRA, gradient checkpointing (``checkpointed_activations``: the
            activations with it), a smaller batch or max_length, more ranks or memory.
    """
    trainable = 0 if cfg.lora_r else n_parameters
    need = training_bytes_per_rank(n_parameters, trainable, cfg.parallelism, world_size)
    need += activations
    if need <= available_per_rank:
        return need
    gib = 2**30

    def way(setting: str, estimate: int) -> str:
        short = "" if estimate <= available_per_rank else ", not enough alone"
        return f"{setting} ({estimate / gib:.1f} GiB per rank{short})"

    weights = need - activations
    ways = []
    if cfg.parallelism != "fsdp" and world_size > 1:
        fsdp = training_bytes_per_rank(n_parameters, trainable, "fsdp", world_size)
        ways.append(way("parallelism: fsdp", fsdp + activations))
    if not cfg.lora_r:
        lora = training_bytes_per_rank(n_parameters, 0, cfg.parallelism, world_size)
        ways.append(way("lora_r > 0", lora + activations))
    if checkpointed_activations is not None and not cfg.gradient_checkpointing:
        ways.append(way("gradient_checkpointing: true", weights + checkpointed_activations))
    if activations:
        ways.append(
            "a smaller max_tokens_per_micro_batch or max_length (activations grow with both)"
            if cfg.packing
            else "a smaller per_device_batch_size or max_length (activations grow with both)"
        )
    ways.append(
        "more ranks (balanced_clusters.num_clusters)"
        if cfg.parallelism == "fsdp"
        else "a machine with more memory"
    )
    raise TrainingMemoryError(
        f"training needs about {need / gib:.1f} GiB per rank ({n_parameters / 1e6:.0f}M "
        f"parameters, parallelism {cfg.parallelism}{', LoRA' if cfg.lora_r else ''}, "
        f"{world_size} ranks; "
        + (f"{activations / gib:.1f} GiB of it activations" if activations else "activations aside")
        + f") but {available_per_rank / gib:.1f} GiB is available per rank; use "
        + ", or ".join(ways)
    )
