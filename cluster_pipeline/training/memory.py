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
import json
import math
import resource
import struct
from dataclasses import dataclass
from pathlib import Path
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
GIB = 2**30

# --- What the estimates count (calibrated: benchmarks/memory_estimate.py, RESULTS.md) ----------
#
# A rank is a Python process that holds, besides the model: the interpreter, torch, transformers
# and their libraries, the tokenizer, the job's rows and (training) gloo and the optimizer's
# code. Measured (2026-12-05) as the peak of each stage's ranks on the end-to-end tests' tiny
# Llama (44,192 parameters): the embedding pass and evaluation 0.50 GiB, training 0.50 GiB
# (0.63 on rank 0, which also tracks the run in MLflow); torch and transformers alone are 0.33
# GiB at a rank's start. Training's figure is set to SmolLM2-135M's full run (5.68 GiB
# measured), inference's to its embedding pass and evaluation (1.61-1.75 GiB).
PROCESS_BYTES = {"embed": int(0.45 * GIB), "train": int(0.55 * GIB), "evaluate": int(0.45 * GIB)}
# Float32 values a Llama decoder layer keeps per token for its backward pass, by the width they
# scale with (counted from its forward: the two RMSNorms' inputs and outputs, q and k before
# and after the rotary embedding, k and v repeated to every head, the attention output and the
# o_proj input: about 12 hidden-wide values; gate, up, SiLU(gate) and their product: 4
# MLP-wide values; and the attention probabilities, heads x the row's length, which CPU
# attention with a mask keeps). Korthikanti et al. 2022 (section 4.1, eq. 1) count the same
# tensors in 16 bits for a GPT layer (34 sbh + 5as^2 b); this is its float32, SwiGLU, GQA form.
TRAIN_VALUES_PER_HIDDEN = 12
TRAIN_VALUES_PER_INTERMEDIATE = 4
TRAIN_SCORE_COPIES = 1
# Inference (embedding pass, evaluation) keeps nothing for backward: its peak is one layer's
# transients for the whole batch (the MLP's 3 intermediate-wide tensors, a few hidden-wide ones
# and the attention scores, their softmax and the masked copy) or, after the last layer, the
# LM head's chunk of logits, whichever is larger: the layer's are freed before the head runs.
FORWARD_VALUES_PER_HIDDEN = 6
FORWARD_VALUES_PER_INTERMEDIATE = 3
FORWARD_SCORE_COPIES = 3
# The LM head's logits per row of a chunk, in float32: the logits, their log-softmax (or
# softmax) and, in training, its gradient.
LOGIT_COPIES = {"forward": 2, "train": 3}
# The chunked loss's rows per chunk in training (training/kernels.py); the embedding pass and
# evaluation use EmbedJob.lm_head_chunk_rows (1,024).
LOSS_CHUNK_ROWS = 1024


