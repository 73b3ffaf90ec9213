"""Attention for packed rows, chosen at one place: variable-length kernels on a GPU, sdpa
elsewhere.

A packed row holds several samples (:mod:`cluster_pipeline.data.packing`). sdpa keeps them
apart with a block mask over the whole row, so a row of L tokens costs L^2 attention work
however short its samples are (rows of 4,096 tokens holding samples of ~190 do ~20x the work
they need). Variable-length kernels take the samples' boundaries instead (``cu_seqlens``, the
cumulative sequence lengths over the flattened rows) and compute each sample's own causal
attention: FlashAttention-2's varlen kernel, inside PyTorch as
``torch.nn.attention.varlen.varlen_attn`` (no extra package), or flash-attn's
``flash_attn_varlen_func`` where the user installed ``flash-attn``.

The choice, made by :func:`packed_kernel` from the device and what is installed:

=============================================  ========================================
where                                          packed micro-batches attend with
=============================================  ========================================
CUDA, ``flash-attn`` importable                flash-attn's ``flash_attn_varlen_func``
CUDA, ``torch.nn.attention.varlen`` present    PyTorch's ``varlen_attn``
CPU, or neither kernel                         sdpa with transformers' block mask (as
                                               before: same numerics)
=============================================  ========================================

It reaches every model that routes attention through transformers' ``AttentionInterface``:
:func:`register` adds the implementation :data:`IMPLEMENTATION` (its attention function
:func:`packed_attention_forward`, its mask function transformers' own sdpa mask), and
:func:`use_packed_attention` switches a model to it where a kernel exists and the model
attends with sdpa. The boundaries are built once per micro-batch by the collate
(``cu_seq_lens``, ``max_length``; :func:`~cluster_pipeline.data.packing.collate_rows`) and
passed through the model's forward keyword arguments (:func:`forward_kwargs`; transformers 5
hands ``cu_seq_lens_q/k`` and ``max_length_q/k`` to the attention function of every layer), not
recovered from ``position_ids`` in every layer. Everything else falls back to sdpa inside the
same function, with the mask transformers built for it: padded batches (an attention mask),
``generate()`` (a KV cache: queries shorter than keys), a forward without boundaries, dropout,
sliding windows, soft-capping or sink tokens, float32 without autocast (the kernels take
float16 and bfloat16 only).

:func:`reference_varlen_attn` is ``varlen_attn``'s contract computed with sdpa one sample at a
time, on any device: the CPU tests run the registered function with it in place of the kernel
(:func:`packed_kernel` substituted), so the wiring, reshapes, grouped-query heads, scaling and
boundaries are checked on the CPU against the model's sdpa numerics.

torch only (transformers imported where a model is switched), so the GPU benchmark
(``benchmarks/gpu_step.py``) runs it on machines that have nothing else. It lives in ``data/``
beside the packing it serves so that ``selection/`` (the embedding pass), ``training/`` and
``evaluation/`` can all import it (docs/design.md, "Code layout").
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The transformers attention implementation this module registers.
IMPLEMENTATION = "cluster_pipeline_varlen"
# Implementations that read the boundaries from the forward's keyword arguments.
READS_BOUNDARIES = frozenset({IMPLEMENTATION, "flash_attention_2", "flash_attention_3"})
# Attention keyword arguments the variable-length kernels do not implement: sdpa then.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


@dataclass(frozen=True)
class Kernel:
    """A variable-length causal attention kernel in one calling form.

    Attributes:
        name: what the logs and the benchmark call it (``"torch varlen_attn"``).
        run: ``run(q, k, v, cu_seqlens, max_length, scale) -> out``: q (T, H, D), k and v
            (T, Hk, D) with H a multiple of Hk, cu_seqlens (S + 1,) int32 on their device,
            max_length the longest segment (int), scale the score multiplier (None:
            1/sqrt(D)); out (T, H, D), each token attending causally within its segment.
        half_only: it takes float16 and bfloat16 only (the GPU kernels); float32 runs sdpa.
    """

    name: str
    run: Callable[..., torch.Tensor]
    half_only: bool = True


def reference_kernel() -> Kernel:
    """:func:`reference_varlen_attn` as a :class:`Kernel` (any dtype, any device): what the
    CPU tests put in place of :func:`packed_kernel`'s choice."""
    return torch_varlen_kernel(reference_varlen_attn, "reference (sdpa per sample)", False)


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn``'s contract (torch 2.13's signature, its
    documentation) computed with ``scaled_dot_product_attention`` one segment at a time, on
    any device and dtype: the CPU reference of the GPU kernel.

    Args:
        query: (T_q, H, D).
        key: (T_k, Hk, D); Hk = H unless ``enable_gqa`` (then H is a multiple of Hk).
        value: (T_k, Hk, D).
        cu_seq_q: (S + 1,) int, segment i of the queries is ``[cu_seq_q[i], cu_seq_q[i+1])``.
        cu_seq_k: (S + 1,) int for the keys; None: ``cu_seq_q``.
        max_q: the longest query segment (checked).
        max_k: the longest key segment (checked).
        scale: the score multiplier; None: 1/sqrt(D).
        window_size: (-1, -1) full attention, (-1, 0) causal (segments of equal query and key
            lengths: each query attends to the keys at or before its own position).
        enable_gqa: key and value heads shared by groups of H / Hk query heads.

    Returns:
        (T_q, H, D) in ``query``'s dtype.

    Raises:
        ValueError: a segment longer than ``max_q``/``max_k``, heads that do not match, a
            causal segment whose query and key lengths differ.
        NotImplementedError: a sliding window (``window_size`` other than the two above).
    """
    import torch
    import torch.nn.functional as F

    if window_size not in ((-1, -1), (-1, 0)):
        raise NotImplementedError(f"window_size {window_size}: the reference has no windows")
    if key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"{query.shape[1]} query heads and {key.shape[1]} key heads need GQA")
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_k.tolist()
    out = torch.empty_like(query)
    for (qs, qe), (ks, ke) in zip(
        zip(bounds_q, bounds_q[1:], strict=False),
        zip(bounds_k, bounds_k[1:], strict=False),
        strict=True,
    ):
        if qe - qs > max_q or ke - ks > max_k:
            raise ValueError(f"segment of {qe - qs}/{ke - ks} tokens past max {max_q}/{max_k}")
        causal = window_size == (-1, 0)
        if causal and qe - qs != ke - ks:
            raise ValueError("a causal segment needs as many queries as keys")
        if qe == qs:
            continue
        o = F.scaled_dot_product_attention(
            query[qs:qe].transpose(0, 1),
            key[ks:ke].transpose(0, 1),
            value[ks:ke].transpose(0, 1),
            is_causal=causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


def torch_varlen_kernel(
    fn: Callable[..., Any], name: str = "torch varlen_attn", half_only: bool = True
) -> Kernel:
    """A :class:`Kernel` calling ``fn`` with ``varlen_attn``'s signature, whichever of its
    forms ``fn`` has: causality as ``is_causal=True`` (torch 2.9-2.10) or as
    ``window_size=(-1, 0)`` (later), grouped-query heads by ``enable_gqa=True`` where it
    exists or by repeating the key/value heads (``repeat_interleave``, the grouping
    transformers' ``repeat_kv`` makes) where it does not. A tuple result (output, aux) gives
    its output."""
    params = inspect.signature(fn).parameters

    def run(q, k, v, cu, max_length: int, scale: float | None):
        extra: dict[str, Any] = {}
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                extra["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if "is_causal" in params:
            extra["is_causal"] = True
        else:
            extra["window_size"] = (-1, 0)
        out = fn(q, k, v, cu, cu, max_length, max_length, scale=scale, **extra)
        return out[0] if isinstance(out, tuple) else out

    return Kernel(name, run, half_only)


def _flash_attn_kernel() -> Kernel | None:
    """flash-attn's varlen function (grouped-query heads native), or None where the package
    is absent or does not import (a build for another torch or CUDA)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func  # pyright: ignore[reportMissingImports]
    except (ImportError, OSError):
        return None

    def run(q, k, v, cu, max_length: int, scale: float | None):
        return flash_attn_varlen_func(
            q, k, v, cu, cu, max_length, max_length, softmax_scale=scale, causal=True
        )

    return Kernel("flash-attn varlen", run)


def _torch_varlen() -> Kernel | None:
    """PyTorch's ``varlen_attn`` where this torch has it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return torch_varlen_kernel(varlen_attn)


# device type -> its kernel, decided once per process. A plain dict, not functools.lru_cache:
# torch.compile traces through an lru_cache wrapper (and would import and inspect at every
# compilation) but reads a dict entry under a guard.
_KERNELS: dict[str, Kernel | None] = {}


def packed_kernel(device_type: str) -> Kernel | None:
    """The variable-length kernel packed micro-batches attend with on ``device_type``
    (module docstring's table): on ``"cuda"`` flash-attn's where it imports, else PyTorch's
    ``varlen_attn`` where present; None elsewhere (sdpa). Decided once per process."""
    if device_type not in _KERNELS:
        found = (_flash_attn_kernel() or _torch_varlen()) if device_type == "cuda" else None
        _KERNELS[device_type] = found
    return _KERNELS[device_type]


def _kernel_dtype(query: torch.Tensor, kernel: Kernel) -> torch.dtype | None:
    """The dtype ``kernel`` runs in, as sdpa would: autocast's where autocast is on for the
    tensors' device (sdpa is on autocast's lower-precision list; transformers' rotary
    embedding leaves q and k in float32 there), else the query's. None where that is float32
    and the kernel takes half dtypes only (sdpa then)."""
    import torch

    half = (torch.float16, torch.bfloat16)
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = query.dtype
    return dtype if dtype in half or not kernel.half_only else None


def packed_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function of :data:`IMPLEMENTATION` (transformers' ``AttentionInterface``
    form): the variable-length kernel of :func:`packed_kernel` over the boundaries in
    ``cu_seq_lens_q`` / ``max_length_q`` where they are given and the kernel applies, else
    transformers' ``sdpa_attention_forward`` with the mask transformers built (module
    docstring: when).

    Args:
        module: the attention layer (its ``is_causal`` is read when ``is_causal`` is None).
        query: (B, H, L, D).
        key: (B, Hk, L_k, D).
        value: (B, Hk, L_k, D).
        attention_mask: the sdpa mask (used by the sdpa fallback only).
        dropout: attention dropout probability.
        scaling: the score multiplier (None: 1/sqrt(D)).
        is_causal: whether the layer is causal.
        **kwargs: the forward's attention kwargs: ``cu_seq_lens_q`` (S + 1,) int32 offsets
            into the B x L flattened tokens, ``max_length_q`` int, and the rest, passed on to
            sdpa.

    Returns:
        (attention output (B, L, H, D), None: no attention weights).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    kernel = packed_kernel(query.device.type) if cu is not None else None
    dtype = _kernel_dtype(query, kernel) if kernel is not None else None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (
        kernel is not None
        and dtype is not None
        and causal
        and dropout == 0.0
        and query.shape[2] == key.shape[2]
        and all(kwargs.get(name) is None for name in _UNSUPPORTED)
    ):
        b, h, n, d = query.shape
        hk = key.shape[1]
        q = query.transpose(1, 2).reshape(b * n, h, d).to(dtype)
        k = key.transpose(1, 2).reshape(b * n, hk, d).to(dtype)
        v = value.transpose(1, 2).reshape(b * n, hk, d).to(dtype)
        out = kernel.run(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
        return out.reshape(b, n, h, d), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


@lru_cache(maxsize=1)
def register() -> str:
    """Register :data:`IMPLEMENTATION` with transformers (attention function
    :func:`packed_attention_forward`, mask function transformers' ``sdpa_mask``, so the sdpa
    fallback gets the mask sdpa would); once per process. Returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, packed_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    return IMPLEMENTATION


def _inner(model):
    """The transformers model (or its peft wrapper) inside DDP (``.module``) or the training
    loss module (``.model``): the first object down those attributes that can switch its
    attention implementation."""
    seen = model
    for _ in range(4):
        if hasattr(seen, "set_attn_implementation"):
            return seen
        inside = getattr(seen, "module", None)
        seen = inside if inside is not None else getattr(seen, "model", None)
        if seen is None:
            break
    return model


def implementation(model) -> str | None:
    """The attention implementation ``model`` (or the model inside its wrapper) runs with."""
    config = getattr(_inner(model), "config", None)
    return getattr(config, "_attn_implementation", None)


def use_packed_attention(model, device_type: str) -> str:
    """Switch ``model`` to :data:`IMPLEMENTATION` where ``device_type`` has a variable-length
    kernel (:func:`packed_kernel`) and the model attends with sdpa (a model on eager, flex or a
    user's flash_attention_2 keeps its choice). Call before wrapping it in DDP or FSDP.

    Returns:
        What packed micro-batches attend with from now on: the kernel's name, the model's own
        implementation where it reads boundaries itself (flash_attention_2), or ``"sdpa"``
        (block mask) where nothing changed.
    """
    current = implementation(model)
    if current in READS_BOUNDARIES and current != IMPLEMENTATION:
        return str(current)
    kernel = packed_kernel(device_type)
    if kernel is None or current not in ("sdpa", IMPLEMENTATION):
        return str(current or "sdpa")
    register()
    try:
        _inner(model).set_attn_implementation(IMPLEMENTATION)
    except (ValueError, AttributeError, ImportError):
        # A model class without AttentionInterface support keeps sdpa.
        return "sdpa"
    return kernel.name


@contextmanager
def packed_attention(model, device_type: str) -> Iterator[str]:
    """:func:`use_packed_attention` for the length of a ``with`` block, the model's own
    implementation restored after it (the embedding pass and the held-out loss borrow the
    model). Yields what :func:`use_packed_attention` returns."""
    before = implementation(model)
    name = use_packed_attention(model, device_type)
    try:
        yield name
    finally:
        if implementation(model) != before and before is not None:
            _inner(model).set_attn_implementation(before)


def forward_kwargs(model, batch: dict[str, torch.Tensor], device) -> dict[str, Any]:
    """The keyword arguments of ``model``'s forward for one collated batch (CPU tensors, from
    :func:`~cluster_pipeline.data.packing.collate_rows`) on ``device``: ``input_ids``,
    ``position_ids``, ``attention_mask`` (padded batches), ``use_cache=False``, and for a
    packed batch where the model's implementation reads them (:data:`READS_BOUNDARIES`) the
    boundaries ``cu_seq_lens_q/k`` ((S + 1,) int32 on ``device``) and ``max_length_q/k``
    (int; read on the CPU, so no device synchronisation). Labels are left to the caller.
    """
    out: dict[str, Any] = {
        "input_ids": batch["input_ids"].to(device),
        "position_ids": batch["position_ids"].to(device),
        "use_cache": False,
    }
    if "attention_mask" in batch:
        out["attention_mask"] = batch["attention_mask"].to(device)
    if "cu_seq_lens" in batch and implementation(model) in READS_BOUNDARIES:
        cu = batch["cu_seq_lens"].to(device)
        longest = int(batch["max_length"])
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return out
