"""Non-finite embeddings are quarantined by sample_id; the rest cluster as if they never were."""

import numpy as np
import polars as pl

from cluster_pipeline.core.clustering import balanced_kmeans, read_clusterable
from cluster_pipeline.core.embedding import l2_normalise
from cluster_pipeline.core.tables import vectors_to_series, write_table


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
    rows_c, xc, q_c = read_clusterable(clean)
    rows_d, xd, q_d = read_clusterable(dirty)
    assert q_c.height == 0 and q_d["sample_id"].to_list() == ["bad_nan", "bad_inf"]
    assert rows_d["sample_id"].to_list() == rows_c["sample_id"].to_list() == ids
    a, b = balanced_kmeans(xc, 2, seed=1), balanced_kmeans(xd, 2, seed=1)
    assert (a.labels == b.labels).all()
    np.testing.assert_array_equal(a.sq_distance, b.sq_distance)
