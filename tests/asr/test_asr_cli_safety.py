"""``polyaccel-asr transcribe`` used carelessly or with hostile inputs (issue 10): outputs it must
not touch, file names that are not UTF-8, inputs that come to nothing, bad numbers, one file
named two ways, two runs on one output, and exit codes. Refusals never load a model; the rest
use a fake recognizer (fast, exact); the Ray test uses a tiny random ConformerAED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyaccel.asr import cli
from polyaccel.asr.results_file import OutputLock, ResultsWriter, load_results, record_path, scan_results
from polyaccel.asr.transcriber import Transcriber

SR = 16000


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fake model (its text is the sample count); returns the names it was asked to load.
    The model named "typo" does not exist."""
    asked: list[str] = []

    def fake_from_pretrained(name: str = "fake", *, batch_size: int = 8, replicas: int | None = None, **kw):
        asked.append(name)
        if name == "typo":
            raise KeyError("unknown model 'typo'; known: whisper-tiny.en, whisper-base")
        return Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_from_pretrained))
    from polyaccel.asr import weights  # what a rerun with nothing left to do checks the file against

    monkeypatch.setattr(weights, "model_provenance", lambda name, **kw: {"model": name, "weights_sha256": None})
    return asked


# ---- outputs that are not ours are never written ---------------------------------------------------


@pytest.mark.parametrize("content", [
    b"utt1\thello world\n",                                          # refs.tsv
    b'{"audio_filepath": "a.wav", "text": "hi"}\n',                  # somebody's manifest
    b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)),             # audio with a JSON-less name
    b"x" * 300_000,                                                   # one long line, no newline
])
@pytest.mark.parametrize("overwrite", [False, True])
def test_an_existing_file_that_is_not_results_is_refused(asr_cli, loads: list[str], tmp_path: Path,
                                                         content: bytes, overwrite: bool,
                                                         capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "h01.wav")
    out = tmp_path / "refs.tsv"
    out.write_bytes(content)
    assert asr_cli.run(str(wav), "-o", str(out), *(["--overwrite"] if overwrite else [])) == 2
    assert "is not a polyaccel-asr results file" in capsys.readouterr().err
    assert out.read_bytes() == content, "untouched"
    assert loads == [] and sorted(p.name for p in tmp_path.iterdir()) == ["h01.wav", "refs.tsv"]


def test_an_output_that_is_an_input_is_refused_even_with_overwrite(asr_cli, loads: list[str], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    asr_cli.wav(tmp_path / "take.data")  # audio under a name that is not an audio extension
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": str(wav), "text": "x", "duration_s": 1, "error": None}) + "\n"
                        + json.dumps({"path": "take.data", "text": "y", "duration_s": 1, "error": None}) + "\n")
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "x"}\n')
    (tmp_path / "link.jsonl").symlink_to(manifest)
    os.link(manifest, tmp_path / "hard.jsonl")  # the same file under another name: no symlink to resolve
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for out in ("m.jsonl", "link.jsonl", "hard.jsonl", "take.data", "refs.jsonl"):
        assert asr_cli.run(str(manifest), "--refs", str(refs), "-o", str(tmp_path / out),
                           "--overwrite") == 2, out
        assert "is an input" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and loads == []
    with pytest.raises(SystemExit) as e:  # an audio name is refused by the parser
        cli.main(["transcribe", str(wav), "-o", str(wav), "--overwrite"])
    assert e.value.code == 2 and "named like an audio file" in capsys.readouterr().err
    assert wav.read_bytes() == before["a.wav"]
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "deep" / "new.wav")  # to an audio name not yet there
    assert asr_cli.run(str(wav), "-o", str(tmp_path / "dangling.jsonl")) == 2
    assert "named like an audio file" in capsys.readouterr().err
    assert not (tmp_path / "deep").exists() and loads == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_model_that_does_not_load_leaves_the_results_as_they_were(asr_cli, loads: list[str], tmp_path: Path,
                                                                    overwrite: bool,
                                                                    capsys: pytest.CaptureFixture) -> None:
    wavs = [str(asr_cli.wav(tmp_path / f"{i}.wav")) for i in range(2)]
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(*wavs, str(tmp_path / "late.wav"), "-o", str(out)) == 1  # late.wav is missing
    before = out.read_bytes()
    assert [r["error"] for r in asr_cli.results(out)] == [None, None, "missing file"]
    extra = ["--overwrite"] if overwrite else []
    assert asr_cli.run(*wavs, str(tmp_path / "late.wav"), "-o", str(out), "--model", "typo", *extra) == 2
    assert "unknown model 'typo';" in capsys.readouterr().err
    assert out.read_bytes() == before, "nothing is written before the model has loaded"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.wav", "1.wav", "out.jsonl"]


