"""Held-out loss: the token-weighted mean cross-entropy (nats) over the response tokens of the
held-out split, which ``raw_instructions`` sets aside before any selection; perplexity is its
exponential. Measured on every model, beside the benchmarks; its metrics are declared here
(:data:`METRICS`), reported as ``heldout_<key>``."""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from cluster_pipeline.data.tokenization import PackingSettings, SequenceSettings, encode_rows
from cluster_pipeline.evaluation.likelihood import response_losses, sequence_counts
from cluster_pipeline.evaluation.suites.base import ItemScores, Metric

PREFIX = "heldout"
METRICS = (
    Metric("loss", "nats/token", lower_is_better=True),
    # No per-item scores: the exponential of a mean is not a mean of items.
    Metric("perplexity", "exp(nats/token)", lower_is_better=True),
)


def heldout_loss(
    model,
    tokenizer,
    frame: pl.DataFrame,
    settings: SequenceSettings,
    max_batch_size: int = 8,
    max_batch_tokens: int = 8192,
) -> dict[str, Any]:
    """Token-weighted mean cross-entropy over the trained turns of ``frame`` (columns
    sample_id, system, prompt, response, optionally messages), encoded as in training under
    ``settings``.

    Returns ``loss`` (nats/token), ``perplexity``, ``tokens``, ``samples`` (those with at least
    one response token after truncation to ``max_length``), ``sequences``
    (:func:`sequence_counts`) and ``items``: the per-sample :class:`ItemScores` of those
    samples (weight = response tokens).

    Raises:
        ValueError: no held-out sample keeps a response token.
    """
    encoded = encode_rows(tokenizer, frame, settings)
    tokens, losses = response_losses(
        model,
        tokenizer,
        encoded,
        max_batch_size,
        max_batch_tokens,
        settings if isinstance(settings, PackingSettings) else None,
    )
    keep = tokens > 0
    if not keep.any():
        raise ValueError("no held-out sample has a response token; raise max_length")
    ids = (
        frame["sample_id"].to_list()
        if "sample_id" in frame.columns
        else [str(i) for i in range(frame.height)]
    )
    items = ItemScores(
        [i for i, k in zip(ids, keep, strict=True) if k],
        tokens[keep].astype(float).tolist(),
        losses[keep].tolist(),
    )
    loss = items.mean()
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": int(tokens.sum()),
        "samples": int(keep.sum()),
        "sequences": sequence_counts(encoded),
        "items": items,
    }
