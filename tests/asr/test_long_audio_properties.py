"""Long audio, property style, with a fake recognizer (no model): random lengths (0.1 s .. 20
min), overlaps (0 .. half a window, where ``window_bounds`` caps it), input and model sample
rates. Every word of the audio comes out exactly once, in order; segments are absolute,
non-decreasing and inside the file; SRT/VTT of them are well-formed; a file streamed from disk
gives what the same samples give as an array.

The signal: word ``k`` is a 0.4 s plateau at a level that encodes ``k``, in its own 0.5 s block
(0.1 s of silence after it: a pause). The fake recognizer reads a window's plateaus back; a
plateau cut by the window's edge is heard if more than half of it is inside (at the start:
half or more, so exactly one of two windows that share no audio hears it). Word sequences
never repeat (the stitcher's documented limitation), and no word is 2 characters or fewer.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr.decoding import Segment
from polyaccel.asr.export import to_srt, to_vtt
from polyaccel.asr.timestamps import TimedText
from polyaccel.asr.transcriber import Transcriber

BLOCK_S, TONE_S = 0.5, 0.4
MAX_WORDS = 2500  # 20 min of 2 words/s, with room
WINDOW_S = 30.0
Gaps = tuple[range, ...]


def _level(k: np.ndarray | int) -> np.ndarray | float:
    return 0.1 + 0.8 * np.asarray(k) / MAX_WORDS


def _word(k: int) -> str:
    return f"word{k}"


def _signal(seconds: float, rate: int, gaps: Gaps = ()) -> np.ndarray:
    """Word ``k`` as a 0.4 s plateau at ``_level(k)`` from ``0.5 k`` s, then 0.1 s of silence;
    the words of ``gaps`` (``range``s of word ids) silent."""
    n = int(round(seconds * rate))
    block, tone = int(round(BLOCK_S * rate)), int(round(TONE_S * rate))  # whole samples at every rate used
    x = np.zeros((n // block + 1, block), np.float32)
    x[:, :tone] = _level(np.arange(len(x)))[:, None]
    for g in gaps:
        x[g.start:g.stop] = 0.0
    return x.ravel()[:n]


def _truth(seconds: float, gaps: Gaps = ()) -> list[int]:
    """The words a file of ``seconds`` holds: those with more than half their plateau inside
    and not silenced by ``gaps``."""
    return [k for k in range(int(seconds / BLOCK_S) + 1)
            if min(TONE_S, seconds - k * BLOCK_S) > TONE_S / 2 and not any(k in g for g in gaps)]


def _fair_duration(seconds: float) -> float:
    """``seconds`` moved off the 5 ms around the half-a-word threshold at the file's end (where
    resampling could tip the last word either way)."""
    cut = seconds % BLOCK_S
    return seconds + 0.01 if abs(cut - TONE_S / 2) < 0.005 else seconds


def _runs(audio: np.ndarray, rate: int) -> list[tuple[int, int, int]]:
    """(start, end, word id) of the plateaus heard in ``audio`` (see the module docstring)."""
    on = np.abs(audio) > 0.04
    edges = np.flatnonzero(np.diff(np.r_[0, on.astype(np.int8), 0]))
    out = []
    for a, b in zip(edges[::2], edges[1::2]):
        n, half = b - a, TONE_S / 2 * rate
        if n < 0.02 * rate:
            continue  # resampling ripple, not a word
        if (b == len(audio) and n <= half) or (a == 0 and n < half):
            continue  # mostly outside this window: the neighbouring window hears it
        mid = audio[a + n // 4: b - n // 4]
        k = int(round((float(np.median(np.abs(mid))) - 0.1) / 0.8 * MAX_WORDS))
        out.append((int(a), int(b), k))
    return out


def _recognizer(rate: int, mode: str):
    """A fake ``recognize``. ``mode``: "text"; "words" (a segment per word); "sentences" (a
    segment per four-word sentence, as the ids say); "early" (text, but a full window says only
    its first third, as Whisper does when a window starts mid-speech); "early-words": both.)"""
    def recognize(batch: list[np.ndarray]) -> list[str]:
        out: list[str] = []
        for audio in batch:
            runs = _runs(audio, rate)
            if mode.startswith("early") and len(audio) >= 0.99 * WINDOW_S * rate:
                runs = [r for r in runs if r[1] <= len(audio) / 3]
            text = " ".join(_word(k) for _, _, k in runs)
            if mode in ("text", "early"):
                out.append(text)
                continue
            groups: list[list[tuple[int, int, int]]] = []
            for r in runs:
                if groups and mode == "sentences" and groups[-1][-1][2] // 4 == r[2] // 4:
                    groups[-1].append(r)
                else:
                    groups.append([r])
            segs = [Segment(g[0][0] / rate, g[-1][1] / rate, " ".join(_word(k) for *_, k in g)) for g in groups]
            out.append(TimedText(text, segs))
        return out
    return recognize


def _transcriber(rate: int, overlap_s: float, mode: str) -> Transcriber:
    return Transcriber(lambda i: _recognizer(rate, mode), sample_rate=rate, max_audio_seconds=WINDOW_S,
                       replicas=1, batch_size=8, overlap_s=overlap_s)


def _cases(seed: int, n: int) -> list[tuple[float, float, int, int, Gaps]]:
    """(seconds, overlap, input rate, model rate, silences): log-uniform lengths 0.1 s .. 20 min
    (one of 15 min or more),
    the overlap's ends and the default among uniform ones, every other file with up to two
    silences of up to 80 s (longer than a window)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lo = math.log(0.1) if i != 3 else math.log(900.0)  # one file of 15-20 min each time
        seconds = _fair_duration(float(round(math.exp(rng.uniform(lo, math.log(1200.0))), 3)))
        overlap = [0.0, WINDOW_S / 2, 3.0][i] if i < 3 else round(float(rng.uniform(0, WINDOW_S / 2)), 3)
        model_rate = [16000, 16000, 8000][i % 3]
        in_rate = int(rng.choice([model_rate, model_rate, 8000, 22050, 44100, 48000]))
        words = int(seconds / BLOCK_S) + 1
        gaps = tuple(range(a, a + int(rng.integers(1, 160))) for a in rng.integers(0, words, int(rng.integers(1, 3))))
        out.append((seconds, overlap, in_rate, model_rate, gaps if i % 2 else ()))
    return out


