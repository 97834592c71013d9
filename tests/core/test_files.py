"""``polyaccel.core.files.replace_file``: atomic, never through a file or link beside it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from polyaccel.core import files
from polyaccel.core.files import replace_file


def test_replace_keeps_the_mode_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    target.chmod(0o640)
    replace_file(target, b"new\n")
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
    replace_file(os.fsencode(tmp_path / "fresh.srt"), b"x")  # bytes paths (names that are not UTF-8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.srt", "out.jsonl"]


@pytest.mark.parametrize("name", ["out.jsonl.tmp", "out.jsonl.tmp-1", "out.jsonl.1234.tmp"])
def test_a_link_named_like_a_temporary_is_never_written_through(tmp_path: Path, name: str) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    (tmp_path / name).symlink_to(mine)
    replace_file(tmp_path / "out.jsonl", b"new\n")
    assert mine.read_text() == "mine\n" and (tmp_path / "out.jsonl").read_text() == "new\n"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        replace_file(target, b"new\n")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_a_new_file_gets_the_usual_mode_from_the_umask(tmp_path: Path) -> None:
    """Not a private 0600 temporary's mode: 0666 less the umask, as ``open()`` would give."""
    old = os.umask(0o022)
    try:
        replace_file(tmp_path / "fresh.jsonl", b"x")
        os.umask(0o027)
        replace_file(tmp_path / "other.jsonl", b"y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh.jsonl").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "other.jsonl").stat().st_mode) == 0o640


def test_the_data_is_synced_before_the_rename_and_the_folder_after(tmp_path: Path, monkeypatch) -> None:
    """Durability (a power loss keeps the old or the new file): the new bytes reach the disk
    while ``path`` still holds the old ones, then the folder holding the rename is synced."""
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    real = os.fsync
    synced = []

    def fsync(fd):
        st = os.fstat(fd)
        synced.append("folder" if stat.S_ISDIR(st.st_mode) else ("file", st.st_size, target.read_text()))
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    replace_file(target, b"new!\n")
    assert synced == [("file", 5, "old\n"), "folder"]


def test_short_writes_are_continued_until_every_byte_is_written(tmp_path: Path, monkeypatch) -> None:
    """``os.write`` may write fewer bytes than asked (signals, pipes, some file systems)."""
    real = os.write
    monkeypatch.setattr(files.os, "write", lambda fd, data: real(fd, bytes(data[:3])))
    data = bytes(range(256)) * 5
    replace_file(tmp_path / "out.bin", data)
    assert (tmp_path / "out.bin").read_bytes() == data
