"""Writing a file or a folder so that a reader sees the earlier one or the new one, never half.

Write to a temporary name beside the target, then rename it over the target: the temporary is
hidden (``.<name>.tmp-<random>``), in the target's own folder so the rename stays on one file
system, where POSIX ``rename(2)`` replaces a file in one step. A folder is swapped in with one
``renameat2(RENAME_EXCHANGE)`` on Linux (two renames where the C library or the file system
lacks it, the earlier folder renamed back if the second fails), so the target path always
holds a complete folder. A write that raises removes its temporary; a process killed hard
leaves the hidden temporary, never a torn target. Temporaries get the mode a plain ``open`` or
``mkdir`` would give under the process's umask (``mkstemp``'s 0600 and ``mkdtemp``'s 0700 are
widened), so what is renamed into place is what a direct write would have made.

Nothing here calls ``fsync``: the renames protect readers against a process that dies (killed
rank, Ctrl-C, a failing writer), not against a power cut, and no writer of the project asked
for more.

Used by every writer that must not leave half a file: shard manifests, checkpoints and their
training state, the JSON cache, the run lock's holder file, evaluation outcomes, the embedding
cache table and the ``datasets`` export.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _umask() -> int:
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_beside(target: Path, folder: bool = False) -> Path:
    """A new, empty file (or folder) beside ``target``, named ``.<target name>.tmp-<random>``,
    with the mode a plain write (``0o666``, folders ``0o777``) gets under the umask.

    Raises:
        OSError: ``target``'s parent is missing or cannot be written.
    """
    target = Path(target)
    prefix = f".{target.name}.tmp-"
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        tmp.chmod(0o777 & ~_umask())
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=target.parent)
        os.close(fd)
        tmp = Path(name)
        tmp.chmod(0o666 & ~_umask())
    return tmp


@contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """A temporary path to write ``target``'s new content to (:func:`temp_beside`); when the
    block ends without an error it is renamed over ``target`` (``os.replace``), else removed
    and ``target`` is left as it was. The parent folder must exist.

    A check that must pass before the new content counts (``check_alive``) goes last in the
    block: it runs before the rename.

    Raises:
        OSError: the temporary cannot be created or renamed; whatever the block raises.
    """
    target = Path(target)
    tmp = temp_beside(target)
    try:
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(target: Path, text: str, encoding: str | None = None) -> Path:
    """Write ``text`` to ``target`` atomically (:func:`atomic_file`); returns ``target``.

    Raises:
        OSError: as :func:`atomic_file`.
    """
    with atomic_file(target) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(target)


# renameat2's flag that swaps two paths in one step (linux/fs.h); AT_FDCWD: paths as given.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the C library or the file system lacks it.

    Raises:
        OSError: the swap was refused for another reason (permissions, a mount point).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(new: Path, target: Path) -> bool:
    """Put the folder ``new`` at ``target``; returns whether ``target`` held an earlier folder,
    which then lies at ``new``'s path (the caller deletes it, or keeps what it must). One
    atomic :func:`exchange` where the system has it; else ``target`` is renamed aside,
    ``new`` into place, and the earlier folder renamed back if that fails.

    Raises:
        OSError: a rename failed; ``target`` is then as it was.
    """
    new, target = Path(new), Path(target)
    if not target.exists():
        new.rename(target)
        return False
    if exchange(new, target):
        return True
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    aside.rmdir()
    target.rename(aside)
    try:
        new.rename(target)
    except BaseException:
        aside.rename(target)
        raise
    aside.rename(new)
    return True


@contextmanager
def atomic_folder(target: Path) -> Iterator[Path]:
    """A new, empty folder beside ``target`` (:func:`temp_beside`) to write into; when the block
    ends without an error it is swapped in (:func:`swap_in`) and the earlier folder deleted,
    else it is deleted and ``target`` is left as it was. The parent folder must exist.

    Raises:
        OSError: the folder cannot be created or swapped in; whatever the block raises.
    """
    target = Path(target)
    tmp = temp_beside(target, folder=True)
    try:
        yield tmp
        earlier = swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if earlier:
        shutil.rmtree(tmp, ignore_errors=True)
