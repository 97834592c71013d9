"""Inputs a careless user or an attacker hands ``polyaccel-asr``: cut-off copies of every format
whose header states its length, headers with absurd sample rates, reference and manifest files
saved with a byte-order mark, the wrong file given to ``wer --hyps``, and paths holding a NUL.
All use a fake recognizer or no model at all (fast, exact)."""

from __future__ import annotations

import base64
import json
import struct
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
