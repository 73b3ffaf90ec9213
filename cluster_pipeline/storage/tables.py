"""Delta tables through polars + deltalake: write a frame, read it back at a pinned version.

Every stage writes one Delta table per dataset partition and hands downstream a
:class:`TableRef` (URI + version), so a later run never reads "whatever is newest" by accident,
and Delta time travel shows how a table changed between materializations.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import polars as pl
from deltalake import CommitProperties, DeltaTable

from cluster_pipeline.storage.disk import naming_full_disk, require_space


@dataclass(frozen=True)
class TableRef:
    """A Delta table at one version."""

    uri: str
    version: int

    def read(self, columns: list[str] | None = None) -> pl.DataFrame:
        """This version of the table (all columns, or ``columns``)."""
        return pl.read_delta(self.uri, version=self.version, columns=columns)

    def row_count(self) -> int:
        """Rows in this version, from the Delta log's file statistics (nothing is scanned)."""
        return DeltaTable(self.uri, version=self.version).to_pyarrow_dataset().count_rows()

    def vector_batches(
        self, column: str, keep: str | None = None, batch_rows: int = 65536
    ) -> Iterator[tuple[pl.Series, np.ndarray]]:
        """Stream a List(Float32) column as (sample_id, (b, d) float32 matrix) batches of at most
        ``batch_rows`` rows, in table order. Only one Arrow batch is in memory at a time.

        Rows where ``column`` is null, or where the String column ``keep`` is not null, are left
        out (checked on each batch's validity bitmap: a scan filter on a list column costs more
        than the read itself).

        Raises:
            ValueError: the rows of one batch have unequal lengths (names the table).
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        dataset = DeltaTable(self.uri, version=self.version).to_pyarrow_dataset()
        columns = ["sample_id", column] + ([keep] if keep else [])
        # Read-ahead is what holds memory (16 decoded batches by default): keep one in flight.
        scan = dataset.to_batches(
            columns=columns, batch_size=batch_rows, batch_readahead=1, fragment_readahead=1
        )
        for batch in scan:
            ok = batch.column(column).is_valid()
            if keep:
                ok = pc.and_(ok, batch.column(keep).is_null())  # pyright: ignore[reportAttributeAccessIssue]
            if not pc.all(ok).as_py():  # pyright: ignore[reportAttributeAccessIssue]
                batch = batch.filter(ok)
            if batch.num_rows == 0:
                continue
            flat = batch.column(column).flatten().to_numpy(zero_copy_only=False)
            d = len(flat) // batch.num_rows
            if d * batch.num_rows != len(flat):
                raise ValueError(
                    f"{self.uri} (version {self.version}): the rows of {column!r} have unequal "
                    "lengths; re-materialize the table that wrote it"
                )
            ids = pl.Series("sample_id", batch.column("sample_id"), dtype=pl.String)
            yield ids, flat.astype(np.float32, copy=False).reshape(batch.num_rows, d)
        # Arrow's allocator keeps freed batches for reuse; give them back after a pass.
        del scan
        pa.default_memory_pool().release_unused()

    def vectors_for(
        self, column: str, sample_ids: pl.Series, batch_rows: int = 65536
    ) -> np.ndarray:
        """The (m, d) float32 rows of ``column`` for ``sample_ids`` (m ids, unique), in that
        order, gathered while streaming the table: memory is the result and one batch.

        Raises:
            KeyError: an id has no vector in this version (names how many and one of them).
        """
        wanted = pl.DataFrame({"sample_id": sample_ids}).with_row_index("to")
        out: np.ndarray | None = None
        got = np.zeros(len(sample_ids), dtype=bool)
        for ids, x in self.vector_batches(column, batch_rows=batch_rows):
            hit = ids.to_frame().with_row_index("at").join(wanted, on="sample_id")
            if hit.height == 0:
                continue
            if out is None:
                out = np.zeros((len(sample_ids), x.shape[1]), dtype=np.float32)
            out[hit["to"].to_numpy()] = x[hit["at"].to_numpy()]
            got[hit["to"].to_numpy()] = True
        if not got.all():
            raise KeyError(
                f"{int((~got).sum())} sample ids (e.g. {sample_ids[int(np.argmin(got))]!r}) have "
                f"no {column!r} in {self.uri} version {self.version}"
            )
        return out if out is not None else np.zeros((0, 0), dtype=np.float32)

    def read_vectors(
        self, column: str, keep: str | None = None, batch_rows: int = 65536
    ) -> tuple[pl.DataFrame, np.ndarray]:
        """Read a List(Float32) column as an (N, d) float32 matrix, batch by batch
        (:meth:`vector_batches`: same rows left out).

        Only the matrix and one Arrow batch are ever in memory, never the whole column as
        Arrow lists as well.

        Returns:
            (sample_id of the rows kept, in table order; the (N, d) float32 matrix).
        """
        n = self.row_count()
        ids: list[pl.Series] = []
        matrix: np.ndarray | None = None
        row = 0
        for batch_ids, x in self.vector_batches(column, keep, batch_rows):
            if matrix is None:
                matrix = np.empty((n, x.shape[1]), dtype=np.float32)
            matrix[row : row + len(x)] = x
            ids.append(batch_ids)
            row += len(x)
        if matrix is None:
            matrix = np.zeros((0, 0), dtype=np.float32)
        elif row < n:
            matrix = matrix[:row].copy()
        frame = pl.DataFrame(
            {"sample_id": pl.concat(ids) if ids else pl.Series([], dtype=pl.String)}
        )
        return frame, matrix


def mean_of(series: pl.Series) -> float:
    """Mean of the non-null values as a float (nan when there are none)."""
    value = series.cast(pl.Float64).mean()
    return float(value) if isinstance(value, int | float) else float("nan")


class CommitGuard(Protocol):
    """Refuses a commit by raising (``launch/fate.RunGuard``: the run is no longer alive)."""

    def check(self, what: str) -> None:
        """Raise if ``what`` (a commit, described for the error) must not happen."""
        ...


# The commit-info key under which a version records the upstream table versions it was
# computed from (:func:`write_table`'s ``inputs``), so a reader without the Dagster instance (the
# ``lineage`` command) reads the same versions the stages did.
INPUTS_KEY = "cluster_pipeline.inputs"


def write_table(
    frame: pl.DataFrame,
    uri: str | Path,
    guard: CommitGuard | None = None,
    inputs: Mapping[str, TableRef] | None = None,
) -> TableRef:
    """Overwrite the Delta table at ``uri`` with ``frame`` (a new version; older ones stay
    readable by time travel) and return a reference to the version written.

    Args:
        frame: the new content.
        uri: the table's folder.
        guard: the run's guard (``launch/fate.py``), checked just before the commit, so a run
            that is no longer alive commits no version.
        inputs: the upstream table versions, by stage, this version was computed from; kept in
            the commit's info (:data:`INPUTS_KEY`) and read back by :func:`table_inputs`.

    Raises:
        RunGone: from ``guard``; the table is left as it was.
        DiskFull: the disk lacks the room for the frame's vectors (checked first), or ran out
            while writing; no version is committed and the earlier ones stay readable.
    """
    uri = str(uri)
    if guard is not None:
        guard.check(f"commit a new version of the Delta table {uri}")
    what = f"commit a new version of the Delta table {uri}"
    # The vectors (List(Float32) columns) do not compress: a lower bound of the commit's size.
    vectors = [c for c, t in frame.schema.items() if t == pl.List(pl.Float32)]
    require_space(uri, int(frame.select(vectors).estimated_size()) if vectors else 0, what)
    Path(uri).mkdir(parents=True, exist_ok=True)
    options: dict[str, object] = {"schema_mode": "overwrite"}
    if inputs is not None:
        versions = {stage: ref.version for stage, ref in inputs.items()}
        options["commit_properties"] = CommitProperties(
            custom_metadata={INPUTS_KEY: json.dumps(versions, sort_keys=True)}
        )
    with naming_full_disk(uri, int(frame.estimated_size()), what):
        frame.write_delta(uri, mode="overwrite", delta_write_options=options)
    return TableRef(uri, DeltaTable(uri).version())


def content_digest(frame: pl.DataFrame, columns: Sequence[str], *keys: str) -> str:
    """16 hex digits of sha256 over ``keys`` (length-prefixed UTF-8) and then ``columns`` of
    ``frame``, in row order, as one uncompressed Arrow IPC stream: equal for equal content,
    however the frame was chunked. A stage's Dagster data version (docs/design.md, "Stages"):
    a re-read or recomputation that writes the same rows is no update for its children."""
    h = hashlib.sha256()
    for key in keys:
        data = key.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    buffer = io.BytesIO()
    frame.select(columns).rechunk().write_ipc(buffer, compression="uncompressed")
    h.update(buffer.getvalue())
    return h.hexdigest()[:16]


def table_inputs(uri: str | Path, version: int) -> dict[str, int] | None:
    """The upstream table versions, by stage, that ``version`` of the table at ``uri`` was
    computed from (what :func:`write_table` was given as ``inputs``), or None where that
    commit recorded none (written without ``inputs``, or by an older pipeline)."""
    for commit in DeltaTable(str(uri)).history():
        if commit.get("version") == version:
            text = commit.get(INPUTS_KEY)
            return {k: int(v) for k, v in json.loads(text).items()} if text else None
    return None


def vectors_to_series(name: str, matrix: np.ndarray) -> pl.Series:
    """(N, d) float32 matrix -> List(Float32) series (Delta has no fixed-size array type)."""
    return pl.Series(name, np.ascontiguousarray(matrix, dtype=np.float32)).cast(pl.List(pl.Float32))


def series_to_matrix(series: pl.Series, dim: int | None = None) -> np.ndarray:
    """List(Float32) series of equal-length rows -> (N, d) float32 matrix."""
    if len(series) == 0:
        return np.zeros((0, dim or 0), dtype=np.float32)
    dim = dim or len(series[0])
    return series.list.to_array(dim).to_numpy().astype(np.float32, copy=False)


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-Markdown table: the header cells, then one line per row of cells (already
    formatted text; a ``|`` inside a cell is escaped). The project's one table writer."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(head), "|" + "---|" * len(head), *(line(r) for r in rows)])


# The longest Markdown the Dagster UI shows inline in an asset's metadata table: from 1,000
# characters on it shows a "[Show Markdown]" link instead (dagster-webserver's MetadataEntry,
# ``mdStr.length < 1e3``).
INLINE_MARKDOWN_CHARS = 1000


def markdown_preview(
    frame: pl.DataFrame,
    max_rows: int = 8,
    max_chars: int = 60,
    inline: bool = True,
) -> str:
    """A small GitHub-Markdown table of the first rows (long cells shortened, floats at 5
    significant digits: ``3.6916``, not ``3.6915814876556396``).

    With ``inline``, the table fits :data:`INLINE_MARKDOWN_CHARS`, so the UI shows it in place
    whatever the cells hold (paths of any length): fewer rows first (down to one), then shorter
    cells (down to 12 characters).
    """

    def cell(v, width: int) -> str:
        if isinstance(v, float):
            return f"{v:.5g}"
        text = "" if v is None else str(v).replace("\n", " ")
        return text if len(text) <= width else text[: width - 1] + "…"

    def table(rows: int, width: int) -> str:
        head = frame.head(rows)
        return markdown_table(
            head.columns, ([cell(v, width) for v in row] for row in head.iter_rows())
        )

    rows, width = max_rows, max_chars
    text = table(rows, width)
    while inline and len(text) >= INLINE_MARKDOWN_CHARS and (rows > 1 or width > 12):
        if rows > 1:
            rows -= 1
        else:
            width = max(12, width - 8)
        text = table(rows, width)
    return text