def parameter_count(model_path: str) -> int:
    """Parameters of the model at ``model_path``: the elements of the tensors its safetensors
    files hold, read from their headers (:func:`stored_parameter_count`), where the folder has
    them; else the model built on the meta device (no weights read, but transformers and torch
    imported: about 6 s in a fresh process)."""
    stored = stored_parameter_count(model_path)
    if stored is not None:
        return stored
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def stored_parameter_count(model_path: str) -> int | None:
    """The elements of every tensor in the safetensors files of the folder ``model_path``
    (``model.safetensors``, or the shards ``model.safetensors.index.json`` names), read from each
    file's header: 8 bytes (little-endian u64) giving the JSON header's length, then the JSON
    ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`` (the safetensors
    format, huggingface/safetensors). ``save_pretrained`` stores tied weights once and no
    non-persistent buffer, so this is the parameter count P. None where the folder has no
    safetensors file (a hub id, ``*.bin`` weights, a config alone)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    total = 0
    for name in files:
        with open(folder / name, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for key, t in header.items() if key != "__metadata__")
    return total


@dataclass(frozen=True)
class ModelShape:
    """What a rank's memory depends on in a causal LM, from its config (no weights read).

    Attributes:
        parameters: P, every parameter (tied embeddings once).
        layers, hidden, intermediate: decoder layers, hidden width h, MLP width.
        heads: attention (query) heads.
        vocab: vocabulary size V (the LM head's rows).
    """

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int

    @classmethod
    def of(cls, model_path: str) -> ModelShape:
        """The shape of the model at ``model_path`` (a ``save_pretrained`` folder)."""
        config = _text_config(model_path)
        hidden = int(config["hidden_size"])
        return cls(
            parameters=parameter_count(model_path),
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            intermediate=int(config.get("intermediate_size") or 4 * hidden),
            heads=int(config.get("num_attention_heads") or 1),
            vocab=int(config["vocab_size"]),
        )


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


def _text_config(model_path: str) -> dict[str, Any]:
    """The text model's config of ``model_path`` as a dict: its ``config.json`` read as JSON
    (its ``text_config`` for a multimodal model, as ``PretrainedConfig.get_text_config``) where
    that holds the standard keys, which costs nothing; else transformers' ``AutoConfig`` (a hub
    id, a config naming widths by other keys, such as GPT-2's ``n_embd``), which imports
    transformers and torch (about 6 s in a fresh process)."""
    path = Path(model_path) / "config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        config = config.get("text_config") or config
        if all(config.get(key) for key in _SHAPE_KEYS):
            return config
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path).get_text_config()
    # Attribute access follows the config's attribute_map (GPT-2's n_embd -> hidden_size).
    keys = (*_SHAPE_KEYS, "intermediate_size", "num_attention_heads")
    return {key: getattr(config, key, None) for key in keys}


@dataclass(frozen=True)
class MemoryEstimate:
    """A rank's estimated peak resident memory, part by part (bytes), in the order counted."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        """The estimate: the parts' sum, bytes."""
        return sum(b for _, b in self.parts)

    def part(self, name: str) -> int:
        """The bytes of part ``name`` (0 when not counted)."""
        return sum(b for n, b in self.parts if n == name)

    def text(self) -> str:
        """``"5.61 GiB: process 0.55 + weights 0.50 + ..."`` (GiB)."""
        shown = " + ".join(f"{n} {b / GIB:.2f}" for n, b in self.parts if b)
        return f"{self.total / GIB:.2f} GiB: {shown}"


def _batch_forward_bytes(shape: ModelShape, tokens: int, row: int, chunk_rows: int) -> int:
    """One forward pass's transients for a batch of ``tokens`` tokens in rows of ``row``,
    float32 bytes: a layer's (:data:`FORWARD_VALUES_PER_HIDDEN` ...) or the LM head's chunk of
    logits, whichever is larger (they are not alive at once)."""
    layer = tokens * (
        FORWARD_VALUES_PER_HIDDEN * shape.hidden
        + FORWARD_VALUES_PER_INTERMEDIATE * shape.intermediate
        + FORWARD_SCORE_COPIES * shape.heads * row
    )
    logits = LOGIT_COPIES["forward"] * min(tokens, chunk_rows) * shape.vocab
    return 4 * max(layer, logits)


def _loading_bytes(shape: ModelShape) -> int:
    """What loading a model holds beside its parameters until ``from_pretrained`` returns: the
    checkpoint's float32 tensors, 4 bytes a parameter (SmolLM2-135M's embedding pass peaks at
    1.61 GiB with 4,096-token batches and 1.67 with 8,192: most of the peak does not grow with
    the batch; RESULTS.md, "Memory per rank, estimated and measured")."""
    return 4 * shape.parameters


def embedding_estimate(
    model_path: str | ModelShape, cfg: Any, tokens: int | None = None
) -> MemoryEstimate:
    """The embedding pass's peak per rank (``cfg``: EmbedSettings), bytes: the process, the
    float32 weights and the largest transient: one batch's forward (``max_batch_tokens`` in rows
    of ``max_packed_length``; padded: ``max_batch_tokens`` padded tokens in rows of
    ``max_length``; or the LM head's chunk of 1,024 rows) or the checkpoint's copy while the
    model loads (:func:`_loading_bytes`), whichever is larger. ``tokens``: the pass's tokens
    where known (a batch holds at most these; a small pool never fills one)."""
    shape = model_path if isinstance(model_path, ModelShape) else ModelShape.of(model_path)
    batch_tokens = min(cfg.max_batch_tokens, tokens or cfg.max_batch_tokens)
    row = min(cfg.max_packed_length if cfg.packing else cfg.max_length, batch_tokens)
    batch = _batch_forward_bytes(shape, batch_tokens, row, 1024)
    return MemoryEstimate(
        (
            ("process", PROCESS_BYTES["embed"]),
            ("weights", 4 * shape.parameters),
            ("transient", max(batch, _loading_bytes(shape))),
        )
    )


def evaluation_estimate(
    model_path: str | ModelShape, cfg: Any, tokens: int | None = None
) -> MemoryEstimate:
    """Evaluation's peak (``cfg``: EvalSettings), one process for every model, bytes: the
    process, the float32 weights of the model evaluated and the largest transient: the
    likelihood passes' batch (as the embedding pass's: 8,192 tokens in rows of
    ``max_packed_length``), the generation's key-value cache (``batch_size`` x (``max_length`` +
    ``max_new_tokens``) positions x layers x 2 x hidden, an upper bound under grouped-query
    attention) or the checkpoint's copy while a model loads, whichever is larger. ``tokens``:
    the held-out pass's tokens where known (at most sequences x ``max_length``)."""
    shape = model_path if isinstance(model_path, ModelShape) else ModelShape.of(model_path)
    batch_tokens = min(8192, tokens or 8192)
    row = min(cfg.max_packed_length if cfg.packing else cfg.max_length, batch_tokens)
    positions = cfg.batch_size * (cfg.max_length + cfg.max_new_tokens)
    generation = 4 * (positions * shape.layers * 2 * shape.hidden)
    batch = _batch_forward_bytes(shape, batch_tokens, row, 1024)
    return MemoryEstimate(
        (
            ("process", PROCESS_BYTES["evaluate"]),
            ("weights", 4 * shape.parameters),
            ("transient", max(batch, generation, _loading_bytes(shape))),
        )
    )


