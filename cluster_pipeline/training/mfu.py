"""Model FLOPs utilisation: the share of a GPU's peak arithmetic a training run turned into
model work (docs/design.md, step 4).

    MFU = k x parameters x real tokens / (seconds x ranks x peak FLOP/s per rank)

with k = 6 for full fine-tuning (a forward pass costs 2 FLOPs per parameter and token, the
backward twice that: Kaplan et al. 2020, section 2.1; the PaLM paper's appendix B defines MFU
with it) and k = 4 under LoRA (frozen weights need no weight gradients: the backward computes
only the input gradients, about 2 FLOPs per parameter and token). Attention's own FLOPs and
padding are left out: MFU counts useful model work only. Real tokens are the tokens of samples
(no padding, no placeholder).

Pure Python: the training loop records it on CUDA runs, the report reads it back, and the GPU
benchmark (``benchmarks/gpu_step.py``) prints it.
"""

from __future__ import annotations

from typing import Any

# Dense bfloat16 tensor-core peak per GPU (FLOP/s), from NVIDIA's data sheets (the "with
# sparsity" figures halved); matched against torch.cuda.get_device_name(), first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bfloat16 peak (FLOP/s) of the GPU named ``device_name`` (e.g. ``"NVIDIA
    H200"``), or None for a device not in :data:`PEAK_BF16_FLOPS` (no MFU is claimed then)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in device_name:
            return flops
    return None


def mfu(
    parameters: int,
    real_tokens: int,
    seconds: float,
    peak_flops_per_rank: float,
    ranks: int = 1,
    lora: bool = False,
) -> float:
    """Model FLOPs utilisation (module docstring's formula), a fraction in [0, 1] for a real
    run.

    Args:
        parameters: the model's parameter count N (frozen ones included).
        real_tokens: sample tokens processed, summed over ranks.
        seconds: wall seconds of the steps.
        peak_flops_per_rank: one GPU's peak FLOP/s.
        ranks: GPUs that shared the work.
        lora: adapters only (k = 4 instead of 6).

    Raises:
        ValueError: seconds, peak or ranks not positive.
    """
    if seconds <= 0 or peak_flops_per_rank <= 0 or ranks < 1:
        raise ValueError(
            f"seconds {seconds}, peak {peak_flops_per_rank} and ranks {ranks} must be positive"
        )
    k = 4 if lora else 6
    return k * parameters * real_tokens / (seconds * ranks * peak_flops_per_rank)


def mfu_record(
    parameters: int,
    real_tokens: int,
    seconds: float,
    device_name: str,
    ranks: int,
    lora: bool = False,
) -> dict[str, Any]:
    """What ``training_info.json`` keeps under ``"mfu"``: the figures and, where the device's
    peak is known (:func:`peak_flops`), ``value`` (the MFU, 4 decimals); ``value`` None
    otherwise."""
    peak = peak_flops(device_name)
    value = (
        round(mfu(parameters, real_tokens, seconds, peak, ranks, lora), 4)
        if peak is not None and seconds > 0
        else None
    )
    return {
        "value": value,
        "parameters": int(parameters),
        "real_tokens": int(real_tokens),
        "seconds": round(float(seconds), 3),
        "ranks": int(ranks),
        "device": device_name,
        "peak_flops_per_rank": peak,
        "flops_per_token_per_parameter": 4 if lora else 6,
    }
