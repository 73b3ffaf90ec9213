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
"""

from __future__ import annotations

from collections.abc import Sequence
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
        real tokens, which all come first, never attend to it.

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
    return out


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a batch that belong to a sample."""
    return int((batch["sample_index"] >= 0).sum())


def padded_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the batch's tensors hold, padding included (R x L)."""
    return int(batch["input_ids"].numel())


def can_pack(model, atol: float = 1e-3, vocab_size: int | None = None) -> bool:
    """Whether ``model`` keeps packed samples apart: two short random sequences packed into
    one row must give the logits they give alone (max difference <= ``atol``; float32 rounding
    is ~1e-5, a sample attending across the boundary moves logits by whole units). Runs in eval
    mode and restores the mode; costs two forward passes over 14 tokens. ``model`` may be a
    DDP or FSDP wrapper (every rank must call it then); ``vocab_size`` defaults to its
    config's."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            vocab = int(vocab_size or model.config.get_text_config().vocab_size)
            g = torch.Generator().manual_seed(0)
            a = torch.randint(0, vocab, (1, 6), generator=g).to(device)
            b = torch.randint(0, vocab, (1, 8), generator=g).to(device)
            alone = model(input_ids=b, use_cache=False).logits[0]
            row = torch.cat([a, b], dim=1)
            positions = torch.cat([torch.arange(6), torch.arange(8)])[None].to(device)
            packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0, 6:]
            return bool((alone.float() - packed.float()).abs().max() <= atol)
    finally:
        model.train(was_training)
