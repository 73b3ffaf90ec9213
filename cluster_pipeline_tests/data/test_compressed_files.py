"""Compressed files are named as not read, with the command that makes them readable (issue 43:
a folder holding only ``.jsonl.gz`` was refused without saying compressed files are not read).

The kind, "a dataset file the reader passes over because it is compressed": a data file
compressed whole (gzip, bzip2, xz, zstd) and an archive (zip, tar, tgz, 7z); beside them, a
compressed file that would not be data decompressed either (``.csv.gz``: only "not read"), and
a folder where compressed files sit beside readable ones (a dataset, with a warning)."""

import bz2
import gzip
import json
import lzma
import shlex
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from cluster_pipeline.data.datasets import discover_datasets, refused_datasets
from cluster_pipeline.data.formats import (
    DatasetFormatError,
    compressed_files,
    compressed_note,
    ignored_files,
    read_dataset_folder,
)

RECORDS = "".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(3))
SETTINGS = "(eval.json and fields.json are settings, not data)"


def _write(path: Path, kind: str) -> Path:
    data = RECORDS.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "gz":
        path.write_bytes(gzip.compress(data))
    elif kind == "bz2":
        path.write_bytes(bz2.compress(data))
    elif kind == "xz":
        path.write_bytes(lzma.compress(data))
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("data.jsonl", data)
    else:
        path.write_bytes(data)  # content does not matter to the rule (zst, tar, tgz, 7z)
    return path


@pytest.mark.parametrize(
    ("name", "kind", "command"),
    [
        ("data.jsonl.gz", "gz", "gunzip"),
        ("data.json.bz2", "bz2", "bunzip2"),
        ("data.parquet.xz", "xz", "unxz"),
        ("data.jsonl.zst", "zst", "unzstd --rm"),
    ],
)
def test_a_folder_of_compressed_data_files_is_refused_naming_them(tmp_path, name, kind, command):
    raw = tmp_path / "raw"
    path = _write(raw / "packed" / name, kind)
    folder = raw / "packed"
    note = (
        f"compressed files are not read: {name}; decompress them in place first "
        f"(`{command} {shlex.quote(str(path))}`)"
    )
    assert compressed_note(folder) == note
    assert refused_datasets(raw) == {
        "packed": f"{folder} holds no .json, .jsonl, .parquet, .arrow file {SETTINGS}; {note}"
    }
    assert discover_datasets(raw) == ["python_stdlib"]
    with pytest.raises(DatasetFormatError) as e:
        list(read_dataset_folder(folder))
    assert str(e.value) == f"{folder}: no .json, .jsonl, .parquet, .arrow files found; {note}."


@pytest.mark.parametrize(
    ("name", "command"),
    [("data.zip", "unzip"), ("data.tgz", "tar -xzf"), ("data.tar", "tar -xf"), ("d.7z", "7z x")],
)
def test_an_archive_is_named_with_how_to_extract_it(tmp_path, name, command):
    folder = tmp_path / "raw" / "packed"
    _write(folder / "sub dir" / name, "zip" if name.endswith(".zip") else "other")
    assert compressed_note(folder) == (
        f"compressed files are not read: sub dir/{name}; extract them into {folder} first "
        f"(`cd {shlex.quote(str(folder / 'sub dir'))} && {command} {name}`)"
    )


def test_compressed_files_that_would_not_be_data_are_only_not_read(tmp_path):
    folder = tmp_path / "raw" / "x"
    _write(folder / "table.csv.gz", "gz")
    assert compressed_files(folder) == []
    assert ignored_files(folder) == [folder / "table.csv.gz"]
    assert refused_datasets(tmp_path / "raw")["x"].endswith("put the dataset's files there")


def test_beside_readable_files_they_are_named_and_the_rest_is_read(tmp_path):
    folder = tmp_path / "raw" / "mixed"
    _write(folder / "a.jsonl", "plain")
    _write(folder / "b.jsonl.gz", "gz")
    _write(folder / "c.jsonl.gz", "gz")
    assert discover_datasets(tmp_path / "raw") == ["python_stdlib", "mixed"]
    assert len(list(read_dataset_folder(folder))) == 3
    assert compressed_note(folder) == (
        "compressed files are not read: b.jsonl.gz, c.jsonl.gz; decompress them in place first "
        f"(`gunzip {shlex.quote(str(folder / 'b.jsonl.gz'))}`)"
    )


@pytest.mark.skipif(shutil.which("gunzip") is None, reason="gunzip is not installed here")
def test_the_printed_command_makes_the_folder_a_dataset(tmp_path):
    raw = tmp_path / "raw"
    path = _write(raw / "my data" / "it's.jsonl.gz", "gz")
    note = compressed_note(path.parent)
    assert note is not None
    subprocess.run(["bash", "-c", note.split("`")[1]], check=True)
    assert discover_datasets(raw) == ["python_stdlib", "my data"]
    assert len(list(read_dataset_folder(path.parent))) == 3
