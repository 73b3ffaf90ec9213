"""Arrow IPC files, in the streaming format ``datasets.Dataset.save_to_disk`` writes or the file
format other tools write: a record per row."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cluster_pipeline.data.readers.base import TableReader

if TYPE_CHECKING:  # imported where a file is read: the sensor scans files without it
    import polars as pl


class ArrowReader(TableReader):
    """The streaming format first, then the file format."""

    name = "Arrow"
    suffix = ".arrow"
    listed = 40

    def frame(self, path: Path) -> pl.DataFrame:
        """``polars.read_ipc_stream``, else ``polars.read_ipc``."""
        import polars as pl

        try:  # `datasets` writes the Arrow streaming format; other tools the file format.
            return pl.read_ipc_stream(path)
        except Exception:
            return pl.read_ipc(path)

    def arrow_table(self, path: Path):
        """The stream, else the file, read whole by pyarrow."""
        import pyarrow as pa

        try:
            return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()

    def has_rows(self, path: Path) -> bool:
        """Batch by batch up to the first that has a row."""
        import pyarrow as pa

        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
            return any(batch.num_rows for batch in reader)
        except pa.ArrowInvalid:
            source.seek(0)
            file = pa.ipc.open_file(source)
            return any(file.get_batch(i).num_rows for i in range(file.num_record_batches))
