"""Free space, checked before the large writes and named when a write runs out of it (issue 43:
on a full disk training failed with ``unexpected pos 65792 vs 65684``, torch's zip writer's
words, and the embedding pass with ``rank_0 failed first: (no message)``).

Every large writer asks :func:`require_space` first with the bytes it is about to write
(a checkpoint's size follows from its tensors, an embedding chunk's from its rows, a Delta
commit's from its frame), and writes inside :func:`naming_full_disk`, which turns whatever the
library raised on a full disk (``OSError`` ENOSPC or EDQUOT anywhere in the exception's chain,
torch's ``PytorchStreamWriter failed writing file``) into one :class:`DiskFull`: the folder, the
bytes needed and the bytes free, and what to do. Every writer writes beside its target and
renames (storage/atomic.py) or commits atomically (Delta), so what was there before stays
readable.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What a full disk looks like in the exceptions of the libraries that write: the errnos, and
# torch's zip writer (torch.save), which reports a short write without one.
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = (
    "No space left on device",
    "PytorchStreamWriter failed writing file",
    "unexpected pos",
)
# Below this many free bytes a disk counts as full for a failure that gave no reason.
LOW_SPACE = 1 << 20


def format_bytes(n: int) -> str:
    """``1.60 GB (1,600,000,000 bytes)``: decimal units, then the exact count."""
    value, unit = float(n), "bytes"
    for name in ("kB", "MB", "GB", "TB"):
        if value < 1000:
            break
        value, unit = value / 1000, name
    short = f"{n:,} bytes" if unit == "bytes" else f"{value:.2f} {unit} ({n:,} bytes)"
    return short


class DiskFull(OSError):
    """A write that does not fit where it goes (errno ENOSPC), named: what was written, the
    folder, the bytes it needs and the bytes free there."""

    def __init__(self, what: str, folder: Path | str, needed: int | None, free: int):
        self.what, self.folder, self.needed, self.free = what, Path(folder), needed, free
        need = f"this write needs {format_bytes(needed)} and " if needed is not None else ""
        self.message = (
            f"{what}: the disk holding {folder} is full: {need}"
            f"{format_bytes(free)} are free there. Free space on that disk (or set "
            "CLUSTER_PIPELINE_DATA_DIR to a folder on a larger one) and run again; what was "
            "written before is untouched"
        )
        super().__init__(errno.ENOSPC, self.message, str(folder))

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # pickled across processes (Dagster's step errors)
        return (DiskFull, (self.what, str(self.folder), self.needed, self.free))


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (where the folder will be made)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(folder: Path | str) -> int:
    """Bytes free to this user on the file system of ``folder`` (or of its nearest existing
    parent)."""
    return shutil.disk_usage(_existing(Path(folder))).free


def require_space(folder: Path | str, needed: int, what: str) -> None:
    """Refuse a write of ``needed`` bytes into ``folder`` before it starts, when the disk has
    fewer free.

    Raises:
        DiskFull: not enough free space (names the folder, both byte counts and ``what``).
    """
    free = free_bytes(folder)
    if free < needed:
        raise DiskFull(what, folder, needed, free)


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception in its chain (``__cause__``, ``__context__``) is a full
    disk's: ENOSPC or EDQUOT, or torch's zip writer's short write."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _FULL_ERRNOS:
            return True
        if any(text in str(current) for text in _FULL_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


@contextmanager
def naming_full_disk(folder: Path | str, needed: int | None, what: str) -> Iterator[None]:
    """Run a write; if it fails on a full disk, raise :class:`DiskFull` naming ``folder``,
    ``needed`` bytes (None: unknown) and the bytes free now, from the original error.

    Raises:
        DiskFull: the write ran out of space.
    """
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFull(what, folder, needed, free_bytes(folder)) from e
        raise


def full_disk_note(folders: list[Path | str]) -> str | None:
    """For a failure that gave no reason of its own: ``the disk holding <folder> is full
    (<n> bytes free)`` for the first of ``folders`` whose disk has under :data:`LOW_SPACE`
    free, else None."""
    for folder in folders:
        try:
            free = free_bytes(folder)
        except OSError:
            continue
        if free < LOW_SPACE:
            return f"the disk holding {folder} is full ({format_bytes(free)} free)"
    return None
