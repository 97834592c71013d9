"""Inputs a careless user or an attacker hands ``polyaccel-asr``: cut-off copies of every format
whose header states its length, headers with absurd sample rates, reference and manifest files
saved with a byte-order mark, the wrong file given to ``wer --hyps``, paths holding a NUL, files
of many channels, FIFOs and devices, results files listing an input twice, and input names that
differ only in letter case. All use a fake recognizer or no model at all (fast, exact)."""

from __future__ import annotations

import base64
import json
import os
import struct
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import cli
from polyaccel.asr.audio import AudioError, audio_duration, load_audio, stream_audio
from polyaccel.asr.manifest import read_manifest, read_refs
from polyaccel.asr.transcriber import Transcriber

SR = 16000


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake model: its text is the sample count."""
    def fake_from_pretrained(name: str = "fake", *, batch_size: int = 8, replicas: int | None = None, **kw):
        return Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_from_pretrained))


def _tone(seconds: float, channels: int = 1) -> np.ndarray:
    x = (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * SR)) / SR)).astype(np.float32)
    return np.tile(x[:, None], (1, channels))


# ---- cut-off copies: every format whose header says how long it is ----------------------------------


@pytest.mark.parametrize("fmt,ext,subtype", [("WAV", "wav", "PCM_16"), ("RF64", "rf64", "PCM_16"),
                                             ("W64", "w64", "PCM_24"), ("AIFF", "aiff", "PCM_16"),
                                             ("AU", "au", "FLOAT"), ("NIST", "sph", "PCM_16")])
@pytest.mark.parametrize("channels", [1, 2])
def test_a_cut_off_copy_is_an_error_not_shorter_audio(tmp_path: Path, fmt: str, ext: str, subtype: str,
                                                     channels: int) -> None:
    """libsndfile reads a cut-off AIFF, AU, W64, RF64 or SPHERE file as the part that is there:
    half a recording would be transcribed as if it were all of it."""
    whole = tmp_path / f"whole.{ext}"
    sf.write(whole, _tone(3.0, channels), SR, format=fmt, subtype=subtype)
    assert len(load_audio(whole)) == 3 * SR  # the complete file passes, every sample
    cut = tmp_path / f"cut.{ext}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size * 6 // 10])
    for read in (load_audio, lambda p: list(stream_audio(p, block_s=0.5))):
        with pytest.raises(AudioError, match=r"truncated audio: header declares 3.00 s, file holds 1.\d+ s"):
            read(cut)



@pytest.mark.parametrize("marker", [0xFFFFFFFF, 0x7FFFFFFF, 0x7FFFF000])
def test_a_streaming_writer_s_unknown_length_is_not_a_truncation(tmp_path: Path, marker: int) -> None:
    """ffmpeg (0xffffffff) and SoX (0x7ffff000) writing to a pipe cannot go back to fill in the
    data size, and leave their "unknown length" marker there: the file is read to its end."""
    good = tmp_path / "good.wav"
    sf.write(good, _tone(3.0, 1), SR, subtype="PCM_16")
    b = bytearray(good.read_bytes())
    i = b.find(b"data")
    b[i + 4:i + 8] = struct.pack("<I", marker)
    piped = tmp_path / "piped.wav"
    piped.write_bytes(bytes(b))
    assert len(load_audio(piped)) == 3 * SR


def test_a_file_a_few_samples_short_says_how_many(tmp_path: Path) -> None:
    """Seconds to two places would read "declares 2.99 s, file holds 2.99 s"."""
    whole = tmp_path / "whole.wav"
    sf.write(whole, _tone(3.0, 1), SR, subtype="PCM_16")
    cut = tmp_path / "cut.wav"
    cut.write_bytes(whole.read_bytes()[:-2])
    with pytest.raises(AudioError, match=r"truncated audio: header declares 48000 samples, file holds 47999$"):
        load_audio(cut)

# ---- absurd sample rates --------------------------------------------------------------------------------


def _wav_header(rate: int, frames: int) -> bytes:
    data = 2 * frames
    return (b"RIFF" + struct.pack("<I", 36 + data) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, (2 * rate) & 0xFFFFFFFF, 2, 16)
            + b"data" + struct.pack("<I", data))


def test_a_header_rate_of_100_mhz_is_refused_before_decoding(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 200 MB file "at 100 MHz" says it is 1 s long, so it would be decoded whole (800 MB) instead
    of streamed: the header decides nothing before its rate is checked."""
    p = tmp_path / "fast.wav"
    frames = 400_000
    p.write_bytes(_wav_header(100_000_000, frames) + bytes(2 * frames))
    assert sf.info(p).samplerate == 100_000_000

    def no_decoding(*a, **k):
        raise AssertionError("decoded a file whose rate is implausible")

    monkeypatch.setattr(sf, "read", no_decoding)
    for read in (audio_duration, load_audio, lambda q: list(stream_audio(q))):
        with pytest.raises(AudioError, match=r"implausible sample rate \(100000000 Hz"):
            read(p)
    monkeypatch.undo()
    ok = tmp_path / "hi-res.wav"
    sf.write(ok, np.zeros(768_000 // 10, np.float32), 768_000)  # the fastest real interfaces still pass
    assert len(load_audio(ok)) == SR // 10


# ---- files saved by other programs ------------------------------------------------------------------------


def test_reference_and_manifest_files_with_a_byte_order_mark(tmp_path: Path) -> None:
    """Notepad and Excel start UTF-8 files with a BOM: the first reference must not become
    '\\ufeff<s> hello world' (a wrong WER), nor a JSONL file be refused."""
    sphinx = tmp_path / "transcription"
    sphinx.write_text("<s> hello world </s> (a)\n<s> good day </s> (b)\n", encoding="utf-8-sig")
    assert read_refs(sphinx) == {"a": "hello world", "b": "good day"}
    jsonl = tmp_path / "refs.jsonl"
    jsonl.write_text('{"id": "a", "text": "hello"}\n', encoding="utf-8-sig")
    assert read_refs(jsonl) == {"a": "hello"}
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"audio_filepath": "a.wav", "text": "hello"}\n', encoding="utf-8-sig")
    [item] = read_manifest(manifest)
    assert (item.path, item.ref) == (str(tmp_path / "a.wav"), "hello")


def test_wer_refuses_hyps_that_are_not_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`wer --refs refs.jsonl --hyps refs.jsonl` (or a manifest as --hyps) scored the references
    against themselves: WER 0, exit 0."""
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "hello world"}\n{"path": "b.wav", "text": "good day"}\n')
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(refs)]) == 2
    assert "is not a polyaccel-asr results file (line 1 is not a results record)" in capsys.readouterr().err
    hyps = tmp_path / "out.jsonl"
    hyps.write_text("".join(json.dumps({"path": p, "text": t, "duration_s": 1.0, "error": None}) + "\n"
                            for p, t in (("a.wav", "hello world"), ("b.wav", "good"))))
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(hyps)]) == 0
    assert json.loads(capsys.readouterr().out)["deletions"] == 1


# ---- NUL in a path ------------------------------------------------------------------------------------------


def test_a_nul_in_a_manifest_or_results_path_is_a_usage_error(fake: None, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    """No file name holds a NUL; a manifest or results line with one crashed with a traceback."""
    sf.write(tmp_path / "a.wav", _tone(0.1), SR)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": "a\x00.wav"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 2
    assert "bad manifest" in capsys.readouterr().err and not out.exists()
    for extra in ({"path": "x\x00y.wav"}, {"path": "xy.wav", "path_bytes": base64.b64encode(b"x\0y.wav").decode()}):
        res = tmp_path / "res.jsonl"
        res.write_text(json.dumps({"path": "", "text": "t", "duration_s": 1.0, "error": None, **extra}) + "\n")
        before = res.read_bytes()
        assert cli.main(["export", str(res), "-f", "txt", "-d", str(tmp_path / "subs")]) == 2
        assert "not a polyaccel-asr results file" in capsys.readouterr().err
        assert cli.main(["transcribe", str(tmp_path / "a.wav"), "-o", str(res), "-q"]) == 2
        assert "not a polyaccel-asr results file" in capsys.readouterr().err
        assert res.read_bytes() == before
        assert cli.main(["wer", "--refs", str(manifest), "--hyps", str(res)]) == 2


def test_a_lone_surrogate_in_a_manifest_or_results_path_is_a_usage_error(fake: None, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    """A ``\\ud800`` escape in a JSON path stands for no byte, so no file has that name (``\\udc80``
    to ``\\udcff`` are a non-UTF-8 name's bytes and stay file names): a manifest line with one
    crashed the run with a UnicodeEncodeError traceback, a results line with one crashed export."""
    sf.write(tmp_path / "a.wav", _tone(0.1), SR)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"audio_filepath": "a\ud800.wav"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "bad manifest" in err and "lone surrogate" in err and not out.exists()
    res = tmp_path / "res.jsonl"
    res.write_text(json.dumps({"path": "x\ud800y.wav", "text": "t", "duration_s": 1.0, "error": None}) + "\n")
    assert cli.main(["export", str(res), "-f", "txt", "-d", str(tmp_path / "subs")]) == 2
    assert "not a polyaccel-asr results file" in capsys.readouterr().err
    manifest.write_text(json.dumps({"audio_filepath": "a\udce9.wav"}) + "\n")  # the byte 0xe9: a file name
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 3  # missing file: its own error
    assert [r["error"] for r in (json.loads(x) for x in out.read_text().splitlines())] == ["missing file"]


def test_an_input_whose_name_is_too_long_is_that_inputs_error_not_the_runs(fake: None, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """A name longer than the file system allows (ENAMETOOLONG) beside a good input stopped the
    whole run before anything was transcribed ("cannot read ...: File name too long", exit 2);
    it is that input's error, and the good one is transcribed."""
    sf.write(tmp_path / "a.wav", _tone(0.1), SR)
    long_name = str(tmp_path / ("x" * 300 + ".wav"))
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(tmp_path / "a.wav"), long_name, "-o", str(out), "-q"]) == 1
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["path"], r["error"]) for r in recs] == [(str(tmp_path / "a.wav"), None),
                                                       (long_name, "cannot read it: File name too long")]


