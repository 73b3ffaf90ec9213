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


def test_a_preview_fits_what_the_dagster_ui_shows_inline():
    """Under 1,000 characters the UI renders a Markdown entry in place, else behind "[Show
    Markdown]" (the web UI test lost sample_lineage's preview to that under xdist, whose paths
    are longer). Lengths counted by hand: a row of an int and k cells of w characters is
    ``2 + 1 + k (3 + w) + 2`` characters, plus its newline."""
    from cluster_pipeline.storage.tables import INLINE_MARKDOWN_CHARS, markdown_preview

    path = "p" * 59
    six = pl.DataFrame({"a": list(range(8)), **{f"p{i}": [path] * 8 for i in range(6)}})
    # Header 35, separator 29, each row 377 + 1: two rows (821) fit, three (1,199) do not.
    md = markdown_preview(six)
    assert len(md) == 35 + 29 + 2 * 378 + 1 == 821 and md.count("\n") == 3
    assert markdown_preview(six, inline=False).count("\n") == 9  # every row of the 8
    # One row too wide: its cells shortened by 8 characters at a time, 60 -> 52 -> 44 -> 36:
    # header 115, separator 85, the row 65 + 20 x 36, two newlines.
    wide = pl.DataFrame({"a": [0], **{f"p{i}": [path] for i in range(20)}})
    md = markdown_preview(wide)
    assert len(md) == 115 + 85 + 65 + 20 * 36 + 2 == 987 < INLINE_MARKDOWN_CHARS
    assert ("p" * 35 + "…") in md and ("p" * 36) not in md
