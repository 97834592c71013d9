"""``polyaccel.core.files``: ``replace_file`` atomic, never through a file or link beside it;
``create_file`` never replaces anything and never leaves a cut file, even after a kill."""

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


@pytest.mark.parametrize("name", ["a" * 255, "é" * 127 + "a", os.fsencode("é" * 120) + b"\xff" * 15])
def test_names_up_to_the_longest_a_file_system_takes_are_written(tmp_path: Path, name: str | bytes) -> None:
    """A 255-byte name (the limit) with ASCII, two-byte characters, or bytes that are not
    UTF-8: its temporary name is cut to fit, never cutting a character in two."""
    target = os.path.join(os.fsencode(tmp_path) if isinstance(name, bytes) else str(tmp_path), name)
    files.create_file(target, b"one")
    replace_file(target, b"two")
    with open(target, "rb") as f:
        assert f.read() == b"two"
    assert os.listdir(tmp_path) == [os.fsdecode(name) if isinstance(name, bytes) else name]


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


# ---- create_file: a new file, whole or not at all --------------------------------------------------

def test_create_file_makes_a_new_file_and_never_replaces_one(tmp_path: Path) -> None:
    from polyaccel.core.files import create_file

    create_file(tmp_path / "a.srt", b"1\n")
    create_file(os.fsencode(tmp_path / "b\xe9.srt".encode("latin-1").decode("utf-8", "surrogateescape")), b"2\n")
    mine = tmp_path / "mine.txt"
    mine.write_text("mine\n")
    (tmp_path / "c.srt").symlink_to(mine)
    for existing in ("a.srt", "c.srt"):
        with pytest.raises(FileExistsError):
            create_file(tmp_path / existing, b"new\n")
    assert (tmp_path / "a.srt").read_bytes() == b"1\n" and mine.read_text() == "mine\n"
    assert len(list(tmp_path.iterdir())) == 4  # a, b, c, mine: no temporary left


def test_create_file_without_hard_links_creates_it_in_place(tmp_path: Path, monkeypatch) -> None:
    import errno

    from polyaccel.core.files import create_file

    def no_links(src, dst):  # noqa: ANN001
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    create_file(tmp_path / "a.txt", b"words\n")
    assert (tmp_path / "a.txt").read_bytes() == b"words\n" and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(FileExistsError):
        create_file(tmp_path / "a.txt", b"other\n")


def test_a_kill_while_creating_leaves_no_cut_file(tmp_path: Path) -> None:
    """SIGKILL in the middle of writing: the target does not exist (a rerun creates it whole),
    where a file created in place would be there cut, and taken for finished."""
    import subprocess
    import sys

    target = tmp_path / "a.srt"
    child = f"""
import os, signal
from polyaccel.core import files
real = os.write
def write(fd, data):
    real(fd, bytes(data[:10]))
    os.kill(os.getpid(), signal.SIGKILL)
os.write = write
files.create_file({str(target)!r}, b"x" * 100000)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert not target.exists()
    files.create_file(target, b"whole\n")
    assert target.read_bytes() == b"whole\n"


# ---- the temporary: beside the target, its mode from the kernel's umask ---------------------------

def test_a_bare_file_name_gets_its_temporary_beside_it_not_in_tmpdir(tmp_path: Path, monkeypatch) -> None:
    """``replace_file("out.jsonl")`` (a name without a folder): the temporary goes in the current
    folder, never in ``$TMPDIR``, whence the rename (or the hard link) fails with EXDEV when
    that is another file system (a tmpfs ``/tmp``) and the file cannot be written at all."""
    import tempfile

    from polyaccel.core.files import create_file

    elsewhere = tmp_path / "tmpdir"
    elsewhere.mkdir()
    (tmp_path / "work").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    monkeypatch.chdir(tmp_path / "work")
    moved = []
    real_replace, real_link = os.replace, os.link
    monkeypatch.setattr(files.os, "replace", lambda a, b: moved.append(a) or real_replace(a, b))
    monkeypatch.setattr(files.os, "link", lambda a, b: moved.append(a) or real_link(a, b))
    replace_file("out.jsonl", b"new\n")
    create_file(b"subs.srt", b"1\n")
    assert [os.path.dirname(os.fsdecode(m)) for m in moved] == ["", ""], moved
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["out.jsonl", "subs.srt"]
    assert not any(elsewhere.iterdir())


def test_replace_file_never_clears_the_process_umask(tmp_path: Path, monkeypatch) -> None:
    """The umask is process-wide: ``os.umask(0)`` to read it leaves a window where every other
    thread (replica threads, Ray's and torch's native threads) creates files readable and
    writable by everyone. The new file's mode comes from the kernel applying the umask."""
    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    old = real(0o027)
    try:
        replace_file(tmp_path / "fresh.jsonl", b"x")
    finally:
        real(old)
    assert calls == [] and stat.S_IMODE((tmp_path / "fresh.jsonl").stat().st_mode) == 0o640


def test_sha256_of_reads_the_rest_of_a_file_in_chunks(tmp_path):
    import hashlib

    from polyaccel.core.files import sha256_of

    data = bytes(range(256)) * 41
    (tmp_path / "f").write_bytes(data)
    with (tmp_path / "f").open("rb") as f:
        f.read(7)
        assert sha256_of(f, chunk=100) == hashlib.sha256(data[7:]).hexdigest()