def _check_segments(segs: list[dict], duration: float) -> None:
    """Absolute, non-decreasing, within the file, and SRT/VTT of them well-formed."""
    prev = 0.0
    for s in segs:
        assert prev - 1e-9 <= s["start"] <= s["end"] <= duration + 1e-3, (s, prev, duration)
        prev = s["end"]
    _check_subtitles(segs)


SRT_CUE = re.compile(r"(\d+)\n(\d{2,}):([0-5]\d):([0-5]\d),(\d{3}) --> (\d{2,}):([0-5]\d):([0-5]\d),(\d{3})\n[^\n]+\n")
VTT_CUE = re.compile(r"(\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3}) --> (\d{2,}):([0-5]\d):([0-5]\d)\.(\d{3})\n[^\n]+\n")


def _ms(h: str, m: str, s: str, ms: str) -> int:
    return ((int(h) * 60 + int(m)) * 60 + int(s)) * 1000 + int(ms)


def _check_subtitles(segs: list[dict]) -> None:
    """Every cue of SRT and VTT parses, is numbered 1.., ends no earlier than it starts, and
    matches its segment's times to the millisecond, but for the end of a segment shorter than
    half a second: half a second after its start, or the next cue's start if that is sooner
    (and later than this one's start)."""
    cues = [s for s in segs if s["text"].strip()]
    srt = to_srt(segs)
    blocks = srt.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == len(cues) + 1
    for i, (block, s) in enumerate(zip(blocks, cues), 1):
        m = SRT_CUE.fullmatch(block + "\n")
        assert m, block
        assert int(m[1]) == i
        a, b = _ms(*m.group(2, 3, 4, 5)), _ms(*m.group(6, 7, 8, 9))
        end = max(a, round(s["end"] * 1000))
        if end - a < 500:
            later = [round(c["start"] * 1000) for c in cues[i:] if round(c["start"] * 1000) > a]
            end = max(end, min([a + 500] + later[:1]))
        assert a == round(s["start"] * 1000) and b == end, (s, block)
        assert b > a
    vtt = to_vtt(segs)
    assert vtt.startswith("WEBVTT\n\n")
    vblocks = vtt[len("WEBVTT\n\n"):].split("\n\n")
    assert vblocks[-1] == "" and len(vblocks) == len(cues) + 1
    for block, s in zip(vblocks, cues):
        m = VTT_CUE.fullmatch(block + "\n")
        assert m, block
        assert _ms(*m.group(1, 2, 3, 4)) == round(s["start"] * 1000)


