"""The training step's kernels, chosen at one place: the loss without whole-vocabulary logits,
Liger-Kernel's fused kernels where installed on a GPU, fused AdamW, compiled decoder layers.

**The loss.** ``model(...).logits`` materialises (tokens x vocabulary) logits and the
cross-entropy a float32 copy of them (8,192 tokens x 32,000 words: 1 GiB in float32, and the
same again for its gradient). :class:`ChunkedLinearCrossEntropy` computes the summed
cross-entropy from the final hidden states and the LM head's weight in chunks of tokens, in
the manner of Liger-Kernel's fused linear cross-entropy but in torch ops: per chunk, logits ->
float32 log-sum-exp -> the loss and, in the same pass, its gradient with respect to the hidden
states and the head's weight (softmax minus the one-hot target, times the head or the hidden
states), so neither the forward nor the backward ever holds the whole logits; the backward
only scales what the forward stored. Only target positions (labels != -100) reach the head.

Which loss a run uses (:func:`loss_kernel`): ``"liger"`` (Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss``, Triton) where ``liger-kernel`` is installed (the optional
extra ``gpu``) and the device is CUDA; ``"chunked"`` (the torch one above) elsewhere;
``"logits"`` (the model's logits and :func:`~cluster_pipeline.training.step.token_loss_sum`,
as before) when the ``fused_loss`` knob is off or the model's head is not a plain linear map
(a LoRA-adapted head, soft-capped or scaled logits: :func:`fusable`). On a GPU with
``liger-kernel`` the decoder's RMSNorm, RoPE and SwiGLU are Liger's too
(:func:`apply_liger_kernels`).

**DDP and FSDP.** Calling the decoder and the head outside the wrapped module's forward would
skip DDP's gradient bookkeeping and FSDP2's parameter all-gather, so the loss runs inside a
module of its own, :class:`CausalLMLoss`, whose forward runs the decoder and the loss; that
module is what DDP wraps and what FSDP2 shards as its root (training/parallel.py). Without
labels its forward is the model's own (logits), so the packing gate runs through it.

**The optimizer and compilation.** :func:`adamw_options`: ``fused=True`` on CUDA (one kernel
for every parameter's update). :func:`compile_layers`: ``torch.compile`` of each decoder layer
(the ``compile`` knob), the unit torchtitan compiles.

torch only (Liger imported where installed), so the GPU benchmark (``benchmarks/gpu_step.py``)
runs it on machines that have nothing else.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

# The label of a token that is not a target (PyTorch's cross-entropy ``ignore_index``).
IGNORE_INDEX = -100
LOSS_KERNELS = ("liger", "chunked", "logits")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i W^T + b, targets_i) in float32, computed and differentiated chunk by
    chunk (module docstring). Inputs: hidden (M, d), weight (V, d), bias (V,) or None,
    targets (M,) int64 (every one a target: no ignore index), chunk rows (int). Output: ()
    float32. Gradients: d/dhidden (M, d) in hidden's dtype, d/dweight (V, d) and d/dbias (V,)
    accumulated over chunks in float32 and returned in the parameters' dtypes.

    Per row with logits z = W h + b, p = softmax(z): CE = logsumexp(z) - z_y, dCE/dz = p -
    onehot(y), dCE/dh = W^T (p - onehot(y)), dCE/dW = (p - onehot(y)) h^T (the softmax
    cross-entropy gradient; Liger-Kernel's fused linear cross-entropy computes the same, in
    Triton). Matrix products follow autocast where it is on, as the model's own head would.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_rows: int):  # pyright: ignore[reportIncompatibleMethodOverride]
        """The summed loss; the gradients computed on the way and stored for backward."""
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if need_b
            else None
        )
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            y = targets[start : start + chunk_rows]
            z = torch.nn.functional.linear(h, weight, bias).float()
            lse = torch.logsumexp(z, dim=-1)
            total += (lse - z.gather(1, y[:, None]).squeeze(1)).sum()
            if not (need_h or need_w or need_b):
                continue
            # z becomes dCE/dz = softmax(z) - onehot(y), in place (no second (rows, V) buffer).
            z.sub_(lse[:, None]).exp_()
            z[torch.arange(z.shape[0], device=z.device), y] -= 1.0
            # In the hidden states' dtype, as the head's own backward would (autocast casts
            # the products to its dtype where it is on).
            g = z.to(h.dtype)
            if grad_h is not None:
                grad_h[start : start + chunk_rows] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
            if grad_b is not None:
                grad_b += z.sum(0)
        ctx.save_for_backward(
            *(t if t is not None else torch.empty(0) for t in (grad_h, grad_w, grad_b))
        )
        ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # pyright: ignore[reportIncompatibleMethodOverride]
        """The stored gradients times the incoming scalar gradient."""
        stored = ctx.saved_tensors
        has_h, has_w, has_b = ctx.present
        weight_dtype, bias_dtype = ctx.dtypes
        dh = stored[0] * grad_out.to(stored[0].dtype) if has_h else None
        dw = (stored[1] * grad_out).to(weight_dtype) if has_w else None
        db = (stored[2] * grad_out).to(bias_dtype) if has_b else None
        return dh, dw, db, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """Summed cross-entropy of the logits ``hidden W^T + b`` against ``targets``, without the
    (M, V) logits (:class:`ChunkedLinearCrossEntropy`).

    Args:
        hidden: (M, d) final hidden states of the target positions (any float dtype).
        weight: (V, d) the LM head's weight.
        targets: (M,) int64 token ids, each in [0, V).
        bias: (V,) the head's bias, if it has one.
        chunk_rows: rows per chunk: peak extra memory is chunk_rows x V float32 values.

    Returns:
        () float32, equal to ``F.cross_entropy(F.linear(hidden, weight, bias).float(),
        targets, reduction="sum")`` (to float32 rounding) with the same gradients.

    Raises:
        ValueError: ``chunk_rows`` < 1, or hidden and targets of different lengths.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {targets.shape[0]} targets")
    out = ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_rows)
    assert isinstance(out, torch.Tensor)
    return out


