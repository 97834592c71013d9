"""The formats users have: wav, flac, ogg/vorbis, ogg/opus and mp3 through libsndfile; m4a/AAC
(moov at the end and at the front), raw ADTS AAC and WebM/Opus through PyAV. Each is made here
(soundfile writes its own; PyAV encodes AAC and Opus, no ffmpeg binary needed), decoded to
16 kHz mono with the right length and pitch, streamed block by block to the same samples, and
broken (cut in half, garbage after a valid header, text) to see a short per-file error. Without
PyAV an m4a is one file's error naming what to install, and the libsndfile formats still decode."""

from __future__ import annotations

import fractions
import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import audio
from polyaccel.asr.audio import AudioError, audio_duration, load_audio, stream_audio

av = pytest.importorskip("av", reason="pip install -r requirements/dev.txt (PyAV)")

ROOT = Path(__file__).resolve().parents[2]
SR = 16000
FREQ = 440.0
SECONDS = 3.0


def _tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return (0.3 * np.sin(2 * np.pi * FREQ * t)).astype(np.float32)


def _pyav_write(path: Path, container: str, codec: str, rate: int, seconds: float, channels: int = 1,
                options: dict | None = None) -> Path:
    x = _tone(seconds, rate)
    layout = "mono" if channels == 1 else "stereo"
    with av.open(str(path), "w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        for i in range(0, len(x), 1024):
            chunk = np.ascontiguousarray(np.tile(x[i:i + 1024], (channels, 1)))
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            frame.rate, frame.pts, frame.time_base = rate, i, fractions.Fraction(1, rate)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return path


def _sf_write(path: Path, fmt: str, subtype: str | None, rate: int, seconds: float, channels: int = 1) -> Path:
    x = _tone(seconds, rate)
    sf.write(path, np.tile(x[:, None], (1, channels)), rate, format=fmt, subtype=subtype)
    return path


# name -> (maker(tmp_path, seconds), the library that must decode it, duration tolerance in s)
FORMATS = {
    "wav": (lambda d, s: _sf_write(d / "a.wav", "WAV", "PCM_16", 8000, s, 2), "soundfile", 1e-3),
    "flac": (lambda d, s: _sf_write(d / "a.flac", "FLAC", None, 22050, s), "soundfile", 1e-3),
    "ogg-vorbis": (lambda d, s: _sf_write(d / "a.ogg", "OGG", "VORBIS", 44100, s), "soundfile", 0.03),
    "ogg-opus": (lambda d, s: _sf_write(d / "a.opus", "OGG", "OPUS", 48000, s), "soundfile", 0.03),
    "mp3": (lambda d, s: _sf_write(d / "a.mp3", "MP3", "MPEG_LAYER_III", 44100, s, 2), "soundfile", 0.06),
    "m4a-aac": (lambda d, s: _pyav_write(d / "a.m4a", "mp4", "aac", 44100, s, 2), "av", 0.03),
    "m4a-aac-faststart": (lambda d, s: _pyav_write(d / "b.m4a", "mp4", "aac", 48000, s, 1,
                                                   {"movflags": "faststart"}), "av", 0.03),
    "adts-aac": (lambda d, s: _pyav_write(d / "a.aac", "adts", "aac", 22050, s), "av", 0.1),
    "webm-opus": (lambda d, s: _pyav_write(d / "a.webm", "webm", "libopus", 48000, s), "av", 0.03),
}


def _pitch(x: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spectrum)) * SR / len(x)


@pytest.fixture
def no_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)  # import av -> ImportError


