"""Job files (storage/job_files.py): every way a job file can be unreadable or invalid gives one
``JobFileError`` whose message names the file and what is wrong, and a recipe run by hand prints
it as argparse's one-line error (exit status 2) instead of a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from cluster_pipeline.storage.job_files import JobFile, JobFileError, StrictModel
from cluster_pipeline.training.distributed import run_entry_point


class _Part(StrictModel):
    model_path: str
    output: str


class _Job(JobFile):
    parts: list[_Part] = Field(min_length=1)
    version: int = Field(ge=0)


_VALID = '{"parts": [{"model_path": "m", "output": "o.json"}], "version": 3}'


def _write(tmp_path: Path, data: str | bytes) -> Path:
    path = tmp_path / "job.json"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def test_a_valid_job_file_round_trips(tmp_path):
    job = _Job.load(_write(tmp_path, _VALID))
    assert job == _Job(parts=[_Part(model_path="m", output="o.json")], version=3)
    assert _Job.load(job.dump(tmp_path / "again.json")) == job


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "Invalid JSON: EOF while parsing a value at line 1 column 0"),
        (b'{"version": 3,\n}', "Invalid JSON: trailing comma at line 2 column 1"),
        (b'{"version": 3 "parts": []}', "Invalid JSON: expected `,` or `}` at line 1 column 15"),
        (b"[]", "Input should be an object"),
        (b"null", "Input should be an object"),
        (b"\xff{}", "byte 0 is not UTF-8; write the job as UTF-8 JSON"),
        (
            b'{"parts": [{"model_path": "m", "output": "o"}], "version": 3, "verison": 4}',
            "verison: Extra inputs are not permitted",
        ),
        (b'{"parts": [{"model_path": "m", "output": "o"}]}', "version: Field required"),
        (
            b'{"parts": [{"model_path": "m"}], "version": -1}',
            "parts.0.output: Field required; version: Input should be greater than or equal to 0",
        ),
        (
            b'{"parts": [], "version": "three"}',
            "parts: List should have at least 1 item after validation, not 0; "
            "version: Input should be a valid integer, unable to parse string as an integer",
        ),
    ],
    ids=[
        "empty",
        "trailing-comma",
        "missing-comma",
        "array",
        "null",
        "not-utf8",
        "unknown-option",
        "missing-option",
        "nested-and-range",
        "too-short-and-type",
    ],
)
def test_each_invalid_job_file_names_the_file_and_every_problem(tmp_path, data, problem):
    path = _write(tmp_path, data)
    with pytest.raises(JobFileError) as e:
        _Job.load(path)
    assert str(e.value) == f"_Job job file {path}: {problem}"


def test_a_missing_file_or_a_folder_is_named(tmp_path):
    with pytest.raises(JobFileError) as e:
        _Job.load(tmp_path / "nope.json")
    assert str(e.value) == (
        f"_Job job file {tmp_path / 'nope.json'}: no such file; "
        "give the path of the JSON file the asset wrote"
    )
    with pytest.raises(JobFileError) as e:
        _Job.load(tmp_path)
    assert str(e.value) == f"_Job job file {tmp_path}: is a folder, not a JSON file"


def _never(job, env, report):
    raise AssertionError("the body must not run for an invalid job file")


def test_a_recipe_run_by_hand_prints_the_problem_as_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    path = _write(tmp_path, b'{"version": 3}')
    with pytest.raises(SystemExit) as e:
        run_entry_point(_Job, _never, ["--config", str(path)], "A recipe.")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(f"error: _Job job file {path}: parts: Field required")
    assert "Traceback" not in err


def test_under_torchrun_the_error_is_raised_for_record_to_write(tmp_path, monkeypatch):
    # torchrun sets TORCHELASTIC_ERROR_FILE for every rank; @record writes the raised error
    # there, and the launch's failure summary leads with its message.
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(JobFileError, match=r"nope\.json: no such file"):
        run_entry_point(_Job, _never, ["--config", str(tmp_path / "nope.json")], "A recipe.")
