"""Delta tables: versions, time travel, and batched vector reads."""

import numpy as np
import polars as pl

from cluster_pipeline.storage.tables import TableRef, vectors_to_series, write_table


def test_versions_and_time_travel(tmp_path):
    a = write_table(pl.DataFrame({"x": [1, 2]}), tmp_path / "t")
    b = write_table(pl.DataFrame({"x": [3]}), tmp_path / "t")
    assert (a.version, b.version) == (0, 1)
    assert a.read()["x"].to_list() == [1, 2] and b.read()["x"].to_list() == [3]


def test_read_vectors_in_batches_skips_nulls_and_flagged_rows(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    frame = pl.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(10)],
            "skip_reason": [None, None, "empty_response"] + [None] * 7,
        },
        schema={"sample_id": pl.String, "skip_reason": pl.String},
    )
    frame = frame.with_columns(vectors_to_series("v", x)).with_columns(
        pl.when(pl.col("sample_id") != "s5").then(pl.col("v"))
    )
    ref = write_table(frame, tmp_path / "t")
    ids, m = TableRef(ref.uri, ref.version).read_vectors("v", keep="skip_reason", batch_rows=3)
    keep = [0, 1, 3, 4, 6, 7, 8, 9]
    assert ids["sample_id"].to_list() == [f"s{i}" for i in keep]
    np.testing.assert_array_equal(m, x[keep])
    assert m.dtype == np.float32
