"""The results file of ``polyaccel-asr transcribe`` and the checks around ``-o``: behaviour the
other tests left unpinned, found by mutation testing (each test fails when one check of
``results_file.py`` or ``cli.py`` is dropped, loosened or moved). The model is a fake recognizer."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from polyaccel.asr import cli, results_file
from polyaccel.asr.results_file import OutputBusy, OutputLock, ResultsWriter, scan_results
from polyaccel.asr.transcriber import Transcriber

SR = 16000


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fake model (its text is the sample count); returns the names it was asked to load."""
    asked: list[str] = []

    def fake_from_pretrained(name: str = "fake", *, batch_size: int = 8, replicas: int | None = None, **kw):
        asked.append(name)
        return Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_from_pretrained))
    return asked


def _line(path: object, text: str = "hi", error: object = None) -> bytes:
    return (json.dumps({"path": path, "text": text, "duration_s": 0.1, "error": error}) + "\n").encode()


# ---- what counts as a results file ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [["a.wav"], 7, None, {"file": "a.wav"}])
def test_a_record_whose_path_is_not_a_string_makes_a_file_not_ours(asr_cli, loads: list[str], tmp_path: Path,
                                                                   path: object,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """Lines with every results field but a path that is a list, number, null or object are no
    run's records: ``wer --hyps`` on such a file is a usage error (it crashed with a TypeError
    traceback when the path reached ``Path()`` in the reference lookup), and ``transcribe -o`` refuses the
    file instead of appending results to somebody else's JSONL."""
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "hello"}\n')
    other = tmp_path / "other.jsonl"
    other.write_bytes(_line(path))
    before = other.read_bytes()
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(other)]) == 2
    assert "is not a polyaccel-asr results file (line 1 is not a results record)" in capsys.readouterr().err
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(other), "-q"]) == 2
    assert "exists and is not a polyaccel-asr results file" in capsys.readouterr().err
    assert other.read_bytes() == before and loads == []


def test_a_last_line_of_non_json_whitespace_is_repaired_before_appending(tmp_path: Path) -> None:
    """A file ending in a form feed (no newline): the next record must not be glued after it
    (``\\x0c{...}`` is not JSON, so that record would be lost and the next run would refuse the
    whole file as not a results file); the writer rewrites the file first."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(_line("a.wav") + b"\x0c")
    with ResultsWriter(out) as w:
        w.write({"path": "b.wav", "text": "yo", "duration_s": 0.1, "error": None})
    assert [r["path"] for r in scan_results(out).records] == ["a.wav", "b.wav"]


# ---- the lock ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"1234567890" * 10 + b"\n" + b"42\n", b"12345\n", b"12345",
                                  b"polyaccel-asr lock, pid 12\n34\n"])
def test_a_file_of_digits_on_the_lock_path_is_not_taken_for_a_lock_file(tmp_path: Path, data: bytes) -> None:
    """A lock file of ours names itself and holds one process id. A user's file at
    ``out.jsonl.polyaccel-asr.lock`` that holds only a number (or starts like a lock file) is left alone,
    not truncated to our pid nor removed."""
    lock = tmp_path / "out.jsonl.polyaccel-asr.lock"
    lock.write_bytes(data)
    with pytest.raises(OSError, match="not a lock file of ours"):
        OutputLock(tmp_path / "out.jsonl").acquire()
    assert lock.read_bytes() == data


def test_a_stale_lock_file_of_ours_is_taken_over(tmp_path: Path) -> None:
    lock = tmp_path / "out.jsonl.polyaccel-asr.lock"
    lock.write_text("polyaccel-asr lock, pid 999999\n")  # its run was killed: no flock held on it
    with OutputLock(tmp_path / "out.jsonl") as held:
        assert lock.read_text() == f"polyaccel-asr lock, pid {os.getpid()}\n"
        assert "pid" in held._holder()
    assert not lock.exists()


def test_a_lock_being_released_cannot_be_taken_before_its_file_is_gone(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Release removes the lock file while still holding the lock. The other order lets a
    second run lock the file in between and then lose it to the removal, so that a third run
    creates a new lock file and writes the same results file alongside the second."""
    out = tmp_path / "out.jsonl"
    first = OutputLock(out).acquire()
    seen: list[str] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == first.path:
            try:
                OutputLock(out).acquire()
                seen.append("second run got the lock")
            except OutputBusy:
                seen.append("busy")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(type(first.path), "unlink", unlink)
    first.release()
    assert seen == ["busy"]
    monkeypatch.undo()
    with OutputLock(out):  # and the next run takes it
        pass
    assert not first.path.exists()


