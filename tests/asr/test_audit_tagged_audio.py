"""Audit (2026-12-04, session 31): audio whose tags are not UTF-8 (ID3v1 is Latin-1 by definition,
old taggers wrote Latin-1 into MP4 and Matroska tags) is still audio."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import audio

av = pytest.importorskip("av", reason="pip install -r requirements/dev.txt (PyAV)")


def _id3v1(title: bytes, artist: bytes) -> bytes:
    """An ID3v1 tag (128 bytes at the end of an MP3): fixed fields, Latin-1."""
    return (b"TAG" + title.ljust(30, b"\0") + artist.ljust(30, b"\0") + b"\0" * 30 + b"1999"
            + b"\0" * 30 + b"\x0c")


def _one_silent_second(path: Path, container: str, codec: str, rate: int, title: str | None = None) -> Path:
    """One second of mono silence encoded with ``codec`` into ``container`` through PyAV."""
    with av.open(str(path), "w", format=container) as out:
        if title is not None:
            out.metadata["title"] = title
        s = out.add_stream(codec, rate=rate)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, rate), np.float32), format="fltp", layout="mono")
        frame.sample_rate = rate
        for packet in [*s.encode(frame), *s.encode(None)]:
            out.mux(packet)
    return path


def test_long_mp3_with_a_latin1_id3v1_tag_is_transcribed(tmp_path: Path) -> None:
    """An MP3 longer than one window (streamed through PyAV) with ``Beyonc\\xe9`` in its ID3v1
    tag was "could not read: UnicodeDecodeError" (PyAV decodes tags strictly as UTF-8)."""
    mp3 = tmp_path / "talk.mp3"
    rate = 16000
    sf.write(mp3, (0.3 * np.sin(2 * np.pi * 440 * np.arange(31 * rate) / rate)).astype(np.float32), rate,
             format="MP3")
    with mp3.open("ab") as f:
        f.write(_id3v1(b"Caf\xe9", b"Beyonc\xe9"))
    seconds, _ = audio.audio_extent(mp3)
    assert seconds == pytest.approx(31, abs=0.1)
    assert sum(len(b) for b in audio.stream_audio(mp3)) == pytest.approx(31 * rate, abs=0.1 * rate)


def test_m4a_with_a_latin1_title_is_read(tmp_path: Path) -> None:
    m4a = _one_silent_second(tmp_path / "song.m4a", "mp4", "aac", 16000, title="CafeQQ")
    m4a.write_bytes(m4a.read_bytes().replace(b"CafeQQ", b"Caf\xe9QQ"))
    assert len(audio.load_audio(m4a)) == pytest.approx(16000, abs=2048)


def test_webm_with_a_codec_ffmpeg_does_not_know_is_a_clear_error(tmp_path: Path) -> None:
    """Was "could not read: AttributeError: 'NoneType' object has no attribute 'sample_rate'"."""
    webm = _one_silent_second(tmp_path / "clip.webm", "webm", "libopus", 48000)
    webm.write_bytes(webm.read_bytes().replace(b"A_OPUS", b"A_QQQQ"))
    with pytest.raises(audio.AudioError, match="unsupported audio codec"):
        audio.audio_extent(webm)
