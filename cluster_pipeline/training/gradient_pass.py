"""less's gradient pass on one rank (selection/selectors/less.py): the embedding pass's chunks,
resumption and per-sample cache (training/embedding_pass.py, ``EmbedJob.gradients``), each
sample's row holding, in place of the embedding, its projected LoRA gradient under one warm-up
checkpoint (selection/gradient_features.py):

    pool    (``adam_*``):  normalise(project(Gamma(grad l(z; theta_i))))
    targets (``sgd``):     normalise(project(grad l(z'; theta_i)))

with ``mean_loss`` the sample's mean response loss under the checkpoint. Samples are batched
by length (padded, ``max_batch_size`` / ``max_batch_tokens``); one backward pass per batch
gives every sample's gradient; gradients are projected in groups of ``project_rows`` (by
default as many as :data:`PROJECT_BYTES` holds), each group rebuilding the projection matrix once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import torch

from cluster_pipeline.data.packing import collate_rows, real_tokens
from cluster_pipeline.data.tokenization import encode_rows, length_batches
from cluster_pipeline.selection.gradient_features import (
    AdamState,
    RademacherProjection,
    adam_precondition,
    gradient_dim,
    normalise_rows,
    per_sample_gradients,
)
from cluster_pipeline.storage.embedding_cache import CHUNK_SCHEMA
from cluster_pipeline.training.checkpointing import TRAINING_STATE
from cluster_pipeline.training.config import EmbedSettings, GradientPass

PROJECT_BYTES = 2**30  # float32 gradients held for one projection group (GradientPass)


class GradientModel:
    """The base model with a warm-up checkpoint's LoRA adapter (trainable, eval mode: no
    dropout), that checkpoint's AdamW state (for ``adam_*``) and the projection."""

    def __init__(self, base_model, spec: GradientPass, device):
        from peft import PeftModel

        folder = Path(spec.checkpoint)
        self.model = PeftModel.from_pretrained(base_model, str(folder), is_trainable=True)
        self.model.to(device).eval()
        self.spec = spec
        dim = gradient_dim(self.model)
        self.adam: AdamState | None = None
        if spec.preconditioner != "sgd":
            state = torch.load(folder / TRAINING_STATE, weights_only=False, map_location="cpu")
            self.adam = AdamState.from_optimizer_state(state["optimizer"], device=device)
            if len(self.adam.exp_avg) != dim:
                raise ValueError(
                    f"{folder}: the optimizer state holds {len(self.adam.exp_avg)} values, the "
                    f"adapter {dim} trainable parameters"
                )
        self.project = RademacherProjection(dim, spec.projection_dim, spec.projection_seed)
        self.group_rows = spec.project_rows or max(1, PROJECT_BYTES // (4 * dim))

    def precondition(self, grads: torch.Tensor) -> torch.Tensor:
        """(B, P) gradients -> (B, P) float32 Gamma(g) for ``adam_released`` (the authors'
        update) or ``adam_paper`` (eq. (1)), g itself for ``sgd``."""
        if self.adam is None:
            return grads.float()
        released = self.spec.preconditioner == "adam_released"
        return adam_precondition(grads, self.adam, released=released)

    def features(self, grads: torch.Tensor) -> torch.Tensor:
        """(B, P) gradients -> (B, d) float32 normalised projected (preconditioned) ones."""
        return normalise_rows(self.project(self.precondition(grads)))


def gradient_frame(
    gm: GradientModel,
    tokenizer,
    frame: pl.DataFrame,
    settings: EmbedSettings,
    on_batch: Callable[[int, int], None] | None = None,
) -> pl.DataFrame:
    """Every sample of ``frame`` (columns sample_id, system, prompt, response, optionally
    messages) encoded under ``settings``: its projected gradient as ``embedding`` (module
    docstring), its loss as ``mean_loss``; rows with :data:`CHUNK_SCHEMA`, in ``frame``'s order,
    ``hidden_mean`` null. Samples with no response token get a ``skip_reason``."""
    encoded = encode_rows(tokenizer, frame, settings)
    n = len(encoded)
    d = gm.spec.projection_dim
    features = np.zeros((n, d), dtype=np.float32)
    loss = np.full(n, np.nan, dtype=np.float32)
    usable = [i for i, e in enumerate(encoded) if e.skip_reason is None]
    batches = length_batches(
        [len(encoded[i]) for i in usable], settings.max_batch_size, settings.max_batch_tokens
    )
    autocast = torch.bfloat16 if settings.bf16 else None
    pending: list[tuple[list[int], torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        rows = [i for idx, _ in pending for i in idx]
        out = normalise_rows(gm.project(torch.cat([g for _, g in pending])))
        features[rows] = out.cpu().numpy()
        pending.clear()

    for batch_idx in batches:
        idx = [usable[j] for j in batch_idx]
        batch = collate_rows(encoded, [[i] for i in idx], tokenizer.pad_token_id, packed=False)
        grads, losses = per_sample_gradients(gm.model, batch, autocast)
        loss[idx] = losses.float().cpu().numpy()
        pending.append((idx, gm.precondition(grads)))
        if sum(len(i) for i, _ in pending) >= gm.group_rows:
            flush()
        if on_batch is not None:
            on_batch(len(idx), real_tokens(batch))
    flush()
    skip = [e.skip_reason for e in encoded]
    return pl.DataFrame(
        {
            "sample_id": frame["sample_id"],
            "n_tokens": [len(e) for e in encoded],
            "n_response_tokens": [e.n_response_tokens for e in encoded],
            "truncated": [e.truncated for e in encoded],
            "truncation": [e.truncation_kind for e in encoded],
            "skip_reason": skip,
            "mean_loss": [None if skip[i] else float(loss[i]) for i in range(n)],
            "embedding": [None if skip[i] else features[i].tolist() for i in range(n)],
            "hidden_mean": [None] * n,
        },
        schema=CHUNK_SCHEMA,
    )