# ---- many channels ----------------------------------------------------------------------------------------


def test_a_file_of_many_channels_is_read_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """libsndfile allows 1024 channels: a file shorter than one window was decoded whole (frames
    x channels of float32, twice over) and streamed 10 s x channels at a time, so memory grew
    with the channel count. Budgets are made small here instead of writing a GB file; the
    transcript and samples stay those of the whole-file read."""
    from polyaccel.asr import audio
    from polyaccel.asr import transcriber as transcriber_mod

    channels, seconds = 32, 12.0
    t = np.arange(int(seconds * SR)) / SR
    wide = np.stack([0.5 * np.sin(2 * np.pi * (200 + 40 * c) * t) for c in range(channels)], axis=1)
    p = tmp_path / "wide.wav"
    sf.write(p, wide.astype(np.float32), SR, subtype="PCM_16")  # 24.6 MB of float32 decoded whole
    tr = Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR)
    whole, [expected] = load_audio(p), tr.transcribe([str(p)])

    monkeypatch.setattr(transcriber_mod, "MAX_WHOLE_BYTES", 1 << 20)
    monkeypatch.setattr(audio, "STREAM_BLOCK_SAMPLES", 1 << 16)
    reads: list[int] = []
    read = sf.SoundFile.read
    monkeypatch.setattr(sf.SoundFile, "read", lambda f, *a, **k: reads.append((out := read(f, *a, **k)).size) or out)
    monkeypatch.setattr(sf, "read", lambda *a, **k: pytest.fail("decoded a wide file whole"))
    tracemalloc.start()
    try:
        [got] = tr.transcribe([str(p)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (got.text, got.windows, got.error) == (expected.text, expected.windows, None)
    assert got.duration_s == pytest.approx(seconds)
    assert max(reads) <= 1 << 16 and peak < 8 << 20, (max(reads), peak)
    np.testing.assert_array_equal(np.concatenate(list(stream_audio(p))), whole)


# ---- inputs that are not regular files ----------------------------------------------------------------------


def _finishes(fn, timeout_s: float = 10.0) -> None:
    """Run ``fn`` on a daemon thread; fail (instead of hanging) if it blocks, as opening a FIFO does."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            err.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), "blocked: the FIFO was opened"
    if err:
        raise err[0]


def test_a_fifo_or_a_device_is_not_a_regular_file_and_is_never_opened(fake: None, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    """A FIFO or /dev/null was reported as "empty file (0 bytes)"; opening a FIFO to read it
    would wait for a writer forever."""
    fifo = tmp_path / "live.wav"
    os.mkfifo(fifo)
    for p, kind in ((fifo, "a FIFO"), (Path("/dev/null"), "a character device")):
        for read in (audio_duration, load_audio, lambda q: list(stream_audio(q))):
            with pytest.raises(AudioError, match=rf"^not a regular file \({kind}\)$"):
                _finishes(lambda: read(p))  # noqa: B023 (called at once)
    out, status = tmp_path / "out.jsonl", []
    _finishes(lambda: status.append(cli.main(["transcribe", str(fifo), "-o", str(out)])))
    [rec] = [json.loads(line) for line in out.read_text().splitlines()]
    assert (status, rec["error"]) == ([3], "not a regular file (a FIFO)")
    assert f"failed: {fifo}: not a regular file (a FIFO)" in capsys.readouterr().err


# ---- wer and export: one line per input -----------------------------------------------------------------


def _results_file(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"duration_s": 1.0, "error": None, **r}) + "\n" for r in records))
    return path


def test_wer_counts_an_input_listed_twice_once(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Two results files concatenated list every input twice: wer scored each twice (and a
    failed line before the good one as a failure), where export keeps one line per input."""
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "hello world"}\n{"path": "b.wav", "text": "good day"}\n')
    first = [{"path": "a.wav", "text": "hello world"}, {"path": "b.wav", "text": "", "error": "boom"}]
    second = [{"path": "a.wav", "text": "hello world"}, {"path": "b.wav", "text": "good"}]
    hyps = _results_file(tmp_path / "out.jsonl", first + second)
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(hyps)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["files"], got["ref_words"], got["deletions"], got["failed"]) == (2, 4, 1, 0)


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_export_names_differing_only_in_case_do_not_collide(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                            overwrite: list[str]) -> None:
    """On a case-insensitive file system A.txt and a.txt are one file: the second input was
    "exists", or with --overwrite replaced the first one's file."""
    res = _results_file(tmp_path / "out.jsonl", [{"path": "x/A.wav", "text": "upper"},
                                                 {"path": "y/a.wav", "text": "lower"}])
    subs = tmp_path / "subs"
    assert cli.main(["export", str(res), "-f", "txt", "-d", str(subs), *overwrite]) == 0
    assert sorted(f.name for f in subs.iterdir()) == ["A.txt", "a-2.txt"]
    assert ((subs / "A.txt").read_text(), (subs / "a-2.txt").read_text()) == ("upper\n", "lower\n")
    assert "y/a.wav -> " in capsys.readouterr().err
