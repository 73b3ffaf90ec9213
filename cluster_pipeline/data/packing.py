"""Padding-free batches: several samples concatenated into one row, attention kept apart.

A packed row holds samples back to back, ``position_ids`` restarting at 0 for each; the batch
carries no ``attention_mask``. transformers (5.x, ``masking_utils.find_packed_sequence_indices``)
reads a position that does not follow its predecessor as the start of a new sequence and builds
a block-causal mask for sdpa and eager attention (flash-attention takes the same boundaries as
``cu_seqlens``), so no token attends across a sample boundary. That path is taken only without a
KV cache (``use_cache=False``), which every forward here passes. Each sample's first label is
set to ``-100``: in a padded row that label is never a target (position 0 predicts nothing
before it), in a packed row it would be the target of the previous sample's last position.
With that, every sample's outputs, losses and gradients equal those of its padded batch (to
float32 rounding; ``cluster_pipeline_tests/data/test_packing.py``).

Rows are bounded (``max_row_tokens``): on CPU, sdpa computes a packed row's whole score matrix
under the block mask, so a row of length L costs L^2 attention work however many samples it
holds (torchtune's packed datasets bound rows the same way; ``benchmarks/
training_throughput.py`` measures which bound is fastest). Samples are put into as few rows as
first-fit decreasing bin packing finds, spread evenly over them (:func:`pack_rows`).

This module needs torch alone (no pydantic, polars or Dagster), so the throughput benchmark's
timing core runs it on machines that have nothing else. A batch is described by rows of sample
positions (``list[list[int]]``): a padded batch is the
special case of one sample per row, collated with an attention mask (:func:`collate_rows`).
:func:`can_pack` checks a model once before its first packed batch (a model whose attention does
not honour packed position ids falls back to padding).

A packed batch also carries its sample boundaries as ``cu_seq_lens`` (the cumulative sequence
lengths over the flattened rows, the form variable-length attention kernels take) and
``max_length``, built here once per batch from what the collate knows: on a GPU the attention of
:mod:`cluster_pipeline.data.attention` computes each sample's own causal attention from them
instead of a row x row block mask.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # imported where a tensor is made: loading the Definitions needs no torch
    import torch

# The label of a token that is not a target (PyTorch's cross-entropy ``ignore_index``).
IGNORE_INDEX = -100


class TokenSample(Protocol):
    """What a batch is built from: token ids and labels of equal length (an
    :class:`~cluster_pipeline.data.tokenization.EncodedSample`)."""

    @property
    def input_ids(self) -> list[int]:
        """The sample's token ids (int, length T)."""
        ...

    @property
    def labels(self) -> list[int]:
        """The training labels (int, length T): the token id where the loss counts, -100
        elsewhere."""
        ...

    def __len__(self) -> int: ...


