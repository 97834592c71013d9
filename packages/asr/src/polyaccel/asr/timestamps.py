"""Segment timestamps across windows: a transcript that carries its segments, shifting them
by a window's start, and stitching the segments of overlapping windows of long audio.

The rules that make Whisper predict timestamps, and the cutting of one window's tokens into
segments, are in :mod:`polyaccel.asr.decoding` (:class:`~polyaccel.asr.decoding.TimestampRules`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from polyaccel.asr.decoding import Segment


class TimedText(str):
    """A window's transcript (a plain ``str`` everywhere text is expected) that also carries its
    ``segments``, in seconds from the start of the audio it was decoded from."""

    segments: list[Segment]

    def __new__(cls, text: str, segments: Sequence[Segment] = ()) -> TimedText:
        obj = super().__new__(cls, text)
        obj.segments = list(segments)
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Ray, process pools) with its segments
        return (TimedText, (str(self), self.segments))


def segments_of(text: Any) -> list[Segment] | None:
    """The segments ``text`` carries, or None for a plain string (decoded without timestamps)."""
    return list(text.segments) if isinstance(text, TimedText) else None


def shifted(segments: Sequence[Segment], offset_s: float) -> list[Segment]:
    """``segments`` moved ``offset_s`` seconds later."""
    return [Segment(round(s.start + offset_s, 3), round(s.end + offset_s, 3), s.text) for s in segments]


def joined(texts: Sequence[str], offsets_s: Sequence[float]) -> str:
    """Pieces' transcripts joined with spaces; a :class:`TimedText` with every piece's segments
    shifted by its offset if any piece has segments."""
    text = " ".join(t.strip() for t in texts if t.strip())
    if not any(isinstance(t, TimedText) for t in texts):
        return text
    segs: list[Segment] = []
    for t, off in zip(texts, offsets_s, strict=True):
        segs += shifted(segments_of(t) or [], off)
    return TimedText(text, segs)


SEAM_SLACK_S = 1.0
"""How far outside the audio two windows share a word's estimated time may lie and the word
still be searched for at their seam (times within a segment are estimated, see
:func:`word_times`)."""


def word_times(text: str, offset_s: float = 0.0) -> list[tuple[float, float]] | None:
    """(start, end) seconds of each word of ``text`` (``text.split()``), ``offset_s`` added:
    each segment's time shared among its words by their lengths. None for a plain string, or
    when the segments' words are not the text's."""
    segs = segments_of(text)
    if segs is None:
        return None
    out: list[tuple[float, float]] = []
    for s in segs:
        words = s.text.split()
        total = sum(len(w) + 1 for w in words)
        pos = 0
        for w in words:
            a = s.start + (s.end - s.start) * pos / total
            pos += len(w) + 1
            out.append((a + offset_s, s.start + (s.end - s.start) * pos / total + offset_s))
    return out if len(out) == len(text.split()) else None


def seam_word_counts(texts: Sequence[str], spans_s: Sequence[tuple[float, float]], *,
                     slack_s: float = SEAM_SLACK_S) -> list[tuple[int, int] | None] | None:
    """For each seam of consecutive windows (``spans_s[k]``: window k's (start, end) in the
    file), (words at the end of the left text, words at the start of the right one) that lie in
    the audio the two windows share, give or take ``slack_s``, by the words' times
    (:func:`word_times`); at least 1 each. None for a seam whose windows share no audio or
    whose words have no times; None overall for texts without segments.

    :func:`~polyaccel.asr.audio.stitch` otherwise guesses the count from the text's length (a
    proportional share, with room): at ``--overlap 15`` that reached a sentence said again
    outside the shared audio, took it for the overlap and lost the words between."""
    if not any(isinstance(t, TimedText) for t in texts):
        return None
    times = [word_times(t, a) for t, (a, _) in zip(texts, spans_s, strict=True)]
    out: list[tuple[int, int] | None] = []
    for k in range(1, len(texts)):
        lo, hi = spans_s[k][0], spans_s[k - 1][1]
        left, right = times[k - 1], times[k]
        if hi <= lo or left is None or right is None:
            out.append(None)
            continue
        out.append((max(1, sum(1 for _, e in left if e > lo - slack_s)),
                    max(1, sum(1 for a, _ in right if a < hi + slack_s))))
    return out


def stitch_segments(windows: Sequence[Sequence[Segment] | None],
                    spans_s: Sequence[tuple[float, float]],
                    speech: Sequence[Sequence[tuple[float, float]]] | None = None) -> list[Segment] | None:
    """One file's segments, in seconds from its start, from its windows' segments (each in
    seconds from its window's start; ``spans_s[k]`` is window k's (start, end) in the file).

    Consecutive windows share audio, and each cuts it into segments at its own places. At each
    seam the last segments of the earlier window and the first of the later one are chosen so
    that the speech either window found in the shared audio is covered: first the choice that
    leaves the least of it uncovered, then the one that covers the least of it twice, then the
    one that cuts nearest the middle of the shared stretch. Segments that start before the later
    window begins, or end after the earlier one ends, are always kept (the other window did not
    hear them). Times are then kept within their window's audio (Whisper may place a last
    timestamp past the end of a short file: 3.00 s in a 2.99 s clip) and made non-decreasing (a
    segment starts no earlier than the previous one ends). None if any window has no segments
    list (decoded without timestamps).

    ``speech[k]``, if given, is where window k holds speech ((start, end) seconds from its start,
    :func:`~polyaccel.asr.audio.speech_spans`): what is left out or covered twice is then
    counted in seconds of speech (a second without speech counts 1/20), not of segment time. Whisper's segments run over the pauses
    around them, so a segment that repeats a whole sentence of the other window was kept for
    the pause it "covered" (a LibriVox clip after a 2 s pause, said twice in the subtitles)."""
    if any(w is None for w in windows):
        return None
    timed = [[Segment(min(s.start, b), min(s.end, b), s.text) for s in shifted(segs or [], a)]
             for segs, (a, b) in zip(windows, spans_s, strict=True)]
    out: list[Segment] = []
    rest = timed[0] if timed else []
    for k in range(len(timed) - 1):
        # (a short last window, moved back to be full length, can reach back past the window
        # before: what is already taken is not found again)
        done = out[-1].end if out else -float("inf")
        late = [s for s in timed[k + 1] if s.end > done]
        loud = None if speech is None else _merged(
            [(s + spans_s[w][0], e + spans_s[w][0]) for w in (k, k + 1) for s, e in speech[w]])
        p, j = _seam(rest, late, max(spans_s[k + 1][0], done), spans_s[k][1], loud)
        out += rest[:p]
        rest = late[j:]
    out += rest
    fixed: list[Segment] = []
    prev_end = 0.0
    for s in out:
        start = max(s.start, prev_end)
        end = max(s.end, start)
        fixed.append(Segment(round(start, 3), round(end, 3), s.text))
        prev_end = end
    return fixed


def _seam(early: Sequence[Segment], late: Sequence[Segment], a: float, b: float,
          loud: list[tuple[float, float]] | None = None) -> tuple[int, int]:
    """(p, j): keep ``early[:p]`` and ``late[j:]`` where the two windows share ``[a, b]`` (with
    ``loud``, the speech there, sorted and disjoint: what is counted)."""
    must_p = sum(1 for s in early if s.start < a)  # (segments are in time order)
    firsts = [i for i, s in enumerate(late) if s.end > b]
    most_j = firsts[0] if firsts else len(late)
    found = _covered(list(early) + list(late), a, b, loud)
    middle = (a + b) / 2
    best: tuple[float, int, int] | None = None
    for p in range(must_p, len(early) + 1):
        kept_early = _covered(early[:p], a, b, loud)
        for j in range(most_j + 1):
            kept_late = _covered(late[j:], a, b, loud)
            kept = _covered(list(early[:p]) + list(late[j:]), a, b, loud)
            missed, twice = found - kept, kept_early + kept_late - kept
            cut_at = (early[p - 1].end if p else a) if j == len(late) else late[j].start
            cost = 10 * missed + twice + 1e-3 * abs(cut_at - middle)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, p, j)
    assert best is not None
    return best[1], best[2]


_QUIET_WEIGHT = 0.05
"""What a second without speech counts for at a seam, against 1 for a second of speech: little,
but not nothing, so speech too quiet for the energy measure still keeps its segment."""


def _covered(segments: Sequence[Segment], a: float, b: float, loud: list[tuple[float, float]] | None = None) -> float:
    """Seconds of ``[a, b]`` that ``segments`` cover (overlaps counted once); with ``loud``,
    seconds of speech, and each second without speech as :data:`_QUIET_WEIGHT`."""
    total, reach = 0.0, a
    for s in sorted(segments, key=lambda s: s.start):
        lo, hi = max(s.start, reach), min(s.end, b)
        if hi > lo:
            if loud is None:
                total += hi - lo
            else:
                speech = sum(max(0.0, min(hi, e) - max(lo, st)) for st, e in loud)
                total += speech + _QUIET_WEIGHT * (hi - lo - speech)
            reach = hi
    return total


def _merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` sorted, with overlapping ones joined."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def segment_records(segments: Sequence[Segment] | None) -> list[dict[str, Any]] | None:
    """The JSONL form: ``[{"start": s, "end": s, "text": ...}]`` (None stays None)."""
    if segments is None:
        return None
    return [{"start": s.start, "end": s.end, "text": s.text} for s in segments]


def trim_silent_starts(audio: Any, text: TimedText, sample_rate: int, *, min_gap_s: float = 1.0) -> TimedText:
    """``text`` with each segment that opens on ``min_gap_s`` or more of silence starting at
    its first speech instead (20 ms frames as loud as :func:`~polyaccel.asr.audio.speech_seconds`
    counts). Whisper must stamp a window's first segment within its first second, so speech
    that starts 25 s into a window of long audio was a segment from the window's start: shown
    25 s early, and, kept by the seam as audio the next window "did not hear", said twice.
    Returns ``text`` itself when nothing moves."""
    from polyaccel.asr.audio import speech_frames

    loud, frame_s = speech_frames(audio, sample_rate)
    segs, moved = [], False
    for s in text.segments:
        a, b = int(s.start / frame_s), int(s.end / frame_s)
        hits = np.flatnonzero(loud[a:b])
        if len(hits) and hits[0] * frame_s >= min_gap_s:
            s, moved = Segment(round((a + int(hits[0])) * frame_s, 3), s.end, s.text), True
        segs.append(s)
    return TimedText(str(text), segs) if moved else text


def clip_ends_to_speech(segments: Sequence[Segment], voice: Sequence[tuple[float, float]], *,
                        min_pause_s: float = 1.5, onset_s: float = 1.0, pad_s: float = 0.5) -> list[Segment]:
    """``segments`` with each one that runs on over ``min_pause_s`` or more without voice after
    its speech ending ``pad_s`` after that speech. ``voice``: (start, end) seconds that hold
    voice, in the segments' time (:func:`~polyaccel.asr.audio.voice_spans`). Whisper ends a
    segment where the next speech starts, so a subtitle stayed on screen over a 10 s pause; a
    sound shorter than ``onset_s`` at the end of a segment, after such a pause, is taken for
    that next speech's start and not counted. Ends only move earlier, never before their start;
    a segment without voice in it (speech too quiet to measure) is left as it is."""
    voice = _merged(voice)
    ends = [b for _, b in voice]
    out = []
    for s in segments:
        runs: list[tuple[float, float]] = []
        i = bisect.bisect_right(ends, s.start)  # the first stretch of voice that ends inside
        while i < len(voice) and voice[i][0] < s.end:
            a, b = max(voice[i][0], s.start), min(voice[i][1], s.end)
            i += 1
            if runs and a - runs[-1][1] < min_pause_s:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        if len(runs) > 1 and runs[-1][1] - runs[-1][0] < onset_s:
            runs.pop()
        if runs and s.end - runs[-1][1] >= min_pause_s:
            s = Segment(s.start, round(max(s.start, runs[-1][1] + pad_s), 3), s.text)
        out.append(s)
    return out


def decode_tail(audio: Any, text: TimedText, recognize: Any, sample_rate: int, *, min_gap_s: float = 1.0,
                min_speech_s: float = 0.5, rounds: int = 3) -> TimedText:
    """Whisper's seek, inside one window of long audio: Whisper often ends a window at its last
    complete sentence and leaves out speech cut by the window's end. While the audio after the
    last segment is longer than ``min_gap_s`` and holds ``min_speech_s`` of speech, decode it
    again from the end of the last segment (at most ``rounds`` times) and append what it says,
    its segments shifted to the window's time. Returns ``text`` itself when nothing is added."""
    from polyaccel.asr.audio import speech_seconds

    segs = list(text.segments)
    parts = [str(text).strip()]
    total_s = len(audio) / sample_rate
    for _ in range(rounds):
        end_s = segs[-1].end if segs else 0.0
        cut = int(round(end_s * sample_rate))
        rest = audio[cut:]
        if total_s - end_s < min_gap_s or speech_seconds(rest, sample_rate) < min_speech_s:
            break
        (more,) = recognize([rest])
        new = [s for s in shifted(segments_of(more) or [], end_s) if s.end > end_s]
        if not str(more).strip() or not new:
            break
        segs += new
        parts.append(str(more).strip())
    if len(parts) == 1:
        return text
    return TimedText(" ".join(p for p in parts if p), segs)
