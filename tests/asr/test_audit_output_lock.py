"""Audit (session audit-asr): the output lock on a full disk."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from polyaccel.asr import results_file
from polyaccel.asr.results_file import OutputLock


def test_a_lock_that_cannot_be_written_leaves_no_lock_file(tmp_path: Path, monkeypatch) -> None:
    """On a full disk the lock file was created, its line could not be written, and the empty
    file stayed beside the results after a run that said "nothing written" (exit 2)."""
    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_file, "_write_all", full)
    out = tmp_path / "out.jsonl"
    lock = OutputLock(out)
    with pytest.raises(OSError, match="No space"):
        lock.acquire()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with OutputLock(out) as again:  # and the next run takes it
        assert again.path.read_text().startswith(results_file.LOCK_HEADER)