def _input(seconds: float, in_rate: int, model_rate: int, gaps: Gaps = ()):
    audio = _signal(seconds, in_rate, gaps)
    return audio if in_rate == model_rate else (audio, in_rate)


# ---- every word once, in order --------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["text", "words", "sentences"])
def test_every_word_once_in_order_at_any_length_overlap_and_rate(mode: str) -> None:
    """The stitched text (and, with one segment per word, the segments' words) is the audio's
    words, each once, in order; segments lie at the words' own times in the file. (Segments of
    several words may repeat words at a seam, as documented: there, no word is missing.)"""
    for seconds, overlap, in_rate, model_rate, gaps in _cases(1 + ["text", "words", "sentences"].index(mode), 16):
        with _transcriber(model_rate, overlap, mode) as tr:
            (r,) = tr.transcribe([_input(seconds, in_rate, model_rate, gaps)])
        case = (seconds, overlap, in_rate, model_rate, gaps)
        assert r.ok, (case, r.error)
        want = [_word(k) for k in _truth(seconds, gaps)]
        assert r.text.split() == want, case
        assert r.duration_s == pytest.approx(seconds, abs=2 / min(in_rate, model_rate))
        if mode == "text":
            assert r.segments is None
            continue
        _check_segments(r.segments, r.duration_s)
        if mode == "words":
            assert [s["text"] for s in r.segments] == want, case
            tol = 0.005
            for s in r.segments:
                k = int(s["text"][4:])
                assert s["start"] == pytest.approx(max(0.0, k * BLOCK_S), abs=tol), (case, s)
                assert s["end"] == pytest.approx(min(seconds, k * BLOCK_S + TONE_S), abs=tol), (case, s)
        else:
            said = " ".join(s["text"] for s in r.segments).split()
            assert set(said) == set(want), case


@pytest.mark.parametrize("mode", ["early", "early-words"])
def test_windows_that_stop_early_lose_no_word_at_any_overlap(mode: str) -> None:
    """A full window that says only its first third is decoded again (in pieces, or from its
    last segment's end with timestamps); whatever the overlap, every word comes out once."""
    rate = 16000
    for seconds, overlap in [(95.3, 3.0), (95.3, 0.0), (95.3, 1.0), (123.4, 2.0), (200.0, 15.0), (61.75, 0.5),
                             (300.1, 0.25)]:
        with _transcriber(rate, overlap, mode) as tr:
            (r,) = tr.transcribe([_signal(seconds, rate)])
        want = [_word(k) for k in _truth(seconds)]
        assert r.text.split() == want, (seconds, overlap)
        if mode == "early-words":
            _check_segments(r.segments, r.duration_s)
            assert [s["text"] for s in r.segments] == want, (seconds, overlap)


# ---- streamed from disk = the same samples as an array ----------------------------------------------


@pytest.mark.parametrize("ext,subtype,rate,mode", [(".wav", "PCM_16", 16000, "words"), (".flac", "PCM_24", 44100, "text"),
                                                   (".wav", "FLOAT", 8000, "sentences"), (".flac", "PCM_16", 22050, "words")])
def test_files_streamed_from_disk_equal_the_same_audio_as_an_array(tmp_path: Path, ext: str, subtype: str,
                                                                    rate: int, mode: str) -> None:
    rng = np.random.default_rng(rate)
    lengths = [_fair_duration(float(round(rng.uniform(lo, hi), 3))) for lo, hi in [(0.1, 29.0), (30.5, 70.0), (120.0, 400.0)]]
    overlap = round(float(rng.uniform(0, WINDOW_S / 2)), 3)
    paths, arrays = [], []
    for i, seconds in enumerate(lengths):
        p = tmp_path / f"a{i}{ext}"
        sf.write(p, _signal(seconds, rate), rate, subtype=subtype)
        paths.append(str(p))
        arrays.append((sf.read(p, dtype="float32")[0], rate))  # the samples as the file holds them
    with _transcriber(16000, overlap, mode) as tr:
        from_disk = tr.transcribe(paths)
        in_memory = tr.transcribe(arrays)
    for seconds, d, m in zip(lengths, from_disk, in_memory):
        assert d.ok and m.ok, (d.error, m.error)
        assert d.text == m.text and d.text.split() == [_word(k) for k in _truth(seconds)], (seconds, overlap)
        assert d.windows == m.windows
        assert d.duration_s == pytest.approx(m.duration_s, abs=1e-6)
        assert d.segments == m.segments
        if d.segments is not None:
            _check_segments(d.segments, d.duration_s)


