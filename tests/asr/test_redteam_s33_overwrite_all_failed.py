"""``transcribe --overwrite`` that transcribes nothing keeps the earlier results. The file was
emptied when the first result arrived, a failed one included: rerunning a finished job with
``--overwrite`` when every input now fails (the audio folder's network mount gone stale, a
manifest read from another machine, m4a files where PyAV is missing) replaced thousands of
transcripts with error lines. The earlier file is now replaced only once a file is
transcribed; a run in which every file fails leaves it as it was, names the failures from
memory and says so (exit 3, as before)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.asr import cli
from polyaccel.asr.transcriber import Transcriber

SR = 16000


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recognizer whose text is the sample count (fast, exact)."""
    def from_pretrained(name: str = "fake", *, batch_size: int = 8, replicas: int | None = None, **kw):
        return Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(from_pretrained))
    from polyaccel.asr import weights

    monkeypatch.setattr(weights, "model_provenance", lambda name, **kw: {"model": name, "weights_sha256": None})


def _manifest(path: Path, audio: list[Path]) -> Path:
    path.write_text("".join(json.dumps({"audio_filepath": str(a), "text": "x"}) + "\n" for a in audio))
    return path


def test_overwrite_where_every_file_fails_keeps_the_earlier_results(asr_cli, fake_model: None, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    clips = [asr_cli.wav(tmp_path / f"{i}.wav") for i in range(3)]
    out = tmp_path / "out.jsonl"
    manifest = _manifest(tmp_path / "m.jsonl", clips)
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 0
    before = out.read_bytes()
    for clip in clips:  # the same paths, now unreadable as audio
        clip.write_bytes(b"not audio at all")
    capsys.readouterr()
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "--overwrite"]) == 3
    err = capsys.readouterr().err
    assert out.read_bytes() == before
    assert err.count("  failed: ") == 3 and f"{tmp_path / '0.wav'}: " in err
    assert "left as it was" in err and "--overwrite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.wav", "1.wav", "2.wav", "m.jsonl", "out.jsonl"]


def test_overwrite_replaces_the_file_once_a_file_is_transcribed(asr_cli, fake_model: None, tmp_path: Path) -> None:
    clips = [asr_cli.wav(tmp_path / f"{i}.wav") for i in range(3)]
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", *map(str, clips), "-o", str(out), "-q"]) == 0
    clips[0].write_bytes(b"not audio at all")  # failed first, then two files transcribed
    assert cli.main(["transcribe", *map(str, clips), "-o", str(out), "-q", "--overwrite"]) == 1
    recs = asr_cli.results(out)
    assert [r["path"] for r in recs] == [str(c) for c in clips]
    assert [r["error"] is None for r in recs] == [False, True, True]


def test_a_new_file_still_gets_the_failures(asr_cli, fake_model: None, tmp_path: Path) -> None:
    bad = tmp_path / "a.wav"
    bad.write_bytes(b"not audio at all")
    out = tmp_path / "out.jsonl"
    for extra in ([], ["--overwrite"]):
        out.unlink(missing_ok=True)
        assert cli.main(["transcribe", str(bad), "-o", str(out), "-q", *extra]) == 3
        assert [r["path"] for r in asr_cli.results(out)] == [str(bad)]
