"""The gradient-proxy embedding (docs/design.md, step 1).

For a sample with response tokens t = 1..T (labels != -100), h_t the final hidden state (after
the final norm: the vector the LM head maps to logits z_t) at the position that predicts token t,
and p_t = softmax(z_t)[y_t] the probability of the gold token:

    e = (1/T) * sum_t (p_t - 1) * h_t

This is the gold-class row of the BADGE last-layer gradient (Ash et al., 2020: dL/dW = (p -
onehot(y)) h^T), averaged over the response. Equivalently, with L the mean token cross-entropy
and h detached, e = sum_t (dL/dz_{t,y_t}) * h_t, since dL/dz_{t,y_t} = (p_t - 1) / T.

Cost: one decoder forward over the batch; the LM head is applied only to response positions and
in row chunks, with a float32 log-softmax and gather per chunk, so no (B, L, V) probability
tensor is ever formed. A batch's bookkeeping (which positions are response tokens, whose they
are, how many each sample has) is done on the CPU from the collated labels and its results
stay on the device until the pass's samples are done (or every 4,096 samples), so a GPU never
waits for the CPU between batches: the host reads nothing back per batch, and collating the
next batch overlaps the device's work on this one. On a GPU packed batches attend with the
variable-length kernel (data/attention.py) for the length of the pass.

Pooling. ``hidden_mean`` is the mean of h_t over the response positions above
(``pooling="response_mean"``, the pool pass's) or, for rds's own pass (RDS+, Ivison et al.
2025; the authors' ``minimal_multitask/compute_influence_cosinesim.py:132-137``, after SGPT),
the position-weighted mean of the final hidden states over every position p = 0 .. L-1 of the
sample, prompt and response (``pooling="position_weighted"``):

    hidden_mean = sum_p (p + 1) h_p / sum_p (p + 1)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from cluster_pipeline.data.attention import forward_kwargs, packed_attention
from cluster_pipeline.data.packing import (
    IGNORE_INDEX,
    TokenSample,
    collate_rows,
    length_batches,
    pack_check_cached,
    real_tokens,
    token_batches,
)

# How hidden_mean pools the final hidden states (module docstring).
Pooling = Literal["response_mean", "position_weighted"]


class PassSample(TokenSample, Protocol):
    """What the embedding pass reads of a sample: token ids and labels
    (:class:`~cluster_pipeline.data.packing.TokenSample`) and why it is not run, if it is not
    (an :class:`~cluster_pipeline.data.tokenization.EncodedSample`)."""

    @property
    def skip_reason(self) -> str | None:
        """None for a sample to embed, else why it is skipped."""
        ...


@dataclass(frozen=True)
class BatchEmbedding:
    """Per-sample results of one batch.

    Attributes:
        embedding: (B, d) float32, e above.
        hidden_mean: (B, d) float32, (1/T) sum_t h_t: the mean final hidden state over the
            positions that predict the response tokens (a second representation from the same
            forward pass; arXiv 2503.01807 reports it strong for data selection); under
            ``pooling="position_weighted"`` the position-weighted mean over every position of
            the sample instead (module docstring).
        mean_loss: (B,) float32, mean token cross-entropy over the response (nats).
        n_response_tokens: (B,) int64, T.
    """

    embedding: np.ndarray
    hidden_mean: np.ndarray
    mean_loss: np.ndarray
    n_response_tokens: np.ndarray


def decoder_and_head(model):
    """The model's decoder stack (returning post-final-norm hidden states) and its LM head."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    head = model.get_output_embeddings()
    if decoder is None or head is None:
        raise TypeError(f"{type(model).__name__} exposes no decoder/LM head; use a causal LM.")
    return decoder, head


def gold_log_probs(
    hidden: torch.Tensor, targets: torch.Tensor, head, chunk_rows: int
) -> torch.Tensor:
    """Log softmax(head(hidden))[targets] for (M, d) hidden rows and (M,) targets, in chunks of
    ``chunk_rows`` rows; returns (M,) float32. Peak extra memory is chunk_rows x V floats."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_rows):
        stop = start + chunk_rows
        logits = head(hidden[start:stop]).float()
        gold = logits.gather(1, targets[start:stop, None]).squeeze(1)
        out[start:stop] = gold - torch.logsumexp(logits, dim=-1)
    return out


@dataclass(frozen=True)
class _DeviceEmbedding:
    """:class:`BatchEmbedding` whose vectors are still on the model's device."""

    embedding: torch.Tensor
    hidden_mean: torch.Tensor
    mean_loss: torch.Tensor
    n_response_tokens: np.ndarray

    def host(self) -> BatchEmbedding:
        return BatchEmbedding(
            embedding=self.embedding.cpu().numpy(),
            hidden_mean=self.hidden_mean.cpu().numpy(),
            mean_loss=self.mean_loss.cpu().numpy(),
            n_response_tokens=self.n_response_tokens,
        )


