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

    def read_vectors(
        self, column: str, keep: str | None = None, batch_rows: int = 65536
    ) -> tuple[pl.DataFrame, np.ndarray]:
        """Read a List(Float32) column as an (N, d) float32 matrix, batch by batch.

        Only the matrix and one Arrow batch are ever in memory, never the whole column as
        Arrow lists as well. Rows where ``column`` is null, or where the String column ``keep``
        is not null, are left out.

        Returns:
            (sample_id of the rows kept, in table order; the (N, d) float32 matrix).
        """
        import pyarrow.compute as pc

        dataset = DeltaTable(self.uri, version=self.version).to_pyarrow_dataset()
        columns = ["sample_id", column] + ([keep] if keep else [])
        # pyarrow's stubs lack the generated compute functions.
        ok = pc.is_valid(pc.field(column))  # pyright: ignore[reportAttributeAccessIssue]
        if keep:
            ok = ok & pc.is_null(pc.field(keep))  # pyright: ignore[reportAttributeAccessIssue]
        n = dataset.count_rows(filter=ok)
        ids: list[str] = []
        matrix: np.ndarray | None = None
        row = 0
        for batch in dataset.to_batches(columns=columns, filter=ok, batch_size=batch_rows):
            if batch.num_rows == 0:
                continue
            values = batch.column(column)
            flat = values.flatten().to_numpy(zero_copy_only=False)
            d = len(flat) // batch.num_rows
            if matrix is None:
                matrix = np.empty((n, d), dtype=np.float32)
            matrix[row : row + batch.num_rows] = flat.reshape(batch.num_rows, d)
            ids.extend(batch.column("sample_id").to_pylist())
            row += batch.num_rows
        if matrix is None:
            matrix = np.zeros((0, 0), dtype=np.float32)
        return pl.DataFrame({"sample_id": ids}, schema={"sample_id": pl.String}), matrix


def mean_of(series: pl.Series) -> float:
    """Mean of the non-null values as a float (nan when there are none)."""
    value = series.cast(pl.Float64).mean()
    return float(value) if isinstance(value, int | float) else float("nan")


def rows_for(ids: pl.DataFrame, matrix: np.ndarray, sample_ids: pl.Series) -> np.ndarray:
    """The rows of ``matrix`` (one per row of ``ids``, as :meth:`TableRef.read_vectors`
    returns) for ``sample_ids``, in that order.

    Raises:
        KeyError: a sample id is not in ``ids``.
    """
    position = ids.with_row_index("i").join(
        pl.DataFrame({"sample_id": sample_ids}), on="sample_id", how="right"
    )["i"]
    if position.null_count():
        raise KeyError(f"{position.null_count()} sample ids have no vector")
    return matrix[position.to_numpy()]


def write_table(frame: pl.DataFrame, uri: str | Path) -> TableRef:
    """Overwrite the Delta table at ``uri`` with ``frame`` (a new version; older ones stay
    readable by time travel) and return a reference to the version written."""
    uri = str(uri)
    Path(uri).mkdir(parents=True, exist_ok=True)
    frame.write_delta(uri, mode="overwrite", delta_write_options={"schema_mode": "overwrite"})
    return TableRef(uri, DeltaTable(uri).version())


def vectors_to_series(name: str, matrix: np.ndarray) -> pl.Series:
    """(N, d) float32 matrix -> List(Float32) series (Delta has no fixed-size array type)."""
    return pl.Series(name, np.ascontiguousarray(matrix, dtype=np.float32)).cast(pl.List(pl.Float32))


def series_to_matrix(series: pl.Series, dim: int | None = None) -> np.ndarray:
    """List(Float32) series of equal-length rows -> (N, d) float32 matrix."""
    if len(series) == 0:
        return np.zeros((0, dim or 0), dtype=np.float32)
    dim = dim or len(series[0])
    return series.list.to_array(dim).to_numpy().astype(np.float32, copy=False)


def markdown_preview(frame: pl.DataFrame, max_rows: int = 8, max_chars: int = 60) -> str:
    """A small GitHub-Markdown table of the first rows (long cells shortened)."""

    def cell(v) -> str:
        text = "" if v is None else str(v)
        text = text.replace("\n", " ").replace("|", "\\|")
        return text if len(text) <= max_chars else text[: max_chars - 1] + "…"

    head = frame.head(max_rows)
    lines = [
        "| " + " | ".join(head.columns) + " |",
        "|" + "---|" * len(head.columns),
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in head.iter_rows()]
    return "\n".join(lines)
