"""Where a result came from, in terms that travel off this machine: the code that made it
(package version, git commit, whether tracked files had uncommitted changes), the content hash
of a file or of a table version's rows, and local paths made portable (relative to the data
folder or the home folder) for what is published: a dataset card, an MLflow dataset's name.

::

    code_identity()                      # {"package": "cluster_pipeline", "version": "0.1.0",
                                         #  "git_commit": "1e3e7ca...", "git_dirty": False}
    rows_sha256(frame, ["sample_id"])    # sha256 of a table's rows, in canonical form
    portable("/home/me/proj/data/raw/x/README.md", {data_dir: "data"})  # "data/raw/x/README.md"

Used where a record is written (``defs/records.py``), by the export's card
(``integrations/dataset_card.py``) and by the MLflow runs (``defs/metadata.py``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

PACKAGE = "cluster_pipeline"
# The folder of the package's source: its git work tree is the one asked.
_SOURCE = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    """``git <args>`` in the package's source folder: its stdout stripped, or None where git
    is missing, the folder is not a work tree, or git fails (5 s at most)."""
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=5, cwd=_SOURCE
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_identity() -> dict[str, Any]:
    """The code running now: ``package``, its installed ``version`` (None: not installed),
    ``git_commit`` (the work tree's HEAD, 40 hex digits; None outside a git work tree) and
    ``git_dirty`` (True when a tracked file differs from that commit, so the commit alone does
    not name the code; untracked files, the ignored data folder among them, do not count;
    None without git). Two ``git`` calls, about 10 ms."""
    try:
        version: str | None = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "package": PACKAGE,
        "version": version,
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
    }


def describe_code(code: Mapping[str, Any]) -> str:
    """One line for :func:`code_identity`'s dict: ``cluster_pipeline 0.1.0, git 1e3e7ca...
    (uncommitted changes)``; ``not recorded`` for an empty one."""
    if not code:
        return "not recorded"
    text = f"{code.get('package', PACKAGE)} {code.get('version') or '(version unknown)'}"
    commit = code.get("git_commit")
    if not commit:
        return f"{text}, no git commit (not run from a git work tree)"
    dirty = code.get("git_dirty")
    state = {True: " with uncommitted changes", False: ", clean", None: ""}[dirty]
    return f"{text}, git commit {commit}{state}"


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, streamed (``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_sha256(files: Sequence[str | Path], folder: Path) -> dict[str, str]:
    """Each of ``files`` (paths) by its path relative to ``folder`` (``/``-separated; the path
    as given where it is not inside ``folder``) -> its SHA-256, sorted by that name."""
    out = {}
    for f in files:
        path = Path(f)
        try:
            name = path.resolve().relative_to(folder.resolve()).as_posix()
        except ValueError:
            name = str(f)
        out[name] = file_sha256(path)
    return dict(sorted(out.items()))


def rows_sha256(frame: pl.DataFrame, key: Sequence[str]) -> str:
    """SHA-256 (hex) of ``frame``'s rows in a canonical form: the column names (JSON), then the
    rows sorted by the ``key`` columns as polars writes them in NDJSON (one JSON object per
    line, columns in ``frame``'s order), in slices of 100,000 rows. Equal for equal rows in
    any order; about 1 s per million short rows.

    Raises:
        polars.exceptions.ColumnNotFoundError: a ``key`` column is not in ``frame``.
    """
    h = hashlib.sha256()
    h.update(json.dumps(frame.columns).encode())
    for batch in frame.sort(list(key), maintain_order=True).iter_slices(100_000):
        h.update(batch.write_ndjson().encode())
    return h.hexdigest()


def portable(text: str, roots: Mapping[Path, str] | Mapping[str, str]) -> str:
    """``text`` with every occurrence of each local folder in ``roots`` (folder -> what to
    write instead, e.g. ``{data_dir: "data", Path.home(): "~"}``) replaced, longest folder
    first (so the data folder inside the home folder reads ``data``, not ``~/...``).
    A folder is matched as given and resolved (symlinks followed)."""
    pairs: dict[str, str] = {}
    for folder, name in roots.items():
        for form in {str(Path(folder)), str(Path(folder).resolve())}:
            if form not in ("", "/", "."):
                pairs.setdefault(form, name)
    for folder in sorted(pairs, key=len, reverse=True):
        text = text.replace(folder, pairs[folder])
    return text