@pytest.mark.parametrize("name", list(FORMATS))
def test_format_decodes_to_16k_mono_with_its_length_and_pitch(tmp_path: Path, name: str) -> None:
    make, library, tol = FORMATS[name]
    path = make(tmp_path, SECONDS)
    assert (audio._av_kind(path) is not None) == (library == "av")  # PyAV only for what libsndfile lacks
    y = load_audio(path)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) / SR - SECONDS) <= tol, len(y) / SR
    assert audio_duration(path) == pytest.approx(SECONDS, abs=max(tol, 0.08))
    assert abs(_pitch(y[SR // 2: -SR // 2]) - FREQ) < 3.0
    assert 0.15 < float(np.abs(y[SR // 2: -SR // 2]).max()) <= 0.4  # the tone's level, not silence or noise
    # streamed in small blocks: the same samples (bounded memory for long files)
    blocks = list(stream_audio(path, block_s=0.5))
    assert len(blocks) >= 4
    np.testing.assert_allclose(np.concatenate(blocks), y, atol=1e-6)


def _cut_in_half(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garbage_after_header(p: Path) -> None:
    head = p.read_bytes()[:64]
    p.write_bytes(head + np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tobytes())


def _text(p: Path) -> None:
    p.write_text("this is a shopping list, not audio\n" * 20)


@pytest.mark.parametrize("damage", [_cut_in_half, _garbage_after_header, _text], ids=["half", "garbage", "text"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_damaged_file_gives_a_short_per_file_error(tmp_path: Path, name: str, damage) -> None:
    path = FORMATS[name][0](tmp_path, SECONDS)
    damage(path)
    with pytest.raises(AudioError) as err:
        load_audio(path)
        list(stream_audio(path))
    message = str(err.value)
    assert len(message) < 140 and "\n" not in message
    if damage is _text:
        assert message == "not an audio file (looks like text)"
    else:
        assert re.match(r"(corrupt or truncated audio \(|truncated audio: (header declares|the Ogg stream has no end)|no audio stream)",
                        message), message


def test_truncated_webm_is_not_silently_half_transcribed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FFmpeg decodes a cut-off WebM without complaint; the duration in its header tells."""
    path = FORMATS["webm-opus"][0](tmp_path, SECONDS)
    _cut_in_half(path)
    with pytest.raises(AudioError, match=r"truncated audio: header declares 3.01 s, file holds 1.5\d s"):
        load_audio(path)
    # negative control: without the header check the half file passes as 1.5 s of audio
    monkeypatch.setattr(audio, "_AV_TRUNCATION_SLACK_S", 10.0)
    assert len(load_audio(path)) / SR == pytest.approx(1.5, abs=0.05)


def test_without_pyav_an_m4a_is_one_files_error_naming_what_to_install(tmp_path: Path, no_pyav: None) -> None:
    from polyaccel.asr.transcriber import Transcriber

    m4a = FORMATS["m4a-aac"][0](tmp_path, SECONDS)
    others = [FORMATS[n][0](tmp_path, SECONDS) for n in ("wav", "flac", "ogg-opus", "mp3")]
    with pytest.raises(AudioError, match=re.escape(f"pip install '{audio.AV_REQUIREMENT}'")):
        load_audio(m4a)
    with pytest.raises(AudioError, match="MP4/M4A .AAC. needs PyAV"):
        audio_duration(m4a)
    tr = Transcriber(lambda i: (lambda batch: ["tone"] * len(batch)), sample_rate=SR, replicas=1, batch_size=2)
    with tr:
        results = tr.transcribe([str(m4a), *map(str, others)])
    assert "needs PyAV" in results[0].error and audio.AV_REQUIREMENT in results[0].error
    assert [r.error for r in results[1:]] == [None] * 4  # libsndfile's formats never needed PyAV
    assert all(r.text == "tone" and r.duration_s == pytest.approx(SECONDS, abs=0.06) for r in results[1:])


def test_long_m4a_streams_through_the_transcriber(tmp_path: Path) -> None:
    """A 70 s m4a is read as a stream (three 30 s windows), not decoded whole."""
    from polyaccel.asr.transcriber import Transcriber

    path = _pyav_write(tmp_path / "long.m4a", "mp4", "aac", 44100, 70.0)
    seen: list[int] = []

    def recognize(batch: list[np.ndarray]) -> list[str]:
        seen.extend(len(a) for a in batch)
        return [" ".join(["w"] * 60)] * len(batch)  # 2 words/s: plausible, never re-decoded

    streamed: list[str] = []
    real = audio.stream_audio
    import polyaccel.asr.transcriber as transcriber

    def spy(p, *a, **k):
        streamed.append(str(p))
        return real(p, *a, **k)

    transcriber.stream_audio, saved = spy, transcriber.stream_audio
    try:
        with Transcriber(lambda i: recognize, sample_rate=SR, replicas=1, batch_size=2) as tr:
            (r,) = tr.transcribe([str(path)])
    finally:
        transcriber.stream_audio = saved
    assert r.error is None and r.windows == 3 and r.duration_s == pytest.approx(70.0, abs=0.03)
    assert streamed == [str(path)] and seen == [30 * SR] * 3


def test_directory_walk_finds_m4a_and_webm(tmp_path: Path) -> None:
    from polyaccel.asr.manifest import expand_inputs

    for n in ("m4a-aac", "webm-opus", "wav"):
        FORMATS[n][0](tmp_path, 0.5)
    names = sorted(Path(it.path).name for it in expand_inputs([str(tmp_path)]))
    assert names == ["a.m4a", "a.wav", "a.webm"]


def test_pyav_pin_is_the_same_everywhere() -> None:
    extra = tomllib.loads((ROOT / "packages/asr/pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra["formats"] == [audio.AV_REQUIREMENT]
    dev = [line.split("#")[0].strip() for line in (ROOT / "requirements/dev.txt").read_text().splitlines()]
    assert audio.AV_REQUIREMENT in dev
    assert av.__version__ == audio.AV_REQUIREMENT.split("==")[1]


def test_long_mp3_without_pyav_is_read_whole_not_garbled(tmp_path: Path, no_pyav: None) -> None:
    """libsndfile's MP3 reader garbles the samples after each partial read; without PyAV a
    streamed MP3 is therefore read in one piece (and says so), giving the exact samples."""
    rate = 44100
    t = np.arange(3 * rate) / rate
    chirp = (0.3 * np.sin(2 * np.pi * (200 * t + 300 * t * t))).astype(np.float32)  # no period to hide a slip
    path = tmp_path / "c.mp3"
    sf.write(path, chirp, rate, format="MP3")
    np.testing.assert_allclose(np.concatenate(list(stream_audio(path, block_s=0.5))), load_audio(path), atol=1e-6)
