"""Parquet files (one shard of many, or a whole table): a record per row."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster_pipeline.data.readers.base import TableReader

if TYPE_CHECKING:  # imported where a file is read: the sensor scans files without it
    import polars as pl


class ParquetReader(TableReader):
    """Rows by polars; whether there is one from the footer alone."""

    name = "Parquet"
    suffix = ".parquet"
    listed = 30

    def frame(self, path: Path) -> pl.DataFrame:
        """``polars.read_parquet``."""
        import polars as pl

        return pl.read_parquet(path)

    def arrow_table(self, path: Path):
        """``pyarrow.parquet.read_table``."""
        import pyarrow.parquet as pq

        return pq.read_table(path)

    def has_rows(self, path: Path) -> bool:
        """The footer's row count is above 0."""
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows > 0