# ---- subtitles past 24 hours -------------------------------------------------------------------------


def test_subtitles_past_24_hours_are_well_formed() -> None:
    """Hours do not wrap at 24 (a recording of 30 h has cues at 29:..); cues parse and keep their
    times to the millisecond, including values that round up to the next second/minute/hour."""
    rng = np.random.default_rng(7)
    starts = np.sort(rng.uniform(0, 40 * 3600, 200))
    segs = [{"start": round(float(a), 3), "end": round(float(a) + float(d), 3), "text": f"cue {i}"}
            for i, (a, d) in enumerate(zip(starts, rng.uniform(0, 5, 200)))]
    segs += [{"start": 86399.9996, "end": 89999.9999, "text": "rounds up"}, {"start": 90000.0, "end": 90000.0, "text": "x"}]
    _check_subtitles(segs)
    assert "23:59:59,999 --> 24:59:59,999" not in to_srt(segs[-2:])
    assert to_srt(segs[-2:-1]).splitlines()[1] == "24:00:00,000 --> 25:00:00,000"


@pytest.mark.parametrize("overlap,streamed", [(0.0, False), (1.0, False), (1.0, True)])
def test_redecoding_skips_only_audio_the_previous_window_holds(tmp_path: Path, overlap: float, streamed: bool) -> None:
    """A re-decoded window drops its head up to the first pause, as audio the previous window
    also holds; with ``overlap`` < 3 s that pause may lie past the shared audio. Here the
    pauses are murmur (quiet, not silent) but for one silence 2.4 s into window 1: the words
    between the end of window 0 and that silence used to be lost (60-62 at 1 s overlap; 60-64,
    and 120 at window 2's start, at 0 s). The same from a file streamed from disk."""
    rate, seconds = 16000, 95.75
    audio = _signal(seconds, rate)
    audio[audio == 0] = 0.02  # below the words' level: the fake hears no word, speech_seconds no speech
    silence = int(round((WINDOW_S - overlap + 2.4) * rate))  # the pause after the word 2 s into window 1
    audio[silence:silence + int(0.1 * rate)] = 0.0
    source: object = audio
    if streamed:
        sf.write(tmp_path / "a.wav", audio, rate, subtype="FLOAT")
        source = str(tmp_path / "a.wav")
    with _transcriber(rate, overlap, "early") as tr:
        (r,) = tr.transcribe([source])
    assert r.text.split() == [_word(k) for k in _truth(seconds)]


def test_a_redecoded_window_is_stitched_from_where_its_text_starts() -> None:
    """A window re-decoded past its head (up to the pause at the end of the audio the previous
    window holds) says nothing of that audio, so the seam must not look there for words said
    twice. A phrase ("have been") said 4 words before the seam and again 2 words after it used
    to be taken for the overlap, and the words between were lost: on LibriVox clips concatenated
    with 2.5 s pauses (72 s), tiny.en gave "he might have been made amiable himself", losing
    "still more respectable than he was. He might even have been made"."""
    rate, seconds = 16000, 57.0  # windows [0, 30] and [27, 57]
    audio = _signal(seconds, rate)
    audio[audio == 0] = 0.02  # murmur: no pause but the silence below
    audio[int(29.9 * rate):int(30.0 * rate)] = 0.0  # the pause 2.9 s into window 1, at the end of window 0
    names = {53: "have", 54: "been", 62: "have", 63: "been"}
    early = _recognizer(rate, "early")

    def recognize(batch: list[np.ndarray]) -> list[str]:
        return [" ".join(names.get(int(w[4:]), w) for w in t.split()) for t in early(batch)]

    with Transcriber(lambda i: recognize, sample_rate=rate, max_audio_seconds=WINDOW_S, replicas=1, batch_size=8,
                     overlap_s=3.0) as tr:
        (r,) = tr.transcribe([audio])
    assert r.text.split() == [names.get(k, _word(k)) for k in _truth(seconds)]
