"""``polyaccel.core.files`` helpers the MoE and ASR commands rely on (reading files a user or
an attacker may have put there, undoing the folders a failed write made), pinned here where
they are defined; found unpinned by hand mutation testing."""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

import pytest

from polyaccel.core import files


def test_missing_dirs_are_the_path_and_the_absent_parents_innermost_first(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert files.missing_dirs(target) == [target, tmp_path / "a" / "b", tmp_path / "a"]
    assert files.missing_dirs(tmp_path) == []


def test_a_dangling_link_is_not_a_missing_dir(tmp_path: Path) -> None:
    """A link to nothing exists: writing "into" it is not ours to undo by removing it later."""
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert files.missing_dirs(tmp_path / "link" / "x") == [tmp_path / "link" / "x"]


def test_remove_empty_dirs_leaves_every_folder_that_holds_something(tmp_path: Path) -> None:
    made = files.missing_dirs(tmp_path / "a" / "b" / "c")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "keep.txt").write_text("mine\n")
    files.remove_empty_dirs(made)
    assert not (tmp_path / "a" / "b").exists()
    assert (tmp_path / "a" / "keep.txt").read_text() == "mine\n"


def test_read_regular_reads_a_small_regular_file(tmp_path: Path) -> None:
    f = tmp_path / "cfg.json"
    f.write_bytes(b"x" * 10)
    assert files.read_regular(f, 10) == b"x" * 10
    assert files.read_regular(f, 9) is None
    assert files.read_regular(tmp_path / "missing", 10) is None


def test_read_regular_refuses_a_file_that_grew_past_the_limit_after_its_size_was_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size from ``fstat`` may be stale (a file still being written); what is read counts."""
    f = tmp_path / "growing"
    f.write_bytes(b"y" * 50)
    real = os.fstat
    monkeypatch.setattr(files.os, "fstat", lambda fd: type("S", (), {"st_mode": real(fd).st_mode, "st_size": 5})())
    assert files.read_regular(f, 10) is None


def test_read_regular_never_follows_a_link(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(b"s")
    (tmp_path / "link").symlink_to(tmp_path / "secret")
    assert files.read_regular(tmp_path / "link", 10) is None


@pytest.mark.timeout(20)
def test_read_regular_never_blocks_on_a_fifo_nor_reads_a_device(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes | None] = []
    t = threading.Thread(target=lambda: got.append(files.read_regular(fifo, 10)), daemon=True)
    t.start()
    t.join(5)
    assert got == [None], "read_regular blocked opening a FIFO nobody writes"
    assert files.read_regular("/dev/zero", 10) is None
    assert files.read_regular(tmp_path, 1 << 20) is None  # a folder: None, not IsADirectoryError
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        assert files.read_regular(tmp_path / "sock", 10) is None


def test_is_regular_says_no_for_a_link_a_folder_and_nothing(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    assert files.is_regular(tmp_path / "f")
    assert not files.is_regular(tmp_path / "link") and not files.is_regular(tmp_path)
    assert not files.is_regular(tmp_path / "missing")


def test_create_file_on_a_full_disk_is_that_error_not_the_in_place_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a file system without hard links falls back to writing in place; another link
    error (no space for the directory entry, no permission) is raised, nothing left behind."""
    def full(a, b):  # noqa: ANN001
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "link", full)
    with pytest.raises(OSError, match="No space") as e:
        files.create_file(tmp_path / "a.srt", b"1\n")
    assert not isinstance(e.value, files._NoHardLinks)
    assert list(tmp_path.iterdir()) == []


def test_replacing_a_link_gives_the_new_file_the_mode_of_the_file_it_named(tmp_path: Path) -> None:
    """``replace_file`` on a path that is a link: the new file keeps the mode of the file the
    link named (what the user saw), never the link's own 0777 (writable by everyone)."""
    real = tmp_path / "data.txt"
    real.write_text("old")
    real.chmod(0o640)
    link = tmp_path / "current.txt"
    link.symlink_to(real)
    files.replace_file(link, b"new")
    assert not link.is_symlink() and oct(link.stat().st_mode & 0o777) == oct(0o640)
    assert real.read_text() == "old"


def test_an_interrupt_while_writing_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (``KeyboardInterrupt``, not an ``Exception``) in the middle of the write: the old
    file stays whole and no hidden temporary is left beside it."""
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def interrupted(fd, data):  # noqa: ANN001
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        files.replace_file(target, b"new\n")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_a_failed_chmod_of_the_temporary_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def denied(fd, mode):  # noqa: ANN001
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(files.os, "fchmod", denied)
    with pytest.raises(PermissionError):
        files.replace_file(target, b"new\n")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]
