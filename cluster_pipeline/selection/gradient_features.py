"""The gradient features of ``less`` (selection/selectors/less.py; Xia et al. 2024, *LESS:
Selecting Influential Data for Targeted Instruction Tuning*, ICML 2024, section 3): per-sample
LoRA gradients, their Adam preconditioning and their random projection. torch only, no
processes; the pass that runs them over a pool is ``training/embedding_pass.py``.

Per-sample gradients (:func:`per_sample_gradients`). For a linear map ``y = W x`` applied at
every token position t of a sample s, dL_s/dW = sum_t (dL_s/dy_t) x_t^T. A padded batch keeps
its samples apart (sample s owns row s; padding is masked and is no target), so one backward
pass of sum_s L_s gives every dL_s/dy_t, and the per-sample gradient of each trainable weight is
``einsum("bto,bti->boi", dL/dy, x)`` over the batch: the batched form of one backward per
sample (the hook method of Opacus, Yousefpour et al. 2021), exact. It requires every trainable
parameter to be the weight of an ``nn.Linear`` without a trainable bias, which LoRA's ``lora_A``
and ``lora_B`` are. L_s is the sample's mean token cross-entropy over its response (the loss
LESS takes the gradient of).

Adam preconditioning (:func:`adam_precondition`): with the checkpoint's AdamW moments m, v
after t steps and betas (b1, b2), the update a sample's gradient g would make. By default the
authors' released code (``less/data_selection/collect_grad_reps.py:111-127``,
``obtain_gradients_with_adam``: no bias correction, eps under the square root):

    m' = b1 m + (1 - b1) g          v' = b2 v + (1 - b2) g^2
    Gamma(g) = m' / sqrt(v' + eps)

or (``released=False``) the paper's eq. (1), bias-corrected with eps outside the root:

    m_hat = m' / (1 - b1^(t+1))     v_hat = v' / (1 - b2^(t+1))
    Gamma(g) = m_hat / (sqrt(v_hat) + eps)

After the per-gradient normalisation the bias correction is one scalar per checkpoint and
cancels; where eps sits does not: under the root it dominates every coordinate with
sqrt(v') < 1e-4 (eps = 1e-8), so the two directions differ (issue 41: a per-sample cosine of
0.67-0.71 between them on the tiny run). The authors hard-code b1 = 0.9, b2 = 0.999,
eps = 1e-8; here they are the checkpoint's AdamW settings (the project's are those values).

Random projection (:class:`RademacherProjection`): x -> x R / sqrt(d), R a P x d matrix of
independent +-1 entries (Johnson-Lindenstrauss: inner products and norms kept in expectation,
a cosine's error of order 1 / sqrt(d)). The authors use TRAK's Rademacher projector
(``trak.projectors``); here the entries of row i are the bits of 32-bit integer hashes of
(seed, i, word), 32 entries per hash, computed in 64-bit integer arithmetic, so the matrix is
never stored (it is rebuilt in blocks of rows as a projection needs them) and is the same on a
CPU and a GPU: pool and target gradients projected in different runs, on different devices, meet
in the same space. Rebuilding R is the projection's fixed cost (P d signs: 3.8e9 for
SmolLM2-135M's rank-8 LoRA at d = 8,192); one hash per 32 signs made it 24x cheaper than one per
sign (759 s to 31 s per rebuild on one CPU thread, measured 2026-12-03), and gradients are
projected in groups as large as memory allows, so a pass rebuilds it about once per chunk.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from cluster_pipeline.data.tokenization import IGNORE_INDEX

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # the 32-bit integer hash constant of "hash prospector" (Wellons 2018)
_SEED_MIX = 0x9E3779B1  # 2^32 / golden ratio


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, elementwise on int64 values in [0, 2^32): three xor-shift-multiply
    rounds (products stay below 2^59, so int64 never overflows)."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def _sign_table(device) -> torch.Tensor:
    """(256, 8) float32: row b holds +1 where bit q of the byte b is 1, -1 elsewhere."""
    b = torch.arange(256, dtype=torch.int64, device=device)[:, None]
    q = torch.arange(8, dtype=torch.int64, device=device)[None, :]
    return (((b >> q) & 1) * 2 - 1).to(torch.float32)


def rademacher_rows(start: int, rows: int, dim: int, seed: int, device) -> torch.Tensor:
    """Rows ``start .. start + rows - 1`` of the P x d Rademacher matrix R of ``seed``.

    Returns:
        (rows, dim) float32 of +-1: R[i, j] = +1 when bit (j mod 32) of
        hash(hash(i + seed') + floor(j / 32)) is 1, -1 otherwise (seed' = seed x 2654435761
        mod 2^32; hash: :func:`_mix32`).
    """
    i = torch.arange(start, start + rows, dtype=torch.int64, device=device)[:, None]
    words = torch.arange(-(-dim // 32), dtype=torch.int64, device=device)[None, :]
    h = _mix32(_mix32(i + (seed * _SEED_MIX) % 2**32) + words)  # (rows, ceil(d / 32))
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    byte = (h[:, :, None] >> shifts) & 255  # (rows, ceil(d / 32), 4), bits 0-7 first
    return _sign_table(device)[byte].reshape(rows, -1)[:, :dim]


@dataclass(frozen=True)
class RademacherProjection:
    """x -> x R / sqrt(d) for (B, P) rows x (module docstring).

    Attributes:
        input_dim: P, the gradient's length.
        dim: d, the projected dimension.
        seed: chooses R.
        block_rows: rows of R built at a time (memory: block_rows x d floats).
    """

    input_dim: int
    dim: int
    seed: int = 0
    block_rows: int = 2048

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Project (B, P) float rows to (B, d) float32 (on ``x``'s device).

        Raises:
            ValueError: rows of another length than P.
        """
        if x.shape[-1] != self.input_dim:
            raise ValueError(f"projection of {self.input_dim} inputs given rows of {x.shape[-1]}")
        x = x.float()
        out = torch.zeros(x.shape[0], self.dim, dtype=torch.float32, device=x.device)
        for start in range(0, self.input_dim, self.block_rows):
            rows = min(self.block_rows, self.input_dim - start)
            r = rademacher_rows(start, rows, self.dim, self.seed, x.device)
            out += x[:, start : start + rows] @ r
        return out / math.sqrt(self.dim)


@dataclass(frozen=True)
class AdamState:
    """One checkpoint's AdamW state, flattened in the order of the trainable parameters.

    Attributes:
        exp_avg: (P,) float32 first moment m.
        exp_avg_sq: (P,) float32 second moment v.
        step: t, the optimizer steps taken.
        betas: (b1, b2).
        eps: AdamW's eps.
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    @classmethod
    def from_optimizer_state(cls, state: dict, device=None) -> AdamState:
        """From ``torch.optim.AdamW.state_dict()`` of a single parameter group whose parameters
        are the trainable ones in model order (as ``training/loop.py`` builds it).

        Raises:
            ValueError: more than one parameter group, or a parameter without moments (the
                optimizer never stepped).
        """
        groups = state["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"expected one AdamW parameter group, found {len(groups)}")
        group = groups[0]
        moments = state["state"]
        missing = [i for i in group["params"] if i not in moments]
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) have no Adam moments (no step taken)")
        steps = {int(torch.as_tensor(moments[i]["step"]).item()) for i in group["params"]}
        if len(steps) != 1:
            raise ValueError(f"the parameters' Adam step counts differ: {sorted(steps)}")

        def flat(key: str) -> torch.Tensor:
            return torch.cat([moments[i][key].reshape(-1).float() for i in group["params"]]).to(
                device
            )

        b1, b2 = group["betas"]
        return cls(flat("exp_avg"), flat("exp_avg_sq"), steps.pop(), (b1, b2), group["eps"])


def adam_precondition(grads: torch.Tensor, state: AdamState, released: bool = True) -> torch.Tensor:
    """Gamma(g) for (B, P) per-sample gradients g (module docstring): the authors' released
    ``m' / sqrt(v' + eps)`` (``released``), else the paper's eq. (1),
    ``m_hat / (sqrt(v_hat) + eps)``.

    Returns:
        (B, P) float32.
    """
    b1, b2 = state.betas
    g = grads.float()
    m = b1 * state.exp_avg + (1 - b1) * g
    v = b2 * state.exp_avg_sq + (1 - b2) * g * g
    if released:
        return m / torch.sqrt(v + state.eps)
    t = state.step + 1
    return (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + state.eps)


def trainable_linears(model) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` modules whose weights are the model's trainable parameters, in the
    order of ``model.parameters()`` (the optimizer's order).

    Raises:
        ValueError: a trainable parameter that is not the weight of a bias-free (or
            frozen-bias) ``nn.Linear``, or no trainable parameter.
    """
    owner = {
        id(m.weight): m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and (m.bias is None or not m.bias.requires_grad)
    }
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if id(p) not in owner:
            raise ValueError(
                f"per-sample gradients need every trainable parameter to be a linear weight "
                f"(LoRA's are); {name} is not"
            )
        out.append(owner[id(p)])
    if not out:
        raise ValueError("the model has no trainable parameter (apply LoRA first)")
    return out