def liger_installed() -> bool:
    """Whether ``liger-kernel`` is importable (found, not imported: its import pulls Triton)."""
    return importlib.util.find_spec("liger_kernel") is not None


def loss_kernel(device_type: str, fused: bool = True) -> str:
    """The loss a run uses (module docstring): ``"logits"`` when ``fused`` is off, ``"liger"``
    on CUDA with ``liger-kernel`` installed, else ``"chunked"``."""
    if not fused:
        return "logits"
    if device_type == "cuda" and liger_installed():
        return "liger"
    return "chunked"


def fusable(model) -> bool:
    """Whether the loss may be computed from the final hidden states and the head's weight: the
    head is a plain ``torch.nn.Linear`` (not a LoRA-wrapped one) and the config scales no
    logits (Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
    ``logits_scaling``). Where not, the loss runs on the model's logits."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return False
    config = model.config.get_text_config()
    scaled = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    return all(getattr(config, name, None) in (None, 1, 1.0) for name in scaled)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the float32 cross-entropy over a batch's targets: position j of a row predicts
    token j + 1 where its label is not -100. () float32."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class CausalLMLoss(torch.nn.Module):
    """A causal LM and its summed target cross-entropy in one forward: the module a training
    rank wraps in DDP or shards with FSDP2 (module docstring, "DDP and FSDP").

    Args:
        model: the transformers causal LM (or its peft wrapper).
        kernel: ``"chunked"``, ``"liger"`` or ``"logits"`` (:func:`loss_kernel`); a kernel
            other than ``"logits"`` on a model that is not :func:`fusable` becomes
            ``"logits"``.
        chunk_rows: target rows per chunk of the chunked loss.

    Raises:
        ValueError: an unknown kernel.
    """

    def __init__(self, model, kernel: str = "chunked", chunk_rows: int = 1024):
        super().__init__()
        if kernel not in LOSS_KERNELS:
            raise ValueError(f"loss kernel {kernel!r}: one of {', '.join(LOSS_KERNELS)}")
        self.model = model
        self.kernel = kernel if kernel == "logits" or fusable(model) else "logits"
        self.chunk_rows = chunk_rows
        self._liger = None

    @property
    def config(self):
        """The model's config (the packing gate reads its vocabulary)."""
        return self.model.config

    def forward(self, labels: torch.Tensor | None = None, **kwargs: Any):
        """Without ``labels``: the model's own forward (its output, ``.logits``). With
        ``labels`` (R, L) int64 (-100 where no target): the summed float32 cross-entropy of
        every position j predicting token j + 1, () float32; ``kwargs`` are the model's
        forward arguments (input_ids, position_ids, attention_mask, use_cache, the attention
        boundaries)."""
        if labels is None:
            return self.model(**kwargs)
        if self.kernel == "logits":
            return token_loss_sum(self.model(**kwargs).logits, labels)
        hidden = self.model.get_decoder()(**kwargs).last_hidden_state
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        h = hidden[:, :-1][keep]
        y = targets[keep]
        head = self.model.get_output_embeddings()
        if self.kernel == "liger":
            return self._liger_loss(h, head.weight, y, head.bias)
        return linear_cross_entropy_sum(h, head.weight, y, head.bias, self.chunk_rows)

    def _liger_loss(self, h, weight, y, bias) -> torch.Tensor:
        if self._liger is None:
            from liger_kernel.transformers import (  # pyright: ignore[reportMissingImports]
                LigerFusedLinearCrossEntropyLoss,
            )

            self._liger = LigerFusedLinearCrossEntropyLoss(
                ignore_index=IGNORE_INDEX, reduction="sum"
            )
        out = self._liger(weight, h, y, bias)
        return (out[0] if isinstance(out, tuple) else out).float()