def test_a_refused_run_creates_no_folders(asr_cli, loads: list[str], tmp_path: Path) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    assert asr_cli.run(str(wav), "-o", str(tmp_path / "new" / "deeper" / "out.jsonl"), "--model", "typo") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]
    assert asr_cli.run(str(wav), "-o", str(tmp_path / "new" / "deeper" / "out.jsonl")) == 0
    assert len(asr_cli.results(tmp_path / "new" / "deeper" / "out.jsonl")) == 1


# ---- file names that are not UTF-8 ------------------------------------------------------------------


def test_a_file_name_that_is_not_utf8_is_transcribed_and_resumed(asr_cli, loads: list[str], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "clips"
    folder.mkdir()
    odd = os.fsencode(folder) + b"/caf\xe9.wav"  # Latin-1, as an old archive would have it
    asr_cli.wav(odd, 0.2)
    asr_cli.wav(folder / "zz.wav", 0.3)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(str(folder), "-o", str(out)) == 0
    first = out.read_bytes()
    first.decode("utf-8")  # the file stays valid UTF-8
    recs = asr_cli.results(out)
    assert [r["text"] for r in recs] == ["3200 samples", "4800 samples"]
    assert recs[0]["path"].endswith("caf\\xe9.wav") and os.fsencode(record_path(recs[0])) == odd
    assert asr_cli.run(str(folder), "-o", str(out)) == 0
    assert "0 ok, 0 failed, 2 skipped" in capsys.readouterr().err
    assert out.read_bytes() == first


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_file_name_that_is_not_utf8_goes_through_ray(asr_cli, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    import torch

    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    model = tmp_path / "tiny-conformer"
    ConformerAED.from_config(tiny(), seed=1).save_pretrained(model)
    folder = tmp_path / "clips"
    folder.mkdir()
    asr_cli.wav(os.fsencode(folder) + b"/caf\xe9.wav", 0.5)
    asr_cli.wav(folder / "zz.wav", 0.5)
    out = tmp_path / "ray.jsonl"
    threads = torch.get_num_threads()
    from polyaccel.core.ray_local import init_local

    init_local(num_cpus=1, log_to_driver=False)  # loopback only, token auth on
    try:
        args = ["transcribe", str(folder), "-o", str(out), "--ray", "--backend", "cpu", "--model", str(model), "-q"]
        assert cli.main(args) == 0
        assert cli.main(args) == 0
    finally:
        ray.shutdown()
        torch.set_num_threads(threads)
    recs = asr_cli.results(out)
    assert len(recs) == 2 and all(r["error"] is None and "actor" in r for r in recs)
    assert os.fsencode(record_path(recs[0])).endswith(b"/caf\xe9.wav")


# ---- inputs that come to nothing, odd outputs, bad numbers ---------------------------------------------


def test_nothing_to_transcribe_is_not_success(asr_cli, loads: list[str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "x.jsonl"
    assert asr_cli.run("/nonexistent_dir/", "-o", str(out)) == 2
    assert "no such directory: /nonexistent_dir/" in capsys.readouterr().err
    assert not out.exists()
    assert asr_cli.run(str(tmp_path / "nonexistent.wav"), "-o", str(out)) == 2  # every input missing
    assert "no such file or directory" in capsys.readouterr().err
    assert not out.exists() and not loads
    (tmp_path / "bad.wav").write_bytes(b"not audio")
    assert asr_cli.run(str(tmp_path / "bad.wav"), "-o", str(out)) == 3
    assert "nothing was transcribed: 1 file failed" in capsys.readouterr().err


def test_a_broken_symlink_is_a_per_file_error(asr_cli, loads: list[str], tmp_path: Path) -> None:
    folder = tmp_path / "clips"
    folder.mkdir()
    asr_cli.wav(folder / "a.wav")
    (folder / "b.wav").symlink_to(tmp_path / "gone.wav")
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(str(folder), "-o", str(out)) == 1
    errors = {Path(r["path"]).name: r["error"] for r in asr_cli.results(out)}
    assert errors == {"a.wav": None, "b.wav": f"broken symbolic link (to {tmp_path / 'gone.wav'})"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["dev_full", "fifo", "dir"])
def test_outputs_that_are_not_regular_files_are_refused(asr_cli, loads: list[str], tmp_path: Path, kind: str,
                                                        capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    out = {"dev_full": "/dev/full", "fifo": str(tmp_path / "fifo"), "dir": str(tmp_path / "d")}[kind]
    if kind == "fifo":
        os.mkfifo(out)
    if kind == "dir":
        os.mkdir(out)
    assert asr_cli.run(str(wav), "-o", out) == 2
    assert ("is a directory" if kind == "dir" else "is not a regular file") in capsys.readouterr().err
    assert loads == [] and not os.path.exists(out + ".polyaccel-asr.lock")


@pytest.mark.timeout(60)
def test_reading_results_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from polyaccel.asr import results_file

    monkeypatch.setattr(results_file, "MAX_LINE_BYTES", 1000)
    good = json.dumps({"path": "a.wav", "text": "hi", "duration_s": 1.0, "error": None})
    f = tmp_path / "out.jsonl"
    f.write_text(good + "\n" + "y" * 50_000 + "\n" + good.replace("a.wav", "b.wav") + "\n")
    with pytest.raises(results_file.NotResultsFile, match="line 2 is longer than 1000 bytes"):
        scan_results(f)
    assert [r["path"] for r in load_results(f)] == ["a.wav", "b.wav"]
    os.mkfifo(tmp_path / "fifo")  # opening it to read would wait for a writer forever
    for special in (tmp_path / "fifo", Path("/dev/zero")):
        with pytest.raises(results_file.NotResultsFile, match="not a regular file"):
            scan_results(special)


@pytest.mark.parametrize("extra", [
    ["--batch-size", "0"], ["--batch-size", "-4"], ["--replicas", "0"], ["--replicas", "two"],
    ["--num-actors", "0"], ["--overlap", "-1"], ["--overlap", "nan"], ["--overlap", "inf"],
])
def test_bad_numbers_are_usage_errors(asr_cli, loads: list[str], tmp_path: Path, extra: list[str],
                                      capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    with pytest.raises(SystemExit) as e:
        cli.main(["transcribe", str(wav), "-o", str(tmp_path / "o.jsonl"), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {extra[0]}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"] and loads == []


def test_unwritable_outputs_are_usage_errors(asr_cli, loads: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    (tmp_path / "plain").write_text("x")
    assert asr_cli.run(str(wav), "-o", str(tmp_path / "plain" / "out.jsonl")) == 2
    assert "Not a directory" in capsys.readouterr().err
    assert asr_cli.run(str(wav), "-o", "/proc/polyaccel-out.jsonl") == 2  # a folder nobody can create files in
    assert "cannot write next to it" in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o555)
        assert asr_cli.run(str(wav), "-o", str(locked / "out.jsonl")) == 2
        assert "Permission denied" in capsys.readouterr().err
    assert loads == [] and (tmp_path / "plain").read_text() == "x"
    with pytest.raises(SystemExit) as e:
        cli.main(["transcribe", str(wav), "-o", ""])
    assert e.value.code == 2 and "expected a file name" in capsys.readouterr().err


# ---- one file, two spellings; two runs, one output ---------------------------------------------------------


def test_the_same_file_by_relative_absolute_and_symlinked_paths_is_done_once(
        asr_cli, loads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "data").mkdir()
    asr_cli.wav(tmp_path / "data" / "a.wav")
    (tmp_path / "alias").symlink_to(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run("data/a.wav", "./data/../data/a.wav", "-o", str(out)) == 0
    assert "1 ok, 0 failed, 0 skipped" in capsys.readouterr().err
    assert asr_cli.run(str(tmp_path / "data" / "a.wav"), "-o", str(out)) == 0
    assert asr_cli.run(str(tmp_path / "alias" / "a.wav"), "-o", str(out)) == 0
    assert capsys.readouterr().err.count("0 ok, 0 failed, 1 skipped") == 2
    assert [r["path"] for r in asr_cli.results(out)] == ["data/a.wav"], "the user's spelling is kept"


def test_a_second_run_on_the_same_output_is_refused(asr_cli, loads: list[str], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    out = tmp_path / "out.jsonl"
    with OutputLock(out):
        assert asr_cli.run(str(wav), "-o", str(out)) == 2
        assert f"another run (pid {os.getpid()}) is writing {out}" in capsys.readouterr().err
    assert not out.exists() and loads == []
    (tmp_path / "out.jsonl.polyaccel-asr.lock").write_text("polyaccel-asr lock, pid 12345\n")  # left by a kill -9: not held
    assert asr_cli.run(str(wav), "-o", str(out)) == 0
    assert not (tmp_path / "out.jsonl.polyaccel-asr.lock").exists() and len(asr_cli.results(out)) == 1


@pytest.mark.timeout(120)
def test_two_processes_on_one_output(asr_cli, tmp_path: Path) -> None:
    """A real second process is refused while the first one is writing."""
    folder = tmp_path / "clips"
    folder.mkdir()
    for i in range(6):
        asr_cli.wav(folder / f"{i}.wav")
    out = tmp_path / "out.jsonl"
    script = tmp_path / "slow.py"
    release = tmp_path / "release"  # the first run holds its last files until the second is done
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        from polyaccel.asr import cli
        from polyaccel.asr.transcriber import Transcriber

        def slow(name="fake", *, batch_size=None, replicas=None, **kw):
            calls = []
            def recognize(batch):
                calls.append(1)
                deadline = time.monotonic() + 60
                while len(calls) > 1 and not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
                    time.sleep(0.05)
                return ["x" for _ in batch]
            return Transcriber(lambda i: recognize, sample_rate=16000, max_audio_seconds=30.0, replicas=1,
                               batch_size=batch_size or 8, model_name=name)
        Transcriber.from_pretrained = staticmethod(slow)
        sys.exit(cli.main(["transcribe", {str(folder)!r}, "-o", {str(out)!r}, "-q", "--batch-size", "1"]))
    """))
    first = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    try:
        while not out.exists():
            assert first.poll() is None, first.stderr.read()
        second = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert second.returncode == 2 and f"is writing {out}" in second.stderr
    finally:
        release.touch()
        assert first.wait(timeout=60) == 0
    assert len(asr_cli.results(out)) == 6


# ---- exit codes and the summary ------------------------------------------------------------------------------


def test_exit_codes(asr_cli, loads: list[str], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = str(asr_cli.wav(tmp_path / "good.wav"))
    bad = tmp_path / "bad.wav"
    bad.write_text("not audio")
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(str(bad), "-o", str(out)) == 3                     # nothing transcribed
    assert asr_cli.run(good, str(bad), "-o", str(out)) == 1               # some failed
    err = capsys.readouterr().err
    assert "1 ok, 1 failed, 0 skipped" in err and "1 file failed; rerun" in err
    assert asr_cli.run(good, "-o", str(out)) == 0                         # all done before
    assert "0 ok, 0 failed, 1 skipped" in capsys.readouterr().err
    asr_cli.wav(bad)
    assert asr_cli.run(good, str(bad), "-o", str(out)) == 0               # the failed one retried, now fine
    assert "1 ok, 0 failed, 1 skipped" in capsys.readouterr().err
    assert [r["error"] for r in asr_cli.results(out)] == [None, None]


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "user file"])
def test_a_lock_path_that_is_not_our_lock_file_is_left_alone(asr_cli, loads: list[str], tmp_path: Path,
                                                             kind: str,
                                                             capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    out = tmp_path / "out.jsonl"
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    lock = tmp_path / "out.jsonl.polyaccel-asr.lock"
    if kind == "symlink":
        lock.symlink_to(mine)
    elif kind == "dangling symlink":  # opening it to lock would create a file where it points
        lock.symlink_to(tmp_path / "elsewhere")
    else:
        lock.write_text("my other notes\n")
    assert asr_cli.run(str(wav), "-o", str(out)) == 2
    assert "not a lock file of ours" in capsys.readouterr().err
    assert mine.read_text() == "my notes\n" and os.path.lexists(lock) and not out.exists()
    assert not os.path.exists(tmp_path / "elsewhere")
    if kind == "user file":
        assert lock.read_text() == "my other notes\n"


def test_repairing_results_never_writes_through_a_file_named_like_its_temporary(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"path": "a.wav", "text": "a", "duration_s": 1.0, "error": null}\n{"path": "b.wa')  # torn
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    (tmp_path / "out.jsonl.tmp").symlink_to(mine)
    with ResultsWriter(out) as w:
        assert w.done == {"a.wav"}
    assert mine.read_text() == "my notes\n" and [r["path"] for r in load_results(out)] == ["a.wav"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "out.jsonl", "out.jsonl.tmp"]


def test_the_writer_appends_whole_lines_and_repairs_only_when_needed(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    with ResultsWriter(out) as w:
        w.write({"path": "a.wav", "text": "a", "duration_s": 1.0, "error": None})
    inode = out.stat().st_ino
    with ResultsWriter(out) as w:  # nothing to drop: appended in place
        w.write({"path": "b.wav", "text": "", "duration_s": 0.0, "error": "missing file"})
    assert out.stat().st_ino == inode
    with ResultsWriter(out) as w:  # the failed line is dropped: rewritten
        assert w.done == {"a.wav"}
    assert out.stat().st_ino != inode and [r["path"] for r in load_results(out)] == ["a.wav"]


# ---- -o -, hard-linked outputs, control characters in names ------------------------------------------


def test_dash_as_output_is_refused_not_a_file_named_dash(asr_cli, loads: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    wav = asr_cli.wav(tmp_path / "a.wav")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        asr_cli.run(str(wav), "-o", "-")
    assert e.value.code == 2 and "'-' (standard output) is not supported" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"] and loads == []
    assert "-o - is refused" in " ".join(cli.TRANSCRIBE_HELP.split())
    assert (asr_cli.run(str(wav), "-o", "./-") == 0
            and len(asr_cli.results(tmp_path / "-")) == 1)  # a file named '-' if spelt so


def test_a_hard_linked_output_is_refused(asr_cli, loads: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    """Two names of one results file would take two locks (the lock goes by name): refused."""
    wav = asr_cli.wav(tmp_path / "a.wav")
    out, other = tmp_path / "out.jsonl", tmp_path / "other.jsonl"
    assert asr_cli.run(str(tmp_path / "gone.wav"), str(wav), "-o", str(out)) == 1  # something left to retry
    before = out.read_bytes()
    os.link(out, other)
    with OutputLock(out):  # a run on out.jsonl is under way; the other name must not slip past it
        for name in (other, out):
            assert asr_cli.run(str(wav), "-o", str(name)) == 2
            assert f"-o {name}: has 2 hard links; a results file must have one name" in capsys.readouterr().err
    assert out.read_bytes() == before and os.path.samefile(out, other) and loads == [loads[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav", "other.jsonl", "out.jsonl"]
    other.unlink()
    assert asr_cli.run(str(wav), "-o", str(out)) == 0


def test_control_characters_in_names_are_escaped_on_stderr(asr_cli, loads: list[str], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A newline or ESC in a file name cannot start a fake line or reach the terminal; the
    results keep the exact name."""
    bad = tmp_path / "x\n2 ok, 0 failed\x1b[2J.wav"
    bad.write_bytes(b"not audio")
    good = asr_cli.wav(tmp_path / "ok\x07.wav")
    out = tmp_path / "out\n.jsonl"
    assert cli.main(["transcribe", str(bad), str(good), "-o", str(out)]) == 1  # not -q: failures listed
    err = capsys.readouterr().err
    assert "\x1b" not in err + caplog.text and "\x07" not in err
    assert f"{tmp_path}/x\\n2 ok, 0 failed\\x1b[2J.wav: not an audio file" in caplog.text  # the log warning
    assert f"  failed: {tmp_path}/x\\n2 ok, 0 failed\\x1b[2J.wav: " in err
    assert not any(ln.startswith("2 ok") for ln in err.splitlines()), "no fake summary line"
    assert [r["path"] for r in asr_cli.results(out)] == [str(bad), str(good)]
    assert asr_cli.run(str(tmp_path / "no\nsuch.wav"), "-o", str(out)) == 2  # usage errors too
    assert f"no such file or directory: {tmp_path}/no\\nsuch.wav\n" in capsys.readouterr().err

    # export and wer say names the same way
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(tmp_path / "t\x1bd")]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and f"  skipped {tmp_path}/x\\n2 ok, 0 failed\\x1b[2J.wav: it failed" in err
    assert f"1 written to {tmp_path}/t\\x1bd, 1 not\n" in err and (tmp_path / "t\x1bd" / "ok\x07.txt").exists()
    refs = tmp_path / "refs.jsonl"
    refs.write_text(json.dumps({"path": str(good), "text": "x"}) + "\n")
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(tmp_path / "h\x1b[31m.jsonl")]) == 2
    assert f"results file not found: {tmp_path}/h\\x1b[31m.jsonl\n" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["flag", "env"])
def test_ray_address_auto_is_a_usage_error_before_any_model_loads(asr_cli, tmp_path, capsys, monkeypatch,
                                                                  loads, where):
    """'auto' would join whatever cluster another local user advertises: refused with exit 2
    and a message naming --address, not a traceback, and nothing written."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    extra = ["--address", "auto"] if where == "flag" else []
    if where == "env":
        monkeypatch.setenv("RAY_ADDRESS", "auto")
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "--ray", *extra) == 2
    err = capsys.readouterr().err
    assert "--address" in err and "'auto'" in err and "Traceback" not in err
    assert not out.exists() and loads == []


def test_an_output_name_at_the_file_system_s_limit_gets_a_lock_that_fits(asr_cli, loads: list[str],
                                                                          tmp_path: Path) -> None:
    """A legal 251-byte -o has no room for ".polyaccel-asr.lock": its lock is its name cut short plus a hash,
    the same for a second run, which is refused while the first holds it."""
    from polyaccel.asr.results_file import OutputBusy, OutputLock

    wav = asr_cli.wav(tmp_path / "a.wav")
    out = tmp_path / ("r" * 245 + ".jsonl")
    assert asr_cli.run(str(wav), "-o", str(out)) == 0
    assert [r["path"] for r in asr_cli.results(out)] == [str(wav)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.wav", out.name])  # the lock went
    with OutputLock(out):
        assert len(OutputLock(out).path.name.encode()) <= 255
        with pytest.raises(OutputBusy):
            OutputLock(str(out)).acquire()
    assert OutputLock(tmp_path / "x.jsonl").path == tmp_path / "x.jsonl.polyaccel-asr.lock"