def _position_weighted(
    hidden: torch.Tensor, batch: dict[str, torch.Tensor], owner: torch.Tensor, n_samples: int
) -> torch.Tensor:
    """(n_samples, d) float32 sum_p (p + 1) h_p / sum_p (p + 1) over each sample's positions
    (module docstring): ``owner`` (R, L) names each token's sample (-1 on padding), p is its
    position within its sample (``position_ids``, else its column)."""
    valid = owner >= 0
    if "attention_mask" in batch:
        valid &= batch["attention_mask"].cpu().bool()
    rows, cols = valid.nonzero(as_tuple=True)
    positions = batch["position_ids"].cpu()[rows, cols] if "position_ids" in batch else cols
    device = hidden.device
    weight = (positions + 1).to(device=device, dtype=torch.float32)
    sample = owner[rows, cols].to(device)
    pooled = torch.zeros(n_samples, hidden.shape[-1], dtype=torch.float32, device=device)
    pooled.index_add_(0, sample, weight[:, None] * hidden[rows.to(device), cols.to(device)].float())
    total = torch.zeros(n_samples, dtype=torch.float32, device=device)
    total.index_add_(0, sample, weight)
    return pooled / total[:, None]


@torch.inference_mode()
def _embed_on_device(
    model,
    batch: dict[str, torch.Tensor],
    chunk_rows: int,
    autocast_dtype: torch.dtype | None,
    pooling: Pooling = "response_mean",
) -> _DeviceEmbedding:
    device = next(model.parameters()).device
    labels = batch["labels"].cpu()
    if "sample_index" in batch:
        owner = batch["sample_index"].cpu()
    else:
        owner = torch.arange(labels.shape[0])[:, None].expand_as(labels)
    n_samples = int(owner.max()) + 1
    # Position i predicts token i + 1 (a packed sample's first label is -100, so no position
    # predicts across a sample boundary). Found on the CPU: no device synchronisation.
    targets = labels[:, 1:]
    rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
    sample = owner[:, 1:][rows, cols]
    counts = torch.bincount(sample, minlength=n_samples)
    if bool((counts == 0).any()):
        raise ValueError("a sample in the batch has no response tokens; filter it out first")
    gold = targets[rows, cols].to(device)
    sample_d, counts_d = sample.to(device), counts.to(device)
    rows, cols = rows.to(device), cols.to(device)
    decoder, head = decoder_and_head(model)
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else nullcontext()
    )
    with autocast:
        hidden = decoder(**forward_kwargs(model, batch, device)).last_hidden_state
        h = hidden[:, :-1][rows, cols]
        logp = gold_log_probs(h, gold, head, chunk_rows)
    coef = (logp.exp() - 1.0) / counts_d[sample_d].float()
    d = hidden.shape[-1]
    emb = torch.zeros(n_samples, d, dtype=torch.float32, device=device)
    emb.index_add_(0, sample_d, coef[:, None] * h.float())
    if pooling == "position_weighted":
        hidden_mean = _position_weighted(hidden, batch, owner, n_samples)
    else:
        hidden_mean = torch.zeros(n_samples, d, dtype=torch.float32, device=device)
        hidden_mean.index_add_(0, sample_d, h.float())
        hidden_mean /= counts_d[:, None].float()
    loss = torch.zeros(n_samples, dtype=torch.float32, device=device)
    loss.index_add_(0, sample_d, -logp)
    loss /= counts_d.float()
    return _DeviceEmbedding(emb, hidden_mean, loss, counts.numpy().astype(np.int64))


