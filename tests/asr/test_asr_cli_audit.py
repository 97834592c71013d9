"""``polyaccel-asr`` used carelessly (audit of issue 10's follow-ups): resuming a results file
made by another model or with other settings, segment times past the end of the audio,
inputs that cannot be read, ``export --overwrite`` over a recording, arrows in SRT text.
All with fake recognizers: no model is loaded."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr import cli
from polyaccel.asr.decoding import Segment
from polyaccel.asr.export import to_srt
from polyaccel.asr.timestamps import TimedText
from polyaccel.asr.transcriber import Transcriber

SR = 16000


def _fake(monkeypatch: pytest.MonkeyPatch, name: str, sha: str | None) -> None:
    """``from_pretrained`` gives a recognizer (its text: the sample count) named ``name`` whose
    weights hash to ``sha``."""
    def from_pretrained(path_or_name: str = "fake", *, batch_size: int | None = None, **kw):
        tr = Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                         replicas=1, batch_size=batch_size or 8, model_name=name)
        tr.weights_sha256 = sha
        return tr
    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(from_pretrained))
    from polyaccel.asr import weights  # what a rerun with nothing left to do checks the file against

    monkeypatch.setattr(weights, "model_provenance", lambda path_or_name, **kw: {"model": name, "weights_sha256": sha})


# ---- a resume never mixes two models (or settings) in one results file ------------------------------


def _transcribed_by_tiny(asr_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """clips/a.wav transcribed into out.jsonl by a fake whisper-tiny.en (weights "aa" * 32)."""
    clips = tmp_path / "clips"
    clips.mkdir()
    asr_cli.wav(clips / "a.wav")
    out = tmp_path / "out.jsonl"
    _fake(monkeypatch, "whisper-tiny.en", "aa" * 32)
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q"]) == 0
    return clips, out


def test_resume_refuses_results_of_another_model_or_with_other_timestamps(asr_cli, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture) -> None:
    clips, out = _transcribed_by_tiny(asr_cli, tmp_path, monkeypatch)
    asr_cli.wav(clips / "b.wav")  # a new file: the rerun has something to do
    before = out.read_bytes()
    _fake(monkeypatch, "whisper-base", "bb" * 32)
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q", "--model", "whisper-base"]) == 2
    err = capsys.readouterr().err
    assert "holds results made another way" in err and "model whisper-tiny.en" in err and "--overwrite" in err
    assert out.read_bytes() == before, "nothing written: b.wav by base next to a.wav by tiny.en"
    _fake(monkeypatch, "whisper-tiny.en", "aa" * 32)
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q", "--timestamps"]) == 2
    assert "no timestamps; this run: model whisper-tiny.en (weights aaaaaaaaaaaa), timestamps" in capsys.readouterr().err
    assert out.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["clips", "out.jsonl"]
    # the same weights under another name (the model folder moved) resume; --overwrite starts afresh
    _fake(monkeypatch, "/new/place/whisper-tiny.en", "aa" * 32)
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q"]) == 0
    assert [json.loads(x)["path"] for x in out.read_text().splitlines()] == [str(clips / "a.wav"), str(clips / "b.wav")]
    _fake(monkeypatch, "whisper-base", "bb" * 32)
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q", "--overwrite"]) == 0
    assert {json.loads(x)["model"] for x in out.read_text().splitlines()} == {"whisper-base"}


def test_a_rerun_with_nothing_left_still_refuses_results_made_another_way(asr_cli, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    """Every input already in -o: a rerun with another model or with --timestamps must not say
    "nothing to do" (exit 0) over records it would not make; it refuses (exit 2) without
    loading a model, and the same command is still "nothing to do"."""
    from polyaccel.asr import weights

    clips, out = _transcribed_by_tiny(asr_cli, tmp_path, monkeypatch)
    before = out.read_bytes()
    sha = {"whisper-tiny.en": "aa" * 32, "whisper-base": "bb" * 32}
    monkeypatch.setattr(weights, "model_provenance", lambda name, **kw: {"model": name, "weights_sha256": sha[name]})
    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(lambda *a, **k: pytest.fail("a model loaded")))
    for extra, said in ((["--model", "whisper-base"], "model whisper-tiny.en (weights aaaaaaaaaaaa), no timestamps; "
                                                      "this run: model whisper-base"),
                        (["--timestamps"], "this run: model whisper-tiny.en (weights aaaaaaaaaaaa), timestamps")):
        assert cli.main(["transcribe", str(clips), "-o", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert "holds results made another way" in err and said in err and "nothing to do" not in err, err
    assert cli.main(["transcribe", str(clips), "-o", str(out)]) == 0
    assert "nothing to do: all 1 file are already in" in capsys.readouterr().err
    assert out.read_bytes() == before


# ---- segment times lie within the audio -------------------------------------------------------------


def test_segments_never_end_past_the_audio() -> None:
    """Whisper may put a window's last timestamp past the audio's end (tiny.en: 3.00 s in the
    2.99 s LibriVox clip 0880); each segment is kept within its window, so within the file."""
    def recognize(batch: list[np.ndarray]) -> list[TimedText]:  # every window "ends" at 30 s
        return [TimedText("word", [Segment(0.0, 1.0, "word"), Segment(1.0, 30.0, "more")]) for _ in batch]

    with Transcriber(lambda i: recognize, sample_rate=SR, max_audio_seconds=30.0, replicas=1, batch_size=4) as tr:
        short, long = tr.transcribe([np.full(int(SR * 2.99), 0.1, np.float32),
                                     np.full(int(SR * 45.5), 0.1, np.float32)])
    for r in (short, long):
        assert r.ok and r.segments
        assert all(0 <= s["start"] <= s["end"] <= r.duration_s for s in r.segments), (r.duration_s, r.segments)
    assert short.segments[-1]["end"] == 2.99


# ---- inputs that cannot be read: a usage error naming them, never a traceback, never skipped ---------


def test_an_unreadable_manifest_reference_file_or_folder_is_a_usage_error(asr_cli, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """(Tests run as root here, where chmod 000 does not stop a read: the denial is simulated.)"""
    _fake(monkeypatch, "fake", None)
    wav = asr_cli.wav(tmp_path / "a.wav")
    (tmp_path / "clips" / "private").mkdir(parents=True)
    asr_cli.wav(tmp_path / "clips" / "ok.wav")
    asr_cli.wav(tmp_path / "clips" / "private" / "x.wav")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": str(wav)}) + "\n")
    refs = tmp_path / "refs.txt"
    refs.write_text("<s> hi </s> (a)\n")
    denied = {str(manifest), str(refs), str(tmp_path / "clips" / "private")}
    read_text, read_bytes, scandir = Path.read_text, Path.read_bytes, os.scandir

    def deny(path: object) -> None:
        if os.fspath(path) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: deny(self) or read_text(self, *a, **k))
    monkeypatch.setattr(Path, "read_bytes", lambda self: deny(self) or read_bytes(self))
    monkeypatch.setattr(os, "scandir", lambda path=".": deny(path) or scandir(path))
    out = tmp_path / "out.jsonl"
    for argv, what in [([str(manifest)], manifest), ([str(wav), "--refs", str(refs)], refs),
                       ([str(tmp_path / "clips")], tmp_path / "clips" / "private")]:
        assert cli.main(["transcribe", *argv, "-o", str(out), "-q"]) == 2, argv
        assert f"error: cannot read {what}: Permission denied" in capsys.readouterr().err
        assert not out.exists()
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(manifest)]) == 2
    assert f"error: cannot read {refs}: Permission denied" in capsys.readouterr().err


# ---- export ----------------------------------------------------------------------------------------


def test_export_overwrite_never_replaces_a_transcribed_input(asr_cli, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    """A recording named ``talk.txt`` (WAV inside) exports to ``talk.txt`` next to it: even with
    --overwrite it is never replaced by its own transcript."""
    _fake(monkeypatch, "fake", None)
    talk = asr_cli.wav(tmp_path / "talk.txt")
    audio = talk.read_bytes()
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(talk), "-o", str(out), "-q"]) == 0
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(tmp_path), "--overwrite", "-q"]) == 3
    assert "is an input that was transcribed; never replaced" in capsys.readouterr().err
    assert talk.read_bytes() == audio
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(tmp_path / "subs"), "--overwrite", "-q"]) == 0
    assert (tmp_path / "subs" / "talk.txt").read_text() == "1600 samples\n"


def test_export_overwrite_from_another_directory_still_never_replaces_the_audio(
        asr_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The record holds the relative path ``talk.txt`` and the folder its run was in, so export
    run from another folder still knows the WAV in -d for an input; a record from before runs
    kept their folder finds no such input there, yet the WAV is not text, so --overwrite leaves
    it. An earlier export's text file there is replaced."""
    _fake(monkeypatch, "fake", None)
    data, elsewhere = tmp_path / "data", tmp_path / "home"
    data.mkdir()
    elsewhere.mkdir()
    talk = asr_cli.wav(data / "talk.txt")
    audio = talk.read_bytes()
    (data / "other.wav").write_bytes(audio)
    monkeypatch.chdir(data)
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", "talk.txt", "other.wav", "-o", str(out), "-q"]) == 0
    (data / "other.txt").write_text("an earlier export\n")
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(data), "--overwrite", "-q"]) == 1
    assert "talk.txt is an input that was transcribed; never replaced" in capsys.readouterr().err
    assert talk.read_bytes() == audio and (data / "other.txt").read_text() == "1600 samples\n"
    legacy = [json.loads(line) for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "cwd"}) + "\n" for r in legacy))
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(data), "--overwrite", "-q"]) == 1
    assert "does not hold text (audio?); never replaced" in capsys.readouterr().err
    assert talk.read_bytes() == audio


