"""Atomic writes: the target holds the earlier content or the new, never half, and nothing is
left beside it; temporaries get the mode a plain write would."""

import os
import stat
from pathlib import Path

import pytest

from cluster_pipeline.storage import atomic


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_file_is_replaced_whole_and_nothing_is_left_beside_it(tmp_path):
    target = tmp_path / "rank_0.json"
    target.write_text("earlier")
    with atomic.atomic_file(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".rank_0.json.tmp-")
        tmp.write_text("new")
        assert target.read_text() == "earlier"  # not yet renamed
    assert target.read_text() == "new"
    assert _names(tmp_path) == ["rank_0.json"]
    assert atomic.write_text(tmp_path / "b.txt", "é", encoding="utf-8") == tmp_path / "b.txt"
    assert (tmp_path / "b.txt").read_bytes() == "é".encode()


def test_a_failed_file_write_leaves_the_target_as_it_was(tmp_path):
    target = tmp_path / "state.pt"
    target.write_bytes(b"earlier")
    with pytest.raises(RuntimeError, match="killed"), atomic.atomic_file(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"earlier"
    assert _names(tmp_path) == ["state.pt"]


def test_modes_are_those_of_a_plain_write(tmp_path):
    old = os.umask(0o027)
    try:
        plain_file = tmp_path / "plain.txt"
        plain_file.write_text("x")
        plain_dir = tmp_path / "plain"
        plain_dir.mkdir()
        atomic.write_text(tmp_path / "file.txt", "x")
        with atomic.atomic_folder(tmp_path / "folder") as tmp:
            (tmp / "a").write_text("a")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "file.txt") == _mode(plain_file) == 0o640
    assert _mode(tmp_path / "folder") == _mode(plain_dir) == 0o750


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_a_folder_is_swapped_in_and_the_earlier_one_deleted(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    target = tmp_path / "step_0000001"
    target.mkdir()
    (target / "old.bin").write_text("earlier")
    with atomic.atomic_folder(target) as tmp:
        assert tmp.name.startswith(".step_0000001.tmp-") and _names(tmp) == []
        (tmp / "model.safetensors").write_text("new")
    assert _names(target) == ["model.safetensors"]
    assert _names(tmp_path) == ["step_0000001"]
    with atomic.atomic_folder(tmp_path / "fresh") as tmp:
        (tmp / "a").write_text("a")
    assert _names(tmp_path / "fresh") == ["a"]


def test_a_failed_folder_write_leaves_the_earlier_one(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "kept").write_text("earlier")
    with pytest.raises(OSError, match="No space"), atomic.atomic_folder(target) as tmp:
        (tmp / "half").write_text("half")
        raise OSError(28, "No space left on device")
    assert _names(tmp_path) == ["export"] and _names(target) == ["kept"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_swap_in_leaves_the_earlier_folder_at_the_new_ones_path(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    new, target = tmp_path / "new", tmp_path / "target"
    new.mkdir()
    (new / "n").write_text("new")
    assert atomic.swap_in(new, target) is False
    assert _names(target) == ["n"] and not new.exists()
    new.mkdir()
    (new / "m").write_text("newer")
    assert atomic.swap_in(new, target) is True
    assert _names(target) == ["m"] and _names(new) == ["n"]
    assert _names(tmp_path) == ["new", "target"]


def test_a_second_rename_that_fails_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "exchange", lambda a, b: False)
    new, target = tmp_path / "new", tmp_path / "target"
    for folder, name in ((new, "n"), (target, "t")):
        folder.mkdir()
        (folder / name).write_text(name)
    real = Path.rename

    def rename(self, dest):
        if self == new:
            raise OSError(28, "No space left on device")
        return real(self, dest)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        atomic.swap_in(new, target)
    assert _names(target) == ["t"] and _names(new) == ["n"]
    assert _names(tmp_path) == ["new", "target"]


def test_exchange_swaps_two_folders_in_one_step_where_the_system_can(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / folder.name).write_text(folder.name)
    if not atomic.exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this file system")
    assert _names(a) == ["b"] and _names(b) == ["a"]
    with pytest.raises(FileNotFoundError):
        atomic.exchange(a, tmp_path / "missing")