# ---- transcribe -o: refused before the model loads, synced at the end -------------------------------------


def test_an_existing_output_that_may_not_be_written_is_refused_before_the_model_loads(
        asr_cli, loads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """A write-protected results file (here one to repair: a failed record and a torn line) is
    a usage error before any model loads. Without the check the run loaded the model and, to
    repair the file, renamed a new one over it: the protection was silently bypassed."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(_line("x.wav", error="missing file") + b'{"path": "y.w')
    before = out.read_bytes()
    real_open = os.open

    def read_only(path, flags, *a, **k):  # noqa: ANN001, ANN202  (as for a 0444 file and a user who is not root)
        if os.path.realpath(path) == os.path.realpath(out) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(out))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "-q"]) == 2
    assert "Permission denied" in capsys.readouterr().err
    monkeypatch.undo()
    assert out.read_bytes() == before and loads == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "out.jsonl"]


def test_an_output_named_like_an_input_that_does_not_exist_yet_is_refused(
        asr_cli, loads: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``-o`` naming an input that is missing (a recording still being copied): nothing is there
    to compare inodes with, so the names decide. Without that check the run wrote its results
    where the recording is to go (that input failing as "missing file"), and every rerun was
    refused: -o had become an input."""
    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    later = tmp_path / "take2.dat"
    assert cli.main(["transcribe", wav, str(later), "-o", str(later), "-q"]) == 2
    assert f"-o {later}: is an input ({later}); refusing" in capsys.readouterr().err
    assert loads == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]


