"""A rank's memory, estimated before launch and measured during the run: the one home.

- **Estimate** (:func:`check_training_memory`, used by the ``trained_checkpoint`` asset before
  any process starts): weights, gradients and AdamW state per trainable parameter
  (:data:`BYTES_PER_PARAMETER`, / K under FSDP2) plus activations (:func:`activation_bytes`).
- **Measurement**: resident memory (now and its high-water mark) and torch's own allocator
  figures at named points of a run (:class:`MemoryTrace`), so a benchmark can show what each
  phase costs; glibc's heap settings that keep freed buffers from staying resident.
"""

from __future__ import annotations

import ctypes
import resource
from typing import Any

from cluster_pipeline.training.config import TrainSettings

MIB = 2**20


def resident_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from ``/proc/self/status`` (Linux); elsewhere
    (0, ``ru_maxrss``). VmHWM is the peak resident memory so far, what ``ru_maxrss`` reports."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        return (
            int(fields["VmRSS"].split()[0]) * 1024,
            int(fields["VmHWM"].split()[0]) * 1024,
        )
    except (OSError, KeyError, ValueError):
        return 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_bytes() -> tuple[int, int]:
    """(peak resident bytes, peak CUDA bytes) of this process so far: VmHWM
    (:func:`resident_bytes`) and ``torch.cuda.max_memory_allocated`` of the current device (0
    without CUDA). What a pass's or a training run's cost record calls its peak memory."""
    import torch

    cuda = (
        int(torch.cuda.max_memory_allocated())
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else 0
    )
    return resident_bytes()[1], cuda


def release_free_heap() -> None:
    """Hand the heap pages glibc keeps after tensors are freed back to the kernel
    (``malloc_trim(0)``); a no-op where glibc is absent. Freed CPU tensors below glibc's mmap
    threshold stay resident in its arenas otherwise, and count in the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


MMAP_THRESHOLD = 256 * 1024  # bytes; glibc's default starts at 128 KiB and rises to 32 MiB
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def limit_heap_fragmentation(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve every allocation of ``threshold`` bytes or more (a CPU tensor above
    64K float32 values) with its own ``mmap``, returned to the kernel when freed; True when set.

    glibc raises its mmap threshold to the size of each mapped block freed, up to 32 MiB, so
    after the first step most tensors (activations, FSDP2's per-layer all-gather and
    reduce-scatter buffers, AdamW's temporaries) come from the heap, where freed blocks of
    one step's sizes stay resident while the next step, with other sequence lengths, asks
    for other sizes: the RSS peak grew step by step. Fixing the threshold stops that; each
    large allocation then costs fresh zeroed pages (a few seconds per step on the CPU). No-op
    where glibc is absent."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


class MemoryTrace:
    """Resident memory at named points of a run: ``mark("after wrap")`` records VmRSS, VmHWM
    and, on CUDA, the allocated and peak-allocated bytes of the current device (MiB)."""

    def __init__(self) -> None:
        self.marks: list[dict[str, Any]] = []

    def mark(self, label: str) -> None:
        """Record resident memory (now and peak) and torch's allocator figures under ``label``."""
        import torch

        rss, peak = resident_bytes()
        entry: dict[str, Any] = {
            "label": label,
            "rss_mib": round(rss / MIB, 1),
            "peak_rss_mib": round(peak / MIB, 1),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            entry["cuda_allocated_mib"] = round(torch.cuda.memory_allocated() / MIB, 1)
            entry["cuda_peak_mib"] = round(torch.cuda.max_memory_allocated() / MIB, 1)
        self.marks.append(entry)


BYTES_PER_PARAMETER = {"weights": 4, "gradients": 4, "adam": 8}


# Values a transformer layer keeps for backward per token and hidden unit: 34 bytes in 16-bit
# (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# section 4.1, eq. 1, without its 5as/h term: fused attention keeps no score matrix).
ACTIVATION_VALUES_PER_HIDDEN = 17


def parameter_count(model_path: str) -> int:
    """Parameters of the model at ``model_path`` (built on the meta device: no weights read)."""
    import torch
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
    import torch

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
