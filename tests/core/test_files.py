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
