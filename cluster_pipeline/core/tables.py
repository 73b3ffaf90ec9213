"""Delta tables through polars + deltalake: write a frame, read it back at a pinned version.

Every stage writes one Delta table per dataset partition and hands downstream a
:class:`TableRef` (URI + version), so a later run never reads "whatever is newest" by accident,
and Delta time travel shows how a table changed between materializations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from deltalake import DeltaTable


@dataclass(frozen=True)
class TableRef:
    """A Delta table at one version."""

    uri: str
    version: int

    def read(self, columns: list[str] | None = None) -> pl.DataFrame:
        return pl.read_delta(self.uri, version=self.version, columns=columns)

    def scan(self) -> pl.LazyFrame:
        return pl.scan_delta(self.uri, version=self.version)


def write_table(frame: pl.DataFrame, uri: str | Path) -> TableRef:
    """Overwrite the Delta table at ``uri`` with ``frame`` (a new version; older ones stay
    readable by time travel) and return a reference to the version written."""
    uri = str(uri)
    Path(uri).mkdir(parents=True, exist_ok=True)
    frame.write_delta(uri, mode="overwrite", delta_write_options={"schema_mode": "overwrite"})
    return TableRef(uri, DeltaTable(uri).version())


def vectors_to_series(name: str, matrix: np.ndarray) -> pl.Series:
    """(N, d) float32 matrix -> List(Float32) series (Delta has no fixed-size array type)."""
    return pl.Series(name, np.ascontiguousarray(matrix, dtype=np.float32)).cast(
        pl.List(pl.Float32)
    )


def series_to_matrix(series: pl.Series, dim: int | None = None) -> np.ndarray:
    """List(Float32) series of equal-length rows -> (N, d) float32 matrix."""
    if len(series) == 0:
        return np.zeros((0, dim or 0), dtype=np.float32)
    dim = dim or len(series[0])
    return series.list.to_array(dim).to_numpy().astype(np.float32, copy=False)