def first_fit_rows(lengths: Sequence[int], max_row_tokens: int) -> list[list[int]]:
    """First-fit decreasing bin packing alone: each sample, longest first (ties by index), into
    the first row with room, rows of at most ``max_row_tokens`` tokens (a longer sample gets a
    row of its own). The row count :func:`pack_rows` starts from.

    Raises:
        ValueError: ``max_row_tokens`` < 1.
    """
    if max_row_tokens < 1:
        raise ValueError(f"max_row_tokens must be >= 1, got {max_row_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_row_tokens - lengths[i])
    return rows


def pack_rows(lengths: Sequence[int], max_row_tokens: int) -> list[list[int]]:
    """Samples into as few rows of at most ``max_row_tokens`` tokens as first-fit decreasing
    bin packing finds, then spread over those rows as evenly as the longest-processing-time rule
    makes them (each sample, longest first, into the row with the fewest tokens so far), when
    that shortens the longest row without passing the bound. A batch's rows are padded to its
    longest, so even rows waste the least: [5, 4, 3, 3, 2] into rows of 8 is [5 + 3], [4 + 3],
    [2] by first fit (longest 8, 7 padding tokens) and [5], [4 + 2], [3 + 3] balanced (longest
    6, 1 padding token). A sample longer than the bound gets a row of its own.

    Args:
        lengths: tokens per sample.
        max_row_tokens: the row bound.

    Returns:
        Rows of indices into ``lengths``; every index in exactly one row, each row's samples in
        decreasing length (ties by index).

    Raises:
        ValueError: ``max_row_tokens`` < 1.
    """
    rows = first_fit_rows(lengths, max_row_tokens)
    if len(rows) < 2:
        return rows
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    even: list[list[int]] = [[] for _ in rows]
    filled = [0] * len(rows)
    for i in order:
        r = min(range(len(rows)), key=lambda k: (filled[k], k))
        even[r].append(i)
        filled[r] += lengths[i]
    longest_ffd = max(sum(lengths[i] for i in row) for row in rows)
    bound = max(max_row_tokens, max(lengths))
    if max(filled) < longest_ffd and max(filled) <= bound:
        return even
    return rows


def token_batches(
    lengths: Sequence[int], max_batch_tokens: int, max_row_tokens: int, max_rows: int | None = None
) -> list[list[list[int]]]:
    """Packed batches for a pass over samples whose order does not matter (the embedding pass,
    the held-out loss): samples sorted by length, cut into consecutive groups of at most
    ``max_batch_tokens`` real tokens (a longer sample is a group of its own), each group packed
    into rows (:func:`pack_rows`), at most ``max_rows`` rows per batch.

    Returns:
        Batches, each a list of rows of indices into ``lengths``; every index exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i in order:
        if current and total + lengths[i] > max_batch_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += lengths[i]
    if current:
        groups.append(current)
    batches = []
    for group in groups:
        packed = pack_rows([lengths[i] for i in group], max_row_tokens)
        rows = [[group[j] for j in row] for row in packed]
        step = max_rows or len(rows)
        batches += [rows[k : k + step] for k in range(0, len(rows), step)]
    return batches


def length_batches(
    lengths: Sequence[int], max_batch_size: int, max_batch_tokens: int
) -> list[list[int]]:
    """Group sample indices into batches of similar length to cut padding.

    Samples are sorted by length (stable, so ties keep input order); a batch closes when it
    holds ``max_batch_size`` samples or its padded size (count x longest) would pass
    ``max_batch_tokens``. A single sample longer than ``max_batch_tokens`` gets its own batch.
    """
    if max_batch_size < 1 or max_batch_tokens < 1:
        raise ValueError("max_batch_size and max_batch_tokens must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Sorted ascending, so sample i is the longest of the batch it would join.
        padded = lengths[i] * (len(current) + 1)
        if current and (len(current) >= max_batch_size or padded > max_batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate_rows(
    samples: Sequence[TokenSample],
    rows: Sequence[Sequence[int]],
    pad_token_id: int,
    packed: bool | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of one batch of rows.

    Args:
        samples: the encoded samples the rows index into.
        rows: per row, the positions in ``samples`` it holds, in order.
        pad_token_id: the id that fills ``input_ids`` past a row's end (its labels are -100).
        packed: True: no attention mask, positions restart per sample (several samples per row
            allowed); False: one sample per row, right-padded with an attention mask (the
            padded layout of :func:`~cluster_pipeline.data.tokenization.collate`); None: packed
            when some row holds more than one sample.

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` and ``sample_index`` (the position in
        ``rows``' flattened order of the sample a token belongs to, -1 on padding), each (R, L)
        int64 with L the longest row; ``attention_mask`` (R, L) int64 when not packed. Padding
        at a row's end continues that row's positions, so it forms no sequence of its own and
        real tokens, which all come first, never attend to it. Packed batches also hold
        ``cu_seq_lens`` (S + 1,) int32, the offsets in the flattened (R x L) tokens where each
        of the S samples starts, then R x L (a row's padding counted in its last sample, as its
        positions say), and ``max_length`` () int64, the longest such segment
        (:func:`sequence_boundaries`).

    Raises:
        ValueError: ``packed=False`` with a row of several samples, or an empty row.
    """
    if any(len(r) == 0 for r in rows):
        raise ValueError("a row holds no sample")
    if packed is None:
        packed = any(len(r) > 1 for r in rows)
    if not packed and any(len(r) > 1 for r in rows):
        raise ValueError("padded batches hold one sample per row")
    import torch

    width = max(sum(len(samples[i]) for i in r) for r in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    index = torch.full(shape, -1, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    k = 0
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            s = samples[i]
            n = len(s)
            ids[r, at : at + n] = torch.tensor(s.input_ids, dtype=torch.long)
            labels[r, at : at + n] = torch.tensor(s.labels, dtype=torch.long)
            labels[r, at] = IGNORE_INDEX
            positions[r, at : at + n] = torch.arange(n)
            index[r, at : at + n] = k
            mask[r, at : at + n] = 1
            at += n
            k += 1
        if at < width:
            start = int(positions[r, at - 1]) + 1
            positions[r, at:] = torch.arange(start, start + width - at)
    out = {"input_ids": ids, "labels": labels, "position_ids": positions, "sample_index": index}
    if not packed:
        out["attention_mask"] = mask
    else:
        lengths = [[len(samples[i]) for i in row] for row in rows]
        cu, longest = sequence_boundaries(lengths, width)
        out["cu_seq_lens"] = torch.tensor(cu, dtype=torch.int32)
        out["max_length"] = torch.tensor(longest, dtype=torch.long)
    return out


def sequence_boundaries(row_lengths: Sequence[Sequence[int]], width: int) -> tuple[list[int], int]:
    """The sample boundaries of a packed batch in the form variable-length attention takes
    (FlashAttention's ``cu_seqlens``; ``torch.nn.attention.varlen.varlen_attn``'s ``cu_seq_q``):
    the rows flattened into one sequence of R x ``width`` tokens, the offset where each sample
    starts, then R x ``width``. A row's padding (after its real tokens) is counted in its last
    sample: its positions continue that sample's (:func:`collate_rows`), so the padding
    attends to that sample, which never attends to it (causal). [[3, 2], [4]] in rows of 5:
    offsets [0, 3, 5, 10] (the second row's last token is padding, counted in its sample),
    longest segment 5.

    Args:
        row_lengths: per row, the token counts of its samples in order (each row's sum at most
            ``width``).
        width: the batch's row length L.

    Returns:
        (offsets, S + 1 ints for S samples; the longest segment in tokens).

    Raises:
        ValueError: an empty row, a sample of no token, or a row longer than ``width``.
    """
    offsets = [0]
    for r, row in enumerate(row_lengths):
        if not row or min(row) < 1:
            raise ValueError(f"row {r} holds no sample or a sample of no token: {list(row)}")
        if sum(row) > width:
            raise ValueError(f"row {r} holds {sum(row)} tokens, more than the width {width}")
        start = r * width
        for n in row[:-1]:
            start += n
            offsets.append(start)
        offsets.append((r + 1) * width)
    longest = max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
    return offsets, longest


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a batch that belong to a sample."""
    return int((batch["sample_index"] >= 0).sum())


def padded_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the batch's tensors hold, padding included (R x L)."""
    return int(batch["input_ids"].numel())


@dataclass(frozen=True)
class PackCheck:
    """What :func:`pack_check` measured on a model, in logit units.

    Attributes:
        ok: packed rows may be used (both differences within their tolerances).
        crossing: the largest change of a probe sample's logits when the sample packed before
            it changes (0 for a model that keeps samples apart, in every dtype).
        crossing_tolerance: the bound ``crossing`` must not pass.
        alone: the largest difference between the probe sample's logits packed and alone.
        alone_tolerance: the bound ``alone`` must not pass.
        dtype: the least precise floating dtype the forward computed in (``"torch.bfloat16"``).
        logit_scale: the largest absolute logit of the probe sample alone.
    """

    ok: bool
    crossing: float
    crossing_tolerance: float
    alone: float
    alone_tolerance: float
    dtype: str
    logit_scale: float

    def reason(self, model_name: str) -> str:
        """One sentence for the log and the asset's metadata: why ``model_name`` does or does
        not pack, with the figures."""
        if self.ok:
            return f"{model_name} keeps packed samples apart ({self.dtype}): packed rows used"
        if self.crossing > self.crossing_tolerance:
            why = (
                f"attends across packed samples: a sample's logits moved by {self.crossing:.3g} "
                f"when the sample before it in the row changed (bound {self.crossing_tolerance:.3g}"
                f" for {self.dtype})"
            )
        else:
            why = (
                f"does not honour restarted position ids: a packed sample's logits differ from "
                f"its logits alone by {self.alone:.3g} (bound {self.alone_tolerance:.3g} for "
                f"{self.dtype}, logits up to {self.logit_scale:.3g})"
            )
        return f"{model_name} {why}"


# The gate's bounds in units of the compute dtype's machine epsilon times the largest logit.
# A model that keeps samples apart moves no logit when another sample's tokens change: exact
# zero measured in float32, bfloat16 and float16 on CPU; 8 eps leaves room for GPU matrix
# kernels whose reduction order depends on a tile's place (stream-K), a few roundings that the
# layers carry on, while the weakest crossing measured (a 2-layer random Llama) moves logits by
# 0.29 of the largest, 5x the bound in bfloat16 (8 x 2^-7 = 0.06). Packed logits differ from
# the logits alone by the rounding of kernels run on other shapes, accumulated over the layers
# (a few eps per logit's magnitude for 22 layers by a random-walk estimate; 32 leaves room).
CROSSING_EPS = 8
ALONE_EPS = 32


def pack_check(model, atol: float = 1e-3, vocab_size: int | None = None) -> PackCheck:
    """Whether ``model`` keeps packed samples apart, told from its dtype's rounding.

    Three probe sequences of random tokens: ``a`` and ``a'`` (16 tokens each, different) and
    ``b`` (8 tokens). One forward runs ``b`` alone, one the batch of two packed rows
    ``[a, b]`` and ``[a', b]`` (positions restarting at ``b``). Two differences, taken on
    ``b``'s logits:

    - *crossing* (the structure): row ``[a, b]`` against row ``[a', b]``. Both rows have the
      same shape, positions and mask, so every kernel computes ``b``'s tokens by the same
      operations in the same order; a model that keeps samples apart reads ``a``'s tokens only
      through masked attention scores, whose weights are exact zeros, and gives equal logits
      in any dtype (bitwise on the CPU; a GPU's matrix kernels may round a few values by a
      tile's place). A model that attends across samples moves them by a fraction of
      their magnitude (0.3 to 1.8 x the largest logit for random Llamas of 2 to 22 layers in
      float32, bfloat16 and float16). Bound: ``atol + 8 eps |z|max``.
    - *alone* (restarted positions honoured): row ``[a, b]`` against ``b`` alone. The two
      forwards run kernels of different shapes, so the logits differ by the dtype's rounding
      accumulated over the layers; a model that ignores position ids differs by whole units.
      Bound: ``atol + 32 eps |z|max``.

    ``eps`` is the machine epsilon of the least precise floating dtype the forward computed in
    (the logits' and the parameters' dtypes: bfloat16 2^-7, float16 2^-10, float32 2^-23),
    ``|z|max`` the largest absolute logit of ``b`` alone. In float32 both bounds are ``atol``
    plus at most 4e-6 of the largest logit, as before; a model held in bfloat16 is no longer
    refused for its rounding (the fixed atol 1e-3 refused a 1.1B Llama in bfloat16 on an
    H200).

    Runs in eval mode and restores the mode; costs two forward passes over 8 and 2 x 24 tokens.
    The packed forward carries the rows' boundaries where the model's attention reads them (the
    variable-length kernel of data/attention.py), so the check covers the attention packed
    batches run with. ``model`` may be a DDP or FSDP wrapper (every rank must call it then).

    Args:
        model: a causal LM (``model(input_ids=..., position_ids=..., use_cache=False).logits``).
        atol: the absolute part of both bounds (logit units).
        vocab_size: the vocabulary the probe tokens are drawn from; default the config's.

    Returns:
        The figures and the verdict (:class:`PackCheck`).
    """
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            params = list(model.parameters())
            device = params[0].device
            vocab = int(vocab_size or model.config.get_text_config().vocab_size)
            g = torch.Generator().manual_seed(0)
            firsts = torch.randint(0, vocab, (2, 16), generator=g).to(device)
            b = torch.randint(0, vocab, (1, 8), generator=g).to(device)
            alone = model(input_ids=b, use_cache=False).logits[0]
            rows = torch.cat([firsts, b.expand(2, -1)], dim=1)
            positions = torch.cat([torch.arange(16), torch.arange(8)])[None].expand(2, -1)
            packed = model(
                input_ids=rows,
                position_ids=positions.to(device),
                use_cache=False,
                **_boundaries(model, [[16, 8], [16, 8]], 24, device),
            ).logits[:, 16:]
            dtypes = {alone.dtype} | {p.dtype for p in params if p.is_floating_point()}
            least = max(dtypes, key=lambda d: torch.finfo(d).eps)
            eps = torch.finfo(least).eps
            scale = float(alone.float().abs().max())
            crossing = float((packed[0].float() - packed[1].float()).abs().max())
            apart = float((packed[0].float() - alone.float()).abs().max())
            crossing_tol = atol + CROSSING_EPS * eps * scale
            alone_tol = atol + ALONE_EPS * eps * scale
            return PackCheck(
                ok=crossing <= crossing_tol and apart <= alone_tol,
                crossing=crossing,
                crossing_tolerance=crossing_tol,
                alone=apart,
                alone_tolerance=alone_tol,
                dtype=str(least),
                logit_scale=scale,
            )
    finally:
        model.train(was_training)


def _boundaries(model, row_lengths: list[list[int]], width: int, device) -> dict:
    """The boundary keyword arguments of a packed forward (:func:`sequence_boundaries`) where
    the model's attention reads them (data/attention.py: the variable-length kernel), so the
    gate checks the attention packed batches will run; {} elsewhere."""
    from cluster_pipeline.data.attention import READS_BOUNDARIES, implementation

    if implementation(model) not in READS_BOUNDARIES:
        return {}
    import torch

    offsets, longest = sequence_boundaries(row_lengths, width)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pack_check_cached(model) -> PackCheck:
    """:func:`pack_check` of ``model`` (default bounds and vocabulary), run once per model,
    attention implementation, dtype and device and remembered while the model lives: the
    embedding pass embeds chunk after chunk with the same model."""
    first = next(model.parameters())
    config = getattr(model, "config", None)
    key = (getattr(config, "_attn_implementation", None), first.dtype, first.device)
    seen = _CHECKED.setdefault(model, {})
    if key not in seen:
        seen[key] = pack_check(model)
    return seen[key]


def can_pack(model, atol: float = 1e-3, vocab_size: int | None = None) -> bool:
    """Whether ``model`` keeps packed samples apart (:func:`pack_check`'s verdict; its
    docstring gives the criterion and why it holds in bfloat16 and float16)."""
    return pack_check(model, atol, vocab_size).ok
