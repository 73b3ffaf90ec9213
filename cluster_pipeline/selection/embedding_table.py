"""The ``proxy_embeddings`` table: a finished pass's rows with the L2-normalised representations
that clustering and the selectors read (docs/design.md, step 1). numpy and polars only, so the
Dagster code that reads embeddings loads without torch; the pass itself is
:mod:`cluster_pipeline.selection.embedding`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from cluster_pipeline.storage.tables import series_to_matrix, vectors_to_series


def l2_normalise(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows of (N, d) ``x`` divided by max(L2 norm, eps), as float32: zero rows stay zero."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.maximum(norms, eps)).astype(np.float32)


@dataclass(frozen=True)
class EmbeddingTable:
    """The ``proxy_embeddings`` table of a finished pass and what it holds.

    Attributes:
        frame: :data:`~cluster_pipeline.storage.embedding_cache.CHUNK_SCHEMA` plus
            ``embedding_normalised`` and ``hidden_mean_normalised`` (List(Float32),
            L2-normalised; null where skipped), one row per training sample in table order.
        embedded: samples with an embedding.
        skipped: skip reason -> count.
        hidden_size: d.
        truncated: truncation kind -> count of embedded samples that truncation cut.
    """

    frame: pl.DataFrame
    embedded: int
    skipped: dict[str, int]
    hidden_size: int
    truncated: dict[str, int]


def assemble_table(chunks: pl.DataFrame) -> EmbeddingTable:
    """Add the L2-normalised embeddings to a pool's chunk rows
    (:data:`~cluster_pipeline.storage.embedding_cache.CHUNK_SCHEMA`, e.g. from
    :func:`~cluster_pipeline.storage.embedding_cache.read_cached`).

    Raises:
        ValueError: no sample was embedded (every one was skipped).
    """
    ok = chunks["skip_reason"].is_null().to_numpy()
    if not ok.any():
        raise ValueError(
            "no sample has a response token within max_length; raise max_length "
            "or check the responses"
        )
    frame, d = chunks, 0
    for column in REPRESENTATIONS.values():
        matrix = series_to_matrix(chunks.filter(pl.Series(ok))[column])
        d = int(matrix.shape[1])
        normalised = np.zeros((chunks.height, d), dtype=np.float32)
        normalised[ok] = l2_normalise(matrix)
        name = f"{column}_normalised"
        frame = frame.with_columns(vectors_to_series(name, normalised)).with_columns(
            pl.when(pl.col("skip_reason").is_null()).then(pl.col(name)).alias(name)
        )
    skipped = frame.filter(pl.Series(~ok)).group_by("skip_reason").len().sort("skip_reason")
    cut = (
        frame.filter(pl.Series(ok) & pl.col("truncation").is_not_null())
        .group_by("truncation")
        .len()
        .sort("truncation")
    )
    return EmbeddingTable(
        frame,
        int(ok.sum()),
        dict(zip(skipped["skip_reason"], skipped["len"], strict=True)),
        d,
        dict(zip(cut["truncation"], cut["len"], strict=True)),
    )


# The representations a pass stores, by name: raw column (normalised: "<column>_normalised").
REPRESENTATIONS = {"gradient_proxy": "embedding", "hidden_mean": "hidden_mean"}
