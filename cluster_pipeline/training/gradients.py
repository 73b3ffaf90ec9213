"""Comparing the gradients of data-parallel ranks cheaply: a fixed random projection.

CluSTER's mechanism (its Fig. 6a) is that ranks trained on different clusters compute less
redundant gradients: the cosine similarity between the ranks' local gradients drops. A model's
gradient has as many coordinates as parameters, so each rank projects its local gradient g
(before DDP averages it) to D dimensions with a CountSketch (Charikar, Chen & Farach-Colton,
2002; a sparse Johnson-Lindenstrauss projection, Kane & Nelson, 2014):

    s[h(j)] += sigma(j) g_j      for every coordinate j,

with h(j) uniform in [0, D) and sigma(j) = +-1, both drawn from a fixed seed per parameter
tensor, so every rank and every step uses the same projection. E[<s_a, s_b>] = <g_a, g_b>, and
the cosine of two sketches is within about 1/sqrt(D) of the exact cosine. One pass over the
gradient (no D x P matrix), so a measurement costs a small fraction of a training step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

DEFAULT_SKETCH_DIM = 1024


def count_sketch(
    tensors: Iterable[torch.Tensor], dim: int = DEFAULT_SKETCH_DIM, seed: int = 0
) -> torch.Tensor:
    """(dim,) float64 CountSketch of the concatenation of ``tensors`` (e.g. every parameter's
    gradient, in a fixed order). Tensor k's hashes come from ``seed`` and k, so the same
    parameter order gives the same projection in every process."""
    out = torch.zeros(dim, dtype=torch.float64)
    for k, t in enumerate(tensors):
        flat = t.detach().reshape(-1).to("cpu", torch.float64)
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        buckets = torch.randint(0, dim, (flat.numel(),), generator=g)
        signs = torch.randint(0, 2, (flat.numel(),), generator=g, dtype=torch.int8)
        out.index_add_(0, buckets, flat * (2.0 * signs - 1.0))
    return out


def cosine_matrix(vectors: torch.Tensor) -> torch.Tensor:
    """(R, R) cosine similarities between the rows of (R, D) ``vectors`` (0 for a zero row)."""
    v = vectors.to(torch.float64)
    norms = v.norm(dim=1, keepdim=True).clamp_min(1e-300)
    unit = v / norms
    return unit @ unit.T


def mean_offdiagonal(matrix: torch.Tensor) -> float:
    """Mean of the off-diagonal entries of a square matrix (nan for 1 x 1)."""
    r = matrix.shape[0]
    if r < 2:
        return float("nan")
    return float((matrix.sum() - matrix.diagonal().sum()) / (r * (r - 1)))