def embed_batch(
    model,
    batch: dict[str, torch.Tensor],
    chunk_rows: int = 1024,
    autocast_dtype: torch.dtype | None = None,
    pooling: Pooling = "response_mean",
) -> BatchEmbedding:
    """Gradient-proxy embeddings of one batch: padded (one sample per row, with an
    ``attention_mask``; :func:`~cluster_pipeline.data.tokenization.collate`) or packed (several
    samples per row, no mask, ``sample_index`` naming each token's sample;
    :func:`~cluster_pipeline.data.packing.collate_rows`). Results are per sample, in
    ``sample_index`` order (row order for a batch without it), and equal between the two layouts
    to float32 rounding. The batch's tensors may be on the CPU (as collated) or the model's
    device; a packed batch's boundaries reach the model where its attention reads them
    (data/attention.py).

    Every sample must have at least one response token (callers drop the others first).
    ``pooling``: what ``hidden_mean`` pools (module docstring).

    Raises:
        ValueError: a sample of the batch has no response token.
    """
    return _embed_on_device(model, batch, chunk_rows, autocast_dtype, pooling).host()


# Samples whose vectors embed_samples keeps on the device before copying them to the host.
_HOST_EVERY = 4096


def embed_samples(
    model,
    encoded: Sequence[PassSample],
    pad_token_id: int,
    *,
    max_batch_size: int = 16,
    max_batch_tokens: int = 8192,
    packing: bool = True,
    max_packed_length: int = 512,
    chunk_rows: int = 1024,
    autocast_dtype: torch.dtype | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    pooling: Pooling = "response_mean",
) -> tuple[BatchEmbedding, bool]:
    """:func:`embed_batch` over many samples, batched: packed (``packing`` and a model that keeps
    packed samples apart, :func:`~cluster_pipeline.data.packing.pack_check`, checked once per
    model): groups of at most ``max_batch_tokens`` real tokens in rows of at most
    ``max_packed_length``; else padded: length-sorted batches of at most ``max_batch_size``
    samples and ``max_batch_tokens`` padded tokens. The results do not depend on the batching
    (to float32 rounding). On a GPU the model attends with the variable-length kernel for the
    length of the call (:func:`~cluster_pipeline.data.attention.packed_attention`).

    Args:
        model: the causal LM (eval mode).
        encoded: the samples; those with a ``skip_reason`` are not run.
        pad_token_id: the id padding is written with.
        max_batch_size: padded batches: most samples per batch.
        max_batch_tokens: most tokens per batch (packed: real tokens; padded: padded tokens).
        packing: pack where the model can.
        max_packed_length: most tokens per packed row.
        chunk_rows: LM-head rows per chunk (:func:`gold_log_probs`).
        autocast_dtype: e.g. torch.bfloat16 for autocast, None for the model's dtype.
        on_batch: called with (samples, real tokens) after each batch.
        pooling: what ``hidden_mean`` pools (module docstring).

    Returns:
        (results for every sample of ``encoded`` in order: zero vectors, nan loss and T = 0 for
        skipped ones; whether the batches were packed).
    """
    n = len(encoded)
    d = int(model.config.get_text_config().hidden_size)
    emb = np.zeros((n, d), dtype=np.float32)
    hmean = np.zeros((n, d), dtype=np.float32)
    loss = np.full(n, np.nan, dtype=np.float32)
    counts = np.zeros(n, dtype=np.int64)
    usable = [i for i, e in enumerate(encoded) if e.skip_reason is None]
    lengths = [len(encoded[i]) for i in usable]
    pending: list[tuple[list[int], _DeviceEmbedding]] = []

    def to_host() -> None:
        for idx, got in pending:
            host = got.host()
            emb[idx], hmean[idx] = host.embedding, host.hidden_mean
            loss[idx], counts[idx] = host.mean_loss, host.n_response_tokens
        pending.clear()

    with packed_attention(model, next(model.parameters()).device.type):
        packed = packing and bool(usable) and pack_check_cached(model).ok
        if packed:
            batches = [
                [[usable[j] for j in row] for row in rows]
                for rows in token_batches(lengths, max_batch_tokens, max_packed_length)
            ]
        else:
            batches = [
                [[usable[j]] for j in idx]
                for idx in length_batches(lengths, max_batch_size, max_batch_tokens)
            ]
        for rows in batches:
            idx = [i for row in rows for i in row]
            batch = collate_rows(encoded, rows, pad_token_id, packed=packed)
            got = _embed_on_device(model, batch, chunk_rows, autocast_dtype, pooling)
            pending.append((idx, got))
            if sum(len(i) for i, _ in pending) >= _HOST_EVERY:
                to_host()
            if on_batch is not None:
                on_batch(len(idx), real_tokens(batch))
        to_host()
    return BatchEmbedding(emb, hmean, loss, counts), packed
