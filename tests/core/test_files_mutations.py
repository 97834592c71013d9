"""``polyaccel.core.files``: behaviour the tests in ``test_files.py`` left unpinned, found by
mutation testing (each test below fails when one check of ``files.py`` is dropped or moved)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from polyaccel.core import files
from polyaccel.core.files import create_file, replace_file


def _tokens(monkeypatch: pytest.MonkeyPatch, *tokens: str) -> None:
    """The temporaries' random parts, in order (then random again)."""
    queue = list(tokens)
    real = files.secrets.token_hex
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: queue.pop(0) if queue else real(n))


@pytest.mark.parametrize("put", [replace_file, create_file])
def test_a_link_on_the_temporary_s_own_name_is_skipped_not_written_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, put) -> None:  # noqa: ANN001
    """A hostile neighbour who wins the name race (a link placed on exactly the name the
    temporary is about to get): the user's file behind the link keeps its bytes, the target is
    a plain file with the new ones, and the write simply takes the next free name, neither
    failing nor leaving the link in place of the target."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine\n")
    (tmp_path / "out.jsonl.aaaaaaaaaaaa.tmp").symlink_to(mine)
    _tokens(monkeypatch, "aaaaaaaaaaaa", "bbbbbbbbbbbb")
    put(tmp_path / "out.jsonl", b"new\n")
    assert mine.read_text() == "mine\n"
    assert not (tmp_path / "out.jsonl").is_symlink() and (tmp_path / "out.jsonl").read_bytes() == b"new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out.jsonl", "out.jsonl.aaaaaaaaaaaa.tmp"]


def test_without_hard_links_a_failed_write_leaves_no_cut_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for file systems without hard links creates the file in place: when the
    write fails (a full disk) the half-written file is removed again, or a rerun would find it,
    refuse to replace it (``FileExistsError``) and keep the cut file for good."""
    monkeypatch.setattr(os, "link", lambda a, b: (_ for _ in ()).throw(PermissionError(errno.EPERM, "no links")))
    real_open = open

    class FullDisk:
        def __init__(self, f):  # noqa: ANN001
            self.f = f

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def write(self, data: bytes) -> int:
            self.f.write(data[:7])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "open", lambda *a, **k: FullDisk(real_open(*a, **k)), raising=False)
    target = tmp_path / "a.srt"
    with pytest.raises(OSError, match="No space"):
        create_file(target, b"1\n00:00:00,000 --> 00:00:01,000\nhello\n")
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_a_private_file_s_new_bytes_are_never_in_a_file_others_may_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing a 0600 file: the temporary is created 0600 (then given the file's mode), never
    with the umask's usual 0644 for a moment, long enough for another user to open it and
    keep reading the private bytes written into it afterwards."""
    target = tmp_path / "secret.jsonl"
    target.write_text("old\n")
    target.chmod(0o600)
    seen = []
    real = os.fchmod
    monkeypatch.setattr(files.os, "fchmod", lambda fd, mode: seen.append(stat.S_IMODE(os.fstat(fd).st_mode))
                        or real(fd, mode))
    old = os.umask(0o022)
    try:
        replace_file(target, b"new\n")
    finally:
        os.umask(old)
    assert seen and all(m & 0o077 == 0 for m in seen), [oct(m) for m in seen]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.read_text() == "new\n"


def test_the_folder_is_synced_after_the_rename_not_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder sync is what makes the rename survive a power loss: done before it, the
    folder on disk still names the old file and the new bytes can be lost after the call returned."""
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    real = os.fsync
    at_folder_sync = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            at_folder_sync.append(target.read_text())
        real(fd)

    monkeypatch.setattr(files.os, "fsync", fsync)
    replace_file(target, b"new!\n")
    assert at_folder_sync == ["new!\n"]