def training_tokens(cfg: TrainSettings) -> tuple[int, int]:
    """(tokens per micro-batch, tokens per row) of training: packed, ``max_tokens_per_micro_batch``
    (or ``max_length``, a longer sample alone) in rows of ``max_packed_length``; padded,
    ``per_device_batch_size`` x ``max_length`` (an upper bound: batches pad to their longest)."""
    if cfg.packing:
        tokens = max(cfg.max_tokens_per_micro_batch, cfg.max_length)
        return tokens, min(cfg.max_packed_length, tokens)
    return cfg.per_device_batch_size * cfg.max_length, cfg.max_length


def activation_bytes(model_path: str | ModelShape, cfg: TrainSettings) -> int:
    """Estimated bytes of activations one rank keeps for backward, the same under DDP and
    FSDP2 (each rank runs its own micro-batch), float32: tokens per micro-batch
    (:func:`training_tokens`) x 4 bytes x layers x (:data:`TRAIN_VALUES_PER_HIDDEN` x hidden +
    :data:`TRAIN_VALUES_PER_INTERMEDIATE` x intermediate + heads x the row's length), plus the
    chunked loss's logits (:data:`LOGIT_COPIES`, at most :data:`LOSS_CHUNK_ROWS` rows). With
    gradient checkpointing the layers keep only their inputs (hidden values per token) and one
    layer at a time its full activations."""
    shape = model_path if isinstance(model_path, ModelShape) else ModelShape.of(model_path)
    tokens, row = training_tokens(cfg)
    per_layer = (
        TRAIN_VALUES_PER_HIDDEN * shape.hidden
        + TRAIN_VALUES_PER_INTERMEDIATE * shape.intermediate
        + TRAIN_SCORE_COPIES * shape.heads * row
    )
    layers = (
        shape.layers * shape.hidden + per_layer
        if cfg.gradient_checkpointing
        else shape.layers * per_layer
    )
    logits = LOGIT_COPIES["train"] * min(tokens, LOSS_CHUNK_ROWS) * shape.vocab
    return 4 * (tokens * layers + logits)


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


def training_estimate(
    model_path: str | ModelShape, cfg: TrainSettings, world_size: int
) -> MemoryEstimate:
    """Training's peak per rank: the process, the weights, gradients and AdamW moments
    (:func:`training_bytes_per_rank`; LoRA trains about no parameter), DDP's gradient buckets
    (4 bytes per trainable parameter, beside the gradients, at more than one rank) and the
    activations (:func:`activation_bytes`)."""
    shape = model_path if isinstance(model_path, ModelShape) else ModelShape.of(model_path)
    trainable = 0 if cfg.lora_r else shape.parameters
    fsdp = cfg.parallelism == "fsdp"
    divide = world_size if fsdp else 1
    buckets = 4 * trainable if not fsdp and world_size > 1 else 0
    return MemoryEstimate(
        (
            ("process", PROCESS_BYTES["train"]),
            ("weights", 4 * shape.parameters // divide),
            ("gradients", 4 * trainable // divide),
            ("DDP buckets", buckets),
            ("AdamW moments", 8 * trainable // divide),
            ("activations", activation_bytes(shape, cfg)),
        )
    )


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
    shape: ModelShape, cfg: TrainSettings, world_size: int, available_per_rank: int
) -> MemoryEstimate:
    """Training's estimated peak per rank (:func:`training_estimate`), checked against
    ``available_per_rank``.

    Returns:
        The estimate, when it fits.

    Raises:
        TrainingMemoryError: the estimate exceeds ``available_per_rank``; the message gives
            both in GiB and each way to fit with its own estimate (the same function's, for
            the changed setting), saying which would not fit alone: fsdp, LoRA, gradient
            checkpointing, a smaller micro-batch or max_length, more ranks or memory.
    """
    estimate = training_estimate(shape, cfg, world_size)
    if estimate.total <= available_per_rank:
        return estimate

    def way(setting: str, **changed: Any) -> str:
        need = training_estimate(shape, cfg.model_copy(update=changed), world_size).total
        short = "" if need <= available_per_rank else ", not enough alone"
        return f"{setting} ({need / GIB:.1f} GiB per rank{short})"

    ways = []
    if cfg.parallelism != "fsdp" and world_size > 1:
        ways.append(way("parallelism: fsdp", parallelism="fsdp"))
    if not cfg.lora_r:
        ways.append(way("lora_r > 0", lora_r=8))
    if not cfg.gradient_checkpointing:
        ways.append(way("gradient_checkpointing: true", gradient_checkpointing=True))
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
        f"training needs about {estimate.total / GIB:.1f} GiB per rank "
        f"({shape.parameters / 1e6:.0f}M parameters, parallelism {cfg.parallelism}"
        f"{', LoRA' if cfg.lora_r else ''}, {world_size} ranks; "
        f"{estimate.part('activations') / GIB:.1f} GiB of it activations) but "
        f"{available_per_rank / GIB:.1f} GiB is available per rank; use " + ", or ".join(ways)
    )
