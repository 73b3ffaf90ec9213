"""Non-finite embeddings are quarantined by sample_id; the rest cluster as if they never were."""

import numpy as np
import polars as pl

from cluster_pipeline.selection.clustering import cluster_table
from cluster_pipeline.selection.embedding_table import l2_normalise
from cluster_pipeline.storage.tables import vectors_to_series, write_table


def test_nan_and_inf_rows_are_quarantined(tmp_path):
    rng = np.random.default_rng(0)
    x = l2_normalise(
        np.concatenate([rng.normal(size=(20, 6)) + 3, rng.normal(size=(20, 6)) - 3]).astype(
            np.float32
        )
    )
    ids = [f"s{i}" for i in range(40)]
    clean = write_table(
        pl.DataFrame(
            {"sample_id": ids, "skip_reason": [None] * 40},
            schema={"sample_id": pl.String, "skip_reason": pl.String},
        ).with_columns(vectors_to_series("embedding_normalised", x)),
        tmp_path / "clean",
    )
    dirty_x = np.concatenate([x[:7], [[np.nan] * 6], x[7:30], [[np.inf] + [0.0] * 5], x[30:]])
    dirty_ids = ids[:7] + ["bad_nan"] + ids[7:30] + ["bad_inf"] + ids[30:]
    skip = [None] * 42
    dirty = write_table(
        pl.DataFrame(
            {"sample_id": dirty_ids, "skip_reason": skip},
            schema={"sample_id": pl.String, "skip_reason": pl.String},
        ).with_columns(vectors_to_series("embedding_normalised", dirty_x.astype(np.float32))),
        tmp_path / "dirty",
    )
    c = cluster_table(clean, "embedding_normalised", 2, seed=1)
    d = cluster_table(dirty, "embedding_normalised", 2, seed=1)
    assert c.quarantined.len() == 0 and d.quarantined.to_list() == ["bad_nan", "bad_inf"]
    assert d.sample_ids.to_list() == c.sample_ids.to_list() == ids
    assert (c.result.labels == d.result.labels).all()
    np.testing.assert_array_equal(c.result.sq_distance, d.result.sq_distance)
