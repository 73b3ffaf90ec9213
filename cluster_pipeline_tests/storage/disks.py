"""A small disk of its own for a test: a tmpfs mounted in the test's folder (root can mount one
here; elsewhere the test is skipped, saying why)."""

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes (a multiple of 4096) mounted at ``path`` (made), unmounted
    after.

    Skips the test when mounting is refused (not root, no CAP_SYS_ADMIN, a container without
    mount rights).
    """
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit status {done.returncode}"
        pytest.skip(f"cannot mount a tmpfs for a full disk here ({why}); run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