def apply_liger_kernels(model) -> str | None:
    """Liger-Kernel's RMSNorm, RoPE and SwiGLU in ``model`` (in place, by its model type; the
    loss is :class:`CausalLMLoss`'s), where ``liger-kernel`` is installed.

    Returns:
        None when applied, else why not (not installed, or Liger's own error) for the log.
    """
    if not liger_installed():
        return "liger-kernel is not installed (pip install 'cluster_pipeline[gpu]')"
    try:
        from liger_kernel.transformers import (  # pyright: ignore[reportMissingImports]
            _apply_liger_kernel_to_instance,
        )

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        _apply_liger_kernel_to_instance(
            model=base,
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=False,
        )
    except Exception as e:  # noqa: BLE001 - Liger's patching is best effort; the step runs without
        return f"Liger-Kernel's kernels were not applied: {type(e).__name__}: {e}"
    return None


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a ``transformers`` model, found through any wrapper around it
    (peft, :class:`CausalLMLoss`): the modules whose class is named in a ``_no_split_modules``
    of a model inside (e.g. ``LlamaDecoderLayer``); the units FSDP2 shards and ``compile``
    compiles one by one."""
    names: set[str] = set()
    for m in model.modules():
        names |= set(getattr(m, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model, backend: str | None = None) -> int:
    """``torch.compile`` each decoder layer of ``model`` in place (``nn.Module.compile``; the
    ``compile`` knob), with dynamic shapes from the start: every micro-batch has rows of
    another length, so static shapes would compile again for each. ``backend``:
    torch.compile's (None: its default, inductor). Returns the number of layers compiled (0
    for a model whose blocks are not found: nothing compiled)."""
    layers = decoder_layers(model)
    options = {} if backend is None else {"backend": backend}
    for layer in layers:
        layer.compile(dynamic=True, **options)
    return len(layers)


def adamw_options(device: torch.device) -> dict[str, Any]:
    """Keyword arguments of ``torch.optim.AdamW`` for parameters on ``device``: ``fused=True``
    on CUDA (one kernel updates every parameter), nothing elsewhere (the default for-each
    implementation, as before)."""
    return {"fused": True} if device.type == "cuda" else {}
