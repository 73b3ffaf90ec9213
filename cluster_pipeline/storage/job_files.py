"""Job files: the JSON a Dagster asset writes and every torchrun rank reads and validates.

One pydantic model per job (``EmbedJob``, ``TrainJob`` in training/config.py, ``EvalJob`` in
evaluation/suites/): settings, the pinned inputs and the output paths. Unknown options are
errors that name them (``extra="forbid"``), not silently ignored typos.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails


class StrictModel(BaseModel):
    """A frozen pydantic model that refuses unknown options, naming them: the base of job files
    and of their nested parts (settings, one model of an evaluation, a tracking target)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class JobFileError(ValueError):
    """A job file that cannot be read or is not a valid job; the message names the file, what is
    wrong with it and what to do."""


class JobFile(StrictModel):
    """A job description written by an asset and read by every rank."""

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read and validate a job file (UTF-8 JSON).

        Raises:
            JobFileError (a ValueError): the file is missing, not a readable file, not UTF-8,
                not JSON, or has unknown or invalid options (each named, with its location);
                the message starts with ``job file <path>:``.
        """
        what = f"{cls.__name__} job file {path}"
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise JobFileError(
                f"{what}: no such file; give the path of the JSON file the asset wrote"
            ) from None
        except IsADirectoryError:
            raise JobFileError(f"{what}: is a folder, not a JSON file") from None
        except OSError as e:
            raise JobFileError(f"{what}: cannot be read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise JobFileError(
                f"{what}: byte {e.start} is not UTF-8; write the job as UTF-8 JSON"
            ) from None
        try:
            return cls.model_validate_json(text)
        except ValidationError as e:
            problems = "; ".join(_problem(error) for error in e.errors())
            raise JobFileError(f"{what}: {problems}") from None

    def dump(self, path: str | Path) -> Path:
        """Write the job as indented JSON to ``path``; returns the path."""
        Path(path).write_text(self.model_dump_json(indent=1))
        return Path(path)


def _problem(error: ErrorDetails) -> str:
    """One pydantic error as ``<option path>: <message>`` (``models.0.output: Field
    required``); JSON that does not parse keeps pydantic's message, which gives line and
    column."""
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]
