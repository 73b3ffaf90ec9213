"""Scoring text by likelihood: per-sample response cross-entropy through the embedding pass's
batching (packed where the model can pack), and the counts of samples the encoding skipped or
truncated. Held-out loss, the reference-solution NLL and multiple-choice scoring all use it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from cluster_pipeline.data.tokenization import EncodedSample, PackingSettings


def response_losses(
    model,
    tokenizer,
    encoded: Sequence[EncodedSample],
    max_batch_size: int = 8,
    max_batch_tokens: int = 8192,
    packing: PackingSettings | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(response tokens T, mean cross-entropy in nats/token) per sample, each (n,), in the
    order of ``encoded``; samples with a ``skip_reason`` get T = 0 and a nan loss. Batches are
    packed per ``packing`` (default: packed rows of up to 512 tokens) where the model can pack;
    the numbers do not depend on it."""
    from cluster_pipeline.selection.embedding import embed_samples

    packing = packing or PackingSettings()
    out, _ = embed_samples(
        model,
        encoded,
        tokenizer.pad_token_id,
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        packing=packing.packing,
        max_packed_length=packing.max_packed_length,
    )
    return out.n_response_tokens, np.where(out.n_response_tokens > 0, out.mean_loss, np.nan)


def sequence_counts(encoded: Sequence[EncodedSample]) -> dict[str, dict[str, int]]:
    """``{"skipped": {reason: samples}, "truncated": {kind: samples}}`` of encoded samples
    (:attr:`EncodedSample.skip_reason`, :attr:`EncodedSample.truncation_kind`)."""
    skipped = Counter(e.skip_reason for e in encoded if e.skip_reason)
    truncated = Counter(
        e.truncation_kind for e in encoded if e.skip_reason is None and e.truncation_kind
    )
    return {"skipped": dict(sorted(skipped.items())), "truncated": dict(sorted(truncated.items()))}
