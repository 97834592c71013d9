"""Audit (session audit-asr): segments of long audio after a long silence.

Whisper must stamp a window's first segment within its first second, so speech 25 s into a
window of long audio came back as a segment from the window's start. A fake recognizer does
the same here: every window's first segment starts at 0, the others at their sound."""

from __future__ import annotations

import numpy as np

from polyaccel.asr.decoding import Segment
from polyaccel.asr.timestamps import TimedText, trim_silent_starts
from polyaccel.asr.transcriber import Transcriber

RATE = 16000


def _bursts(audio: np.ndarray) -> list[tuple[int, int, str]]:
    """(start, end, word) of each stretch of sound; the word says how loud it is ("a3": 0.3)."""
    loud = np.abs(audio) > 0.01
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loud.astype(np.int8), [0]])))
    return [(a, b, f"a{round(10 * float(np.abs(audio[a:b]).max()))}") for a, b in zip(edges[::2], edges[1::2])]


def _whisper_like(batch: list[np.ndarray]) -> list[str]:
    out = []
    for audio in batch:
        runs = _bursts(audio)
        segs = [Segment(0.0 if k == 0 else a / RATE, b / RATE, w) for k, (a, b, w) in enumerate(runs)]
        out.append(TimedText(" ".join(w for *_, w in runs), segs))
    return out


def _tone(seconds: float, amplitude: float) -> np.ndarray:
    """A 250 Hz square wave: loud in every sample, so a burst is one stretch of sound."""
    return (amplitude * np.sign(np.sin(2 * np.pi * 250 * (np.arange(int(seconds * RATE)) + 0.5) / RATE))).astype(np.float32)


def test_speech_after_a_long_silence_is_one_segment_starting_at_the_speech() -> None:
    """Was: the second sound (50-52 s) twice, from 27 s (window 2's start) and again from 52 s."""
    silence = np.zeros
    audio = np.concatenate([silence(2 * RATE, np.float32), _tone(2, 0.3), silence(46 * RATE, np.float32),
                            _tone(2, 0.6), silence(11 * RATE, np.float32)])  # 63 s: windows 0, 27, 33 s
    with Transcriber(lambda i: _whisper_like, sample_rate=RATE, max_audio_seconds=30.0, batch_size=4) as tr:
        (r,) = tr.transcribe([audio])
    assert r.error is None and r.windows == 3
    assert [(s["text"], s["start"], s["end"]) for s in r.segments] == [("a3", 2.0, 4.0), ("a6", 50.0, 52.0)]


def test_trim_moves_only_starts_that_open_on_a_second_of_silence() -> None:
    audio = np.concatenate([np.zeros(5 * RATE, np.float32), _tone(1, 0.5), np.zeros(RATE // 2, np.float32),
                            _tone(1, 0.5)])
    text = TimedText("x y", [Segment(0.0, 6.0, "x"), Segment(6.0, 7.5, "y")])
    assert trim_silent_starts(audio, text, RATE).segments == [Segment(5.0, 6.0, "x"), Segment(6.0, 7.5, "y")]
    untouched = TimedText("x", [Segment(4.5, 6.0, "x")])
    assert trim_silent_starts(audio, untouched, RATE) is untouched  # half a second of silence: kept
    silent = TimedText("x", [Segment(0.0, 4.0, "x")])  # no sound in it at all: nothing to move to
    assert trim_silent_starts(audio, silent, RATE) is silent


