"""Segment timestamps across windows: a transcript that carries its segments, shifting them
by a window's start, and stitching the segments of overlapping windows of long audio.

The rules that make Whisper predict timestamps, and the cutting of one window's tokens into
segments, are in :mod:`polyaccel.asr.decoding` (:class:`~polyaccel.asr.decoding.TimestampRules`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def stitch_segments(windows: Sequence[Sequence[Segment] | None],
                    spans_s: Sequence[tuple[float, float]]) -> list[Segment] | None:
    """One file's segments, in seconds from its start, from its windows' segments (each in
    seconds from its window's start; ``spans_s[k]`` is window k's (start, end) in the file).

    Consecutive windows share audio; each seam is the middle of the shared stretch: a segment
    is taken from the window on whose side of the seam its middle lies, so speech in the
    shared audio is taken once. Times are then kept within their window's audio (Whisper may
    place a last timestamp past the end of a short file: 3.00 s in a 2.99 s clip) and made
    non-decreasing (a segment starts no earlier than the previous one ends). None if any
    window has no segments list (decoded without timestamps)."""
    if any(w is None for w in windows):
        return None
    out: list[Segment] = []
    n = len(windows)
    for k, (segs, (a, b)) in enumerate(zip(windows, spans_s, strict=True)):
        lo = -float("inf") if k == 0 else (spans_s[k - 1][1] + a) / 2
        hi = float("inf") if k == n - 1 else (b + spans_s[k + 1][0]) / 2
        for s in shifted(segs or [], a):
            mid = (s.start + s.end) / 2
            if lo <= mid < hi:
                out.append(Segment(min(s.start, b), min(s.end, b), s.text))
    fixed: list[Segment] = []
    prev_end = 0.0
    for s in out:
        start = max(s.start, prev_end)
        end = max(s.end, start)
        fixed.append(Segment(round(start, 3), round(end, 3), s.text))
        prev_end = end
    return fixed


def segment_records(segments: Sequence[Segment] | None) -> list[dict[str, Any]] | None:
    """The JSONL form: ``[{"start": s, "end": s, "text": ...}]`` (None stays None)."""
    if segments is None:
        return None
    return [{"start": s.start, "end": s.end, "text": s.text} for s in segments]


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
