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
tensor is ever formed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from cluster_pipeline.data.packing import can_pack, collate_rows, real_tokens, token_batches
from cluster_pipeline.data.tokenization import IGNORE_INDEX, EncodedSample, length_batches


@dataclass(frozen=True)
class BatchEmbedding:
    """Per-sample results of one batch.

    Attributes:
        embedding: (B, d) float32, e above.
        hidden_mean: (B, d) float32, (1/T) sum_t h_t: the mean final hidden state over the
            positions that predict the response tokens (a second representation from the same
            forward pass; arXiv 2503.01807 reports it strong for data selection).
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


@torch.inference_mode()
def embed_batch(
    model,
    batch: dict[str, torch.Tensor],
    chunk_rows: int = 1024,
    autocast_dtype: torch.dtype | None = None,
) -> BatchEmbedding:
    """Gradient-proxy embeddings of one batch: padded (one sample per row, with an
    ``attention_mask``; :func:`~cluster_pipeline.data.tokenization.collate`) or packed (several
    samples per row, no mask, ``sample_index`` naming each token's sample;
    :func:`~cluster_pipeline.data.packing.collate_rows`). Results are per sample, in
    ``sample_index`` order (row order for a batch without it), and equal between the two layouts
    to float32 rounding.

    Every sample must have at least one response token (callers drop the others first).

    Raises:
        ValueError: a sample of the batch has no response token.
    """
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    if "sample_index" in batch:
        owner = batch["sample_index"]
    else:
        owner = torch.arange(batch["input_ids"].shape[0], device=device)[:, None].expand_as(
            batch["input_ids"]
        )
    n_samples = int(owner.max()) + 1
    decoder, head = decoder_and_head(model)
    autocast = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else nullcontext()
    )
    with autocast:
        hidden = decoder(
            input_ids=batch["input_ids"],
            attention_mask=batch.get("attention_mask"),
            position_ids=batch["position_ids"],
            use_cache=False,
        ).last_hidden_state
        # Position i predicts token i + 1 (a packed sample's first label is -100, so no
        # position predicts across a sample boundary).
        targets = batch["labels"][:, 1:]
        mask = targets != IGNORE_INDEX
        rows, cols = mask.nonzero(as_tuple=True)
        h = hidden[:, :-1][rows, cols]
        logp = gold_log_probs(h, targets[rows, cols], head, chunk_rows)
    sample = owner[:, 1:][rows, cols]
    counts = torch.bincount(sample, minlength=n_samples)
    if bool((counts == 0).any()):
        raise ValueError("a sample in the batch has no response tokens; filter it out first")
    coef = (logp.exp() - 1.0) / counts[sample].float()
    d = hidden.shape[-1]
    emb = torch.zeros(n_samples, d, dtype=torch.float32, device=device)
    emb.index_add_(0, sample, coef[:, None] * h.float())
    hidden_mean = torch.zeros(n_samples, d, dtype=torch.float32, device=device)
    hidden_mean.index_add_(0, sample, h.float())
    hidden_mean /= counts[:, None].float()
    loss = torch.zeros(n_samples, dtype=torch.float32, device=device)
    loss.index_add_(0, sample, -logp)
    loss /= counts.float()
    return BatchEmbedding(
        embedding=emb.cpu().numpy(),
        hidden_mean=hidden_mean.cpu().numpy(),
        mean_loss=loss.cpu().numpy(),
        n_response_tokens=counts.cpu().numpy().astype(np.int64),
    )


def embed_samples(
    model,
    encoded: Sequence[EncodedSample],
    pad_token_id: int,
    *,
    max_batch_size: int = 16,
    max_batch_tokens: int = 8192,
    packing: bool = True,
    max_packed_length: int = 512,
    chunk_rows: int = 1024,
    autocast_dtype: torch.dtype | None = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[BatchEmbedding, bool]:
    """:func:`embed_batch` over many samples, batched: packed (``packing`` and a model that keeps
    packed samples apart, :func:`~cluster_pipeline.data.packing.can_pack`): groups of at most
    ``max_batch_tokens`` real tokens in rows of at most ``max_packed_length``; else padded:
    length-sorted batches of at most ``max_batch_size`` samples and ``max_batch_tokens`` padded
    tokens. The results do not depend on the batching (to float32 rounding).

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
    packed = packing and bool(usable) and can_pack(model)
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
        out = embed_batch(model, batch, chunk_rows, autocast_dtype)
        emb[idx], hmean[idx] = out.embedding, out.hidden_mean
        loss[idx], counts[idx] = out.mean_loss, out.n_response_tokens
        if on_batch is not None:
            on_batch(len(idx), real_tokens(batch))
    return BatchEmbedding(emb, hmean, loss, counts), packed