def gradient_dim(model) -> int:
    """P, the trainable parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def per_sample_gradients(
    model, batch: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample gradients of each sample's mean response-token loss, for a padded batch
    (one sample per row, ``attention_mask``; data/packing.collate_rows with packed=False).

    Args:
        model: a causal LM whose trainable parameters are linear weights (LoRA).
        batch: input_ids, attention_mask, position_ids, labels (B, L); every row has at least
            one target.
        autocast_dtype: e.g. torch.bfloat16 for the forward, None for the model's dtype.

    Returns:
        ((B, P) float32 gradients, in ``model.parameters()`` order of the trainable ones;
        (B,) float32 mean token losses, nats).

    Raises:
        ValueError: a row without a target, or a parameter :func:`trainable_linears` refuses.
    """
    linears = trainable_linears(model)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items() if k != "sample_index"}
    inputs: dict[int, torch.Tensor] = {}
    grads_out: dict[int, torch.Tensor] = {}

    def forward_hook(module, args, output):
        key = id(module)
        inputs[key] = args[0].detach()

        def keep(g):
            grads_out[key] = g.detach()

        output.register_hook(keep)

    handles = [m.register_forward_hook(forward_hook) for m in linears]
    try:
        autocast = (
            torch.autocast(device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else nullcontext()
        )
        with autocast:
            logits = model(
                input_ids=batch["input_ids"],
                attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"),
                use_cache=False,
            ).logits
        labels = batch["labels"][:, 1:]
        per_token = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().transpose(1, 2),
            labels,
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        counts = (labels != IGNORE_INDEX).sum(dim=1)
        if bool((counts == 0).any()):
            raise ValueError("a sample in the batch has no response tokens; filter it out first")
        losses = per_token.sum(dim=1) / counts
        model.zero_grad(set_to_none=True)
        losses.sum().backward()
    finally:
        for h in handles:
            h.remove()
    parts = []
    for m in linears:
        x, g = inputs[id(m)].float(), grads_out[id(m)].float()
        parts.append(torch.einsum("bto,bti->boi", g, x).reshape(g.shape[0], -1))
    model.zero_grad(set_to_none=True)
    return torch.cat(parts, dim=1), losses.detach()


def normalise_rows(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """(B, d) rows divided by max(L2 norm, eps)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(eps)