def test_srt_cue_text_never_holds_a_time_arrow() -> None:
    """SRT has no escapes, and readers that find a cue's times by its ``-->`` would take a text
    line holding one for the next cue's times; VTT escapes ``>`` already."""
    srt = to_srt([{"start": 0, "end": 1, "text": "a ---> b 00:00:05,000 --> 00:00:09,000 c"},
                  {"start": 1, "end": 2, "text": "next"}])
    lines = srt.splitlines()
    assert [x for x in lines if "-->" in x] == ["00:00:00,000 --> 00:00:01,000", "00:00:01,000 --> 00:00:02,000"]
    assert lines[2] == "a -> b 00:00:05,000 -> 00:00:09,000 c"


def test_export_rerun_is_up_to_date_and_a_run_that_writes_nothing_leaves_no_folder(
        asr_cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``transcribe ... && export ...`` run twice: the second export finds its own files and
    succeeds (exit 0); an export that writes nothing (no timestamps for srt) leaves no new
    empty folder behind."""
    _fake(monkeypatch, "fake", None)
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")),
                     str(asr_cli.wav(tmp_path / "b.wav", 0.2)), "-o", str(out), "-q"]) == 0
    subs = tmp_path / "subs"
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(subs)]) == 0
    capsys.readouterr()
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(subs)]) == 0
    assert f"0 written to {subs}, 2 already up to date, 0 not" in capsys.readouterr().err
    (subs / "b.txt").write_text("edited by hand\n")
    assert cli.main(["export", str(out), "-f", "txt", "-d", str(subs), "-q"]) == 1
    assert "exists with other content" in capsys.readouterr().err
    assert (subs / "b.txt").read_text() == "edited by hand\n"
    deep = tmp_path / "new" / "srt"
    assert cli.main(["export", str(out), "-f", "srt", "-d", str(deep), "-q"]) == 3  # no segments
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("fmt", ["txt", "srt", "vtt"])
def test_export_of_text_holding_a_lone_surrogate_writes_every_file(tmp_path: Path, fmt: str,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """A results line whose text holds a ``\\udXXX`` escape (a lone surrogate, which a results file
    can hold: its writer escapes them) stopped export with a UnicodeEncodeError traceback, the
    other inputs not exported. It is written as U+FFFD and the rest go on."""
    seg = [{"start": 0.0, "end": 1.0, "text": "hi \udc80"}]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"path": f"{n}.wav", "text": t, "duration_s": 1.0, "error": None,
                                       "segments": seg}) + "\n" for n, t in (("a", "hi \ud800"), ("b", "fine"))))
    subs = tmp_path / "subs"
    assert cli.main(["export", str(out), "-f", fmt, "-d", str(subs), "-q"]) == 0
    assert "hi \ufffd" in (subs / f"a.{fmt}").read_text(encoding="utf-8")
    assert (subs / f"b.{fmt}").is_file()
    assert cli.main(["export", str(out), "-f", fmt, "-d", str(subs), "-q"]) == 0  # a rerun: up to date