def test_the_results_are_synced_and_closed_when_the_run_ends(asr_cli, loads: list[str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer fsyncs at most once a second while writing; the run's end must sync the last
    records (a power loss right after exit 0 would lose them otherwise) and close the file."""
    out = tmp_path / "out.jsonl"
    wavs = [str(asr_cli.wav(tmp_path / f"{i}.wav")) for i in range(3)]
    events: list[str] = []

    def ours(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(out)
        except OSError:
            return False

    real_write, real_fsync, real_close = os.write, os.fsync, os.close
    monkeypatch.setattr(results_file.os, "write", lambda fd, data: (ours(fd) and events.append("write"))
                        or real_write(fd, data))
    monkeypatch.setattr(results_file.os, "fsync", lambda fd: (ours(fd) and events.append("fsync")) or real_fsync(fd))
    monkeypatch.setattr(results_file.os, "close", lambda fd: (ours(fd) and events.append("close")) or real_close(fd))
    monkeypatch.setattr(results_file, "FSYNC_INTERVAL_S", 3600.0)
    assert cli.main(["transcribe", *wavs, "-o", str(out), "-q"]) == 0
    assert events.count("write") == 3 and events[-2:] == ["fsync", "close"], events
    assert len(scan_results(out).records) == 3


def test_an_output_named_through_a_symlink_is_locked_and_written_as_the_file_it_names(
        asr_cli, loads: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``-o link.jsonl`` (a symlink to ``real.jsonl``): the lock is the real file's, so a run
    writing ``real.jsonl`` keeps this one out; the repair of a torn line replaces the real file,
    never the link (which would part the two: the real file stale, the link a new file)."""
    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    real = tmp_path / "real.jsonl"
    real.write_bytes(_line("x.wav", error="missing file") + b'{"path": "y.w')
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with OutputLock(real):
        assert cli.main(["transcribe", wav, "-o", str(link), "-q"]) == 2
    assert f"is writing {link}" in capsys.readouterr().err and loads == []
    assert cli.main(["transcribe", wav, "-o", str(link), "-q"]) == 0
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert [r["path"] for r in scan_results(real).records] == ["x.wav", wav]  # x.wav: not an input here
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "link.jsonl", "real.jsonl"]


def test_a_symlink_to_an_input_is_an_input_of_its_own_on_resume(asr_cli, loads: list[str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Resume compares paths with their folders resolved but keeps the file's own name: an
    utterance that is a symlink to shared audio gets its own record (references match it by
    its name), not skipped as already done because its target was."""
    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    (tmp_path / "utt2.wav").symlink_to(tmp_path / "a.wav")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", wav, "-o", str(out), "-q"]) == 0
    assert cli.main(["transcribe", wav, str(tmp_path / "utt2.wav"), "-o", str(out), "-q"]) == 0
    assert "1 ok, 0 failed, 1 skipped" in capsys.readouterr().err
    assert [r["path"] for r in scan_results(out).records] == [wav, str(tmp_path / "utt2.wav")]


def test_a_rerun_from_another_folder_does_not_take_other_files_of_the_same_relative_names_for_done(
        asr_cli, loads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Relative inputs are matched from the folder of the run that wrote them (each such record
    holds its run's ``cwd``): ``clips/a.wav`` run from /d1, then from /d2, is two inputs. Before,
    the second run answered "nothing to do", exit 0, and /d2's recordings were never transcribed."""
    out = tmp_path / "out.jsonl"
    for d in ("d1", "d2"):
        (tmp_path / d / "clips").mkdir(parents=True)
        asr_cli.wav(tmp_path / d / "clips" / "a.wav")
    monkeypatch.chdir(tmp_path / "d1")
    assert cli.main(["transcribe", "clips/a.wav", "-o", str(out), "-q"]) == 0
    monkeypatch.chdir(tmp_path / "d2")
    assert cli.main(["transcribe", "clips/a.wav", "-o", str(out), "-q"]) == 0
    records = scan_results(out).records
    assert [(r["path"], r["cwd"]) for r in records] == [("clips/a.wav", str(tmp_path / "d1")),
                                                       ("clips/a.wav", str(tmp_path / "d2"))]
    monkeypatch.chdir(tmp_path / "d1")  # back in the first folder its input is done
    asr_cli.wav(tmp_path / "d1" / "clips" / "b.wav")
    capsys.readouterr()
    assert cli.main(["transcribe", "clips/a.wav", "./clips/b.wav", "-o", str(out), "-q"]) == 0
    assert "1 ok, 0 failed, 1 skipped" in capsys.readouterr().err
    # a record written before runs kept their folder is still taken from the current one
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_bytes(_line("clips/a.wav"))
    assert cli.main(["transcribe", "clips/a.wav", "-o", str(legacy), "-q"]) == 0
    assert len(scan_results(legacy).records) == 1


# ---- found by an attack pass (session 28) ---------------------------------------------------------------


@pytest.mark.parametrize("content", [
    json.dumps({"path": {"train": "/data/train"}, "epochs": 30}).encode(),  # json.dump's config: no newline
    json.dumps({"path": "b.wav", "text": "a manifest line"}).encode(),
    b"\0" * 4096,  # a disk image, a sparse file
    b"{",
    b'{"path": ',
])
def test_a_one_line_file_without_a_newline_is_not_taken_for_a_torn_results_file(
        asr_cli, loads: list[str], tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture) -> None:
    """A torn last line is a kill's doing only after whole records: a file whose only line lacks
    its newline (what ``json.dump`` writes) or that holds zero bytes is a user's, refused with
    every byte kept (it was replaced by one results line, or appended to)."""
    out = tmp_path / "config.json"
    out.write_bytes(content)
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "-q"]) == 2
    assert "exists and is not a polyaccel-asr results file" in capsys.readouterr().err
    assert out.read_bytes() == content and loads == []


def test_a_torn_line_after_whole_records_is_still_repaired(asr_cli, loads: list[str], tmp_path: Path) -> None:
    """The other side of the rule above: a kill's torn line (or a power loss's zero bytes) after a
    whole record is dropped and the run resumes."""
    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    for tail in (b'{"path": "b.w', b"\0" * 100):
        out = tmp_path / "out.jsonl"
        out.write_bytes(_line("x.wav") + tail)
        assert cli.main(["transcribe", wav, "-o", str(out), "-q"]) == 0
        assert [r["path"] for r in scan_results(out).records] == ["x.wav", wav]
        out.unlink()


def test_failed_records_of_inputs_not_in_this_run_are_kept(asr_cli, loads: list[str], tmp_path: Path) -> None:
    """A resume drops failed records so that their files are tried again, but only for this
    run's inputs: another folder's failures written to the same file stay (they were lost
    without a retry)."""
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    a, b = asr_cli.wav(tmp_path / "A" / "good.wav"), asr_cli.wav(tmp_path / "B" / "other.wav")
    bad = tmp_path / "A" / "bad.wav"
    bad.write_text("not audio")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(tmp_path / "A"), "-o", str(out), "-q"]) == 1
    assert cli.main(["transcribe", str(b), "-o", str(out), "-q"]) == 0
    records = {r["path"]: r for r in scan_results(out).records}
    assert set(records) == {str(a), str(bad), str(b)} and records[str(bad)]["error"]
    bad.unlink()
    asr_cli.wav(bad)  # now good audio: rerunning its folder retries it, replacing the failed record
    assert cli.main(["transcribe", str(tmp_path / "A"), "-o", str(out), "-q"]) == 0
    records = [r for r in scan_results(out).records if r["path"] == str(bad)]
    assert len(records) == 1 and not records[0]["error"]


