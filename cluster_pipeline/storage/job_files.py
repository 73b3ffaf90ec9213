"""Job files: the JSON a Dagster asset writes and every torchrun rank reads and validates.

One pydantic model per job (``EmbedJob``, ``TrainJob`` in training/config.py, ``EvalJob`` in
evaluation/suites.py): settings, the pinned inputs and the output paths. Unknown options are
errors that name them (``extra="forbid"``), not silently ignored typos.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    # Unknown options are errors that name them, not silently ignored typos.
    model_config = ConfigDict(extra="forbid", frozen=True)


class JobFile(_Model):
    """A job description written by an asset and read by every rank."""

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read and validate a job file.

        Raises:
            pydantic.ValidationError (a ValueError): unknown or invalid options, each named.
        """
        return cls.model_validate_json(Path(path).read_text())

    def dump(self, path: str | Path) -> Path:
        """Write the job as indented JSON to ``path``; returns the path."""
        Path(path).write_text(self.model_dump_json(indent=1))
        return Path(path)