def test_a_lock_file_that_cannot_be_removed_is_a_note_not_a_failure(asr_cli, loads: list[str], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """Every result written, then the lock file's removal fails (its folder made read-only
    meanwhile): exit 0 with a note (it was a PermissionError traceback and exit 1); the next run
    takes the file over."""
    out = tmp_path / "out.jsonl"
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.endswith(results_file.LOCK_SUFFIX):
            raise PermissionError(errno.EACCES, "Permission denied")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    assert cli.main(["transcribe", wav, "-o", str(out), "-q"]) == 0
    assert "could not remove the lock file" in capsys.readouterr().err
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "b.wav")), "-o", str(out), "-q"]) == 0
    assert len(scan_results(out).records) == 2


def test_a_users_lock_file_next_to_the_output_is_never_ours(asr_cli, loads: list[str], tmp_path: Path) -> None:
    """``flock out.jsonl.lock polyaccel-asr ... -o out.jsonl`` (a cron job's usual guard) runs:
    our lock has a name of its own, so the guard's lock neither blocks the run (it was refused
    as "another run is writing") nor, left empty, gets removed by it."""
    import fcntl

    out = tmp_path / "out.jsonl"
    guard = tmp_path / "out.jsonl.lock"
    fd = os.open(guard, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "-q"]) == 0
    finally:
        os.close(fd)
    assert guard.exists() and guard.read_bytes() == b"" and len(scan_results(out).records) == 1


@pytest.mark.parametrize("argv", [["transcribe", "{wav}", "-o", "{out}", "--replicas", "100000"],
                                  ["bench", "{wav}", "--repeat", "1000000000"],
                                  ["transcribe", "{wav}", "-o", "{out}", "--batch-size", "99999999999999999999"]])
def test_absurd_replica_and_repeat_counts_are_usage_errors(asr_cli, loads: list[str], tmp_path: Path,
                                                           argv: list[str], capsys: pytest.CaptureFixture) -> None:
    """``--replicas 100000`` ran out of threads into a traceback that hid the cause ("cannot join
    thread before it is started"); ``bench --repeat 1000000000`` built an 8 GB list first."""
    wav, out = str(asr_cli.wav(tmp_path / "a.wav")), str(tmp_path / "out.jsonl")
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(wav=wav, out=out) for a in argv])
    assert e.value.code == 2 and "must be <=" in capsys.readouterr().err
    assert loads == [] and not os.path.exists(out)


def test_no_thread_left_for_a_replica_is_a_usage_error(asr_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Fewer threads left than replicas asked for (a low ``ulimit -u``): one line naming the
    cause and the flag, exit 2, the output untouched."""
    def no_threads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(no_threads))
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "--replicas", "8",
                     "-q"]) == 2
    assert "cannot start a thread for each of the 8 replicas" in capsys.readouterr().err
    assert not out.exists()
