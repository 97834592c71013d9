"""Audio input: decode any file soundfile reads to mono float32 at the model's rate, split long
audio into overlapping windows, and stitch the window transcripts back together.

Every way a file can be bad (missing, empty, truncated, not audio, NaN samples...) raises
:class:`AudioError` with a short message, so the pipeline can report it per file and go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif",
                              ".au", ".w64", ".rf64", ".caf", ".sph", ".nist", ".raw", ".pcm"})
"""File extensions the directory walker treats as audio."""

RAW_EXTENSIONS = frozenset({".raw", ".pcm"})
DEFAULT_OVERLAP_S = 3.0


class AudioError(ValueError):
    """A file that cannot be turned into audio; ``str(err)`` is a short, user-facing reason."""


@dataclasses.dataclass(frozen=True, slots=True)
class RawFormat:
    """How to read headerless PCM (``.raw``/``.pcm``): its rate, channels and sample type."""

    sample_rate: int = 16000
    channels: int = 1
    subtype: str = "PCM_16"
    endian: str = "LITTLE"


def load_audio(path: str | os.PathLike, sample_rate: int = 16000, *,
               raw: RawFormat | None = None) -> np.ndarray:
    """Decode ``path`` to a mono float32 waveform in [-1, 1] at ``sample_rate`` Hz.

    Channels are averaged; other rates are resampled with soxr (high quality). Headerless
    files (``.raw``/``.pcm``, or any file when ``raw`` is given) are read as ``raw`` says
    (16 kHz mono 16-bit little-endian by default). Raises :class:`AudioError`.
    """
    sf = _soundfile()
    path, raw = _checked_path(path, raw)
    name = os.fsencode(path)  # bytes: any file name
    with _decode_errors(path):
        if raw is not None:
            data, rate = sf.read(name, dtype="float32", always_2d=True, samplerate=raw.sample_rate,
                                 channels=raw.channels, subtype=raw.subtype, endian=raw.endian,
                                 format="RAW")
        else:
            data, rate = sf.read(name, dtype="float32", always_2d=True)
            _check_complete(path, len(data), rate, sf.info(name).frames)
    return prepare_waveform(data, rate, sample_rate)


def _soundfile():
    """The ``soundfile`` module, or an error naming what to install."""
    try:
        import soundfile
    except ImportError as e:
        raise ImportError("reading audio files needs soundfile: pip install soundfile") from e
    return soundfile


def _checked_path(path: str | os.PathLike, raw: RawFormat | None) -> tuple[Path, RawFormat | None]:
    """The path, after the checks a decoder would report badly, and its raw format (if any)."""
    path = Path(path)
    if not path.exists():
        raise AudioError("missing file")
    if path.is_dir():
        raise AudioError("is a directory, not an audio file")
    if path.stat().st_size == 0:
        raise AudioError("empty file (0 bytes)")
    if raw is None and path.suffix.lower() in RAW_EXTENSIONS:
        raw = RawFormat()
    return path, raw


@contextlib.contextmanager
def _decode_errors(path: Path) -> Iterator[None]:
    """Turn libsndfile's errors (at open or in the middle of the data) into :class:`AudioError`."""
    sf = _soundfile()
    try:
        yield
    except sf.LibsndfileError as e:
        raise AudioError(_describe_decode_error(path, str(e))) from None
    except RuntimeError as e:  # older soundfile raises plain RuntimeError
        raise AudioError(_describe_decode_error(path, str(e))) from None


def _check_complete(path: Path, frames_read: int, rate: int, header_frames: int) -> None:
    """Raise if the header promises more audio than the file holds (a cut-off download or
    copy). libsndfile quietly returns the part that is there, which would lose words."""
    declared = _wav_declared_frames(path)
    if declared is None:
        declared = header_frames
    if declared > frames_read and frames_read >= 0:
        raise AudioError(f"truncated audio: header declares {declared / rate:.2f} s, "
                         f"file holds {frames_read / rate:.2f} s")


def _wav_declared_frames(path: Path) -> int | None:
    """Frames a RIFF/WAVE header declares in its data chunk (None: not a plain WAV, or a
    streaming writer's "unknown length" marker)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        block_align = 0
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                return None
            cid, size = chunk[:4], int.from_bytes(chunk[4:], "little")
            if cid == b"fmt ":
                fmt = f.read(size)
                block_align = int.from_bytes(fmt[12:14], "little") if len(fmt) >= 14 else 0
                f.seek(size % 2, 1)
            elif cid == b"data":
                if not block_align or size in (0, 0xFFFFFFFF, 0x7FFFFFFF):
                    return None
                return size // block_align
            else:
                f.seek(size + size % 2, 1)


def _describe_decode_error(path: Path, detail: str) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    if head and _looks_like_text(head):
        return "not an audio file (looks like text)"
    if path.suffix.lower() not in AUDIO_EXTENSIONS and not head.startswith((b"RIFF", b"fLaC", b"OggS")):
        return f"unsupported audio format ({path.suffix or 'no extension'})"
    detail = detail.strip().splitlines()[-1] if detail.strip() else "unreadable"
    detail = detail.split("': ", 1)[-1]  # drop libsndfile's "Error opening '<path>'" prefix
    return f"corrupt or truncated audio ({detail[:80]})"


def _looks_like_text(head: bytes) -> bool:
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c.isspace() for c in text)


def prepare_waveform(data: np.ndarray, rate: int, sample_rate: int = 16000) -> np.ndarray:
    """Make a decoded array model-ready: mono (channel mean), ``sample_rate`` Hz, float32 in
    [-1, 1]. ``data`` is [T] or [T, C] (soundfile's layout). Raises :class:`AudioError` for
    empty audio or NaN/inf samples."""
    data = np.asarray(data)
    if data.ndim == 2:
        data = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    elif data.ndim != 1:
        raise AudioError(f"expected a [T] or [T, C] waveform, got shape {data.shape}")
    if data.size == 0:
        raise AudioError("empty audio (0 samples)")
    if np.issubdtype(data.dtype, np.integer):
        data = data.astype(np.float32) / float(np.iinfo(data.dtype).max)
    data = data.astype(np.float32, copy=False)
    lo, hi = float(data.min()), float(data.max())  # NaN and inf propagate; no temporary arrays
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise AudioError("audio contains NaN or infinite samples")
    if rate != sample_rate:
        import soxr

        data = soxr.resample(data, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)
        lo, hi = float(data.min()), float(data.max())
    if lo < -1.0 or hi > 1.0:  # float files may exceed full scale; resampling can overshoot
        data = np.clip(data, -1.0, 1.0)
    return data


def audio_duration(path: str | os.PathLike, raw: RawFormat | None = None) -> float:
    """Duration in seconds from the header alone (no decoding).

    Raises :class:`AudioError` (with the same reasons as :func:`load_audio`) when the file
    cannot be read: a bad file never passes for 0 s of audio."""
    path, raw = _checked_path(path, raw)
    if raw is not None:
        frame_bytes = raw.channels * {"PCM_S8": 1, "PCM_U8": 1, "PCM_16": 2, "PCM_24": 3,
                                      "PCM_32": 4, "FLOAT": 4, "DOUBLE": 8}.get(raw.subtype, 2)
        return path.stat().st_size / frame_bytes / raw.sample_rate
    with _decode_errors(path):
        info = _soundfile().info(os.fsencode(path))
    if info.frames <= 0:
        raise AudioError("empty audio (0 samples)")
    return float(info.frames) / info.samplerate


# ---- streaming: bounded memory whatever the file length ----------------------------------

STREAM_BLOCK_S = 10.0
"""Seconds of audio :func:`stream_audio` decodes at a time."""


def stream_audio(path: str | os.PathLike, sample_rate: int = 16000, *, block_s: float = STREAM_BLOCK_S,
                 raw: RawFormat | None = None) -> Iterator[np.ndarray]:
    """Yield ``path`` as consecutive mono float32 blocks at ``sample_rate`` Hz, decoding and
    resampling ``block_s`` seconds at a time, so memory does not grow with the file.

    The concatenated blocks equal :func:`load_audio`'s waveform sample for sample (soxr's
    streaming resampler gives its one-shot result). libsndfile decodes every format it reads
    (wav, flac, ogg/vorbis/opus, mp3, raw) incrementally. Raises :class:`AudioError` as
    :func:`load_audio` does; a truncated file is detected only at its end, after the blocks
    before it were yielded, so callers must treat an error at any point as the file's error.
    """
    sf = _soundfile()
    path, raw = _checked_path(path, raw)
    opts = {} if raw is None else dict(samplerate=raw.sample_rate, channels=raw.channels,
                                       subtype=raw.subtype, endian=raw.endian, format="RAW")
    with _decode_errors(path), sf.SoundFile(os.fsencode(path), **opts) as f:
        rate, header_frames = f.samplerate, f.frames
        resample = _Resampler(rate, sample_rate)
        frames_read = 0
        while len(data := f.read(max(1, int(block_s * rate)), dtype="float32", always_2d=True)):
            frames_read += len(data)
            yield resample(_mono_finite(data))
        if frames_read == 0:
            raise AudioError("empty audio (0 samples)")
        if raw is None:
            _check_complete(path, frames_read, rate, header_frames)
        if len(tail := resample(np.zeros(0, np.float32), last=True)):
            yield tail


class _Resampler:
    """Chunk-wise soxr resampling (identity at equal rates), clipped to [-1, 1] as
    :func:`prepare_waveform` does."""

    def __init__(self, rate: int, sample_rate: int) -> None:
        self._stream = None
        if rate != sample_rate:
            import soxr

            self._stream = soxr.ResampleStream(rate, sample_rate, 1, dtype="float32", quality="HQ")

    def __call__(self, x: np.ndarray, last: bool = False) -> np.ndarray:
        if self._stream is not None:
            x = self._stream.resample_chunk(x, last=last).astype(np.float32, copy=False)
        if len(x) and (float(x.min()) < -1.0 or float(x.max()) > 1.0):
            x = np.clip(x, -1.0, 1.0)
        return x


def _mono_finite(data: np.ndarray) -> np.ndarray:
    """[T, C] float32 -> [T] channel mean; raises on NaN/inf as :func:`prepare_waveform` does."""
    data = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    data = data.astype(np.float32, copy=False)
    if not (math.isfinite(float(data.min())) and math.isfinite(float(data.max()))):
        raise AudioError("audio contains NaN or infinite samples")
    return data


# ---- long audio: windows and stitching ----------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """One piece of a longer waveform: ``audio`` is a view (no copy) of the source samples."""

    index: int
    start_s: float
    audio: np.ndarray


def window_bounds(num_samples: int, sample_rate: int, window_s: float,
                  overlap_s: float = DEFAULT_OVERLAP_S) -> list[tuple[int, int]]:
    """[start, end) sample ranges covering ``num_samples`` with windows of ``window_s`` seconds
    overlapping by ``overlap_s``. Audio that fits one window gives one range. The last window
    is shifted left to be full length (more context for the last words) when possible."""
    win = int(round(window_s * sample_rate))
    if num_samples <= win:
        return [(0, num_samples)]
    hop = win - int(round(min(overlap_s, window_s / 2) * sample_rate))
    n = 1 + math.ceil((num_samples - win) / hop)
    bounds = [(i * hop, min(i * hop + win, num_samples)) for i in range(n)]
    last_start = max(0, num_samples - win)
    bounds[-1] = (max(last_start, bounds[-2][0] + 1), num_samples)
    return bounds


def split_windows(audio: np.ndarray, sample_rate: int, window_s: float,
                  overlap_s: float = DEFAULT_OVERLAP_S) -> Iterator[Window]:
    """Yield :class:`Window` views of ``audio`` (lazily; nothing is copied or featurized here,
    so a 2 h waveform costs no memory beyond its own samples)."""
    for i, (a, b) in enumerate(window_bounds(len(audio), sample_rate, window_s, overlap_s)):
        yield Window(i, a / sample_rate, audio[a:b])


def stream_windows(blocks: Iterable[np.ndarray], sample_rate: int, window_s: float,
                   overlap_s: float = DEFAULT_OVERLAP_S) -> Iterator[Window]:
    """Cut a stream of sample blocks into exactly the windows :func:`window_bounds` gives for
    their concatenation, without knowing its length in advance.

    Window ``i`` starts at ``i * hop``. Every window but the last is full and ends before the
    audio does, so a full window is yielded once a sample past its end has arrived; at the
    end, the last one is ``[N - win, N)`` (``[0, N)`` for audio of one window). Only samples
    after the last yielded window's start are kept: at most ``window + hop`` seconds plus
    one block. Each window owns its samples (a copy), so none keeps the buffer alive.
    """
    win = int(round(window_s * sample_rate))
    hop = win - int(round(min(overlap_s, window_s / 2) * sample_rate))
    buf, buf_start, total, i = np.zeros(0, np.float32), 0, 0, 0
    for block in blocks:
        buf = np.concatenate([buf, block]) if len(buf) else np.asarray(block, np.float32)
        total += len(block)
        while total > i * hop + win:  # a sample past window i's end: i is not the last
            a = i * hop - buf_start
            yield Window(i, i * hop / sample_rate, buf[a:a + win].copy())
            keep = i * hop + 1  # the last window starts after this one's start
            buf, buf_start, i = buf[keep - buf_start:], keep, i + 1
    if total:
        start = 0 if i == 0 else total - win
        yield Window(i, start / sample_rate, buf[start - buf_start:].copy())


# ---- speech energy: how much a window says, where it pauses -------------------------------

_FRAME_S = 0.02


def _frame_rms(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """RMS of consecutive 20 ms frames (a last partial frame is dropped)."""
    n = max(1, int(_FRAME_S * sample_rate))
    frames = audio[: len(audio) // n * n].reshape(-1, n)
    return np.sqrt(np.mean(np.square(frames, dtype=np.float32), axis=1))


def speech_seconds(audio: np.ndarray, sample_rate: int, floor: float = 0.005) -> float:
    """Seconds of ``audio`` loud enough to be speech: 20 ms frames above both ``floor``
    (about -46 dBFS) and a tenth of the 95th-percentile frame level. A coarse energy measure,
    used only to judge whether a transcript's word count is plausible."""
    rms = _frame_rms(audio, sample_rate)
    if not len(rms):
        return 0.0
    threshold = max(floor, 0.1 * float(np.percentile(rms, 95)))
    return float(np.count_nonzero(rms > threshold)) * _FRAME_S


def quietest_point(audio: np.ndarray, sample_rate: int, lo_s: float, hi_s: float) -> int:
    """The sample index in [``lo_s``, ``hi_s``) seconds where the 100 ms around it are
    quietest: a pause, where cutting splits no word."""
    rms = _frame_rms(audio, sample_rate)
    box = np.ones(5)
    smooth = np.convolve(rms, box, mode="same") / np.convolve(np.ones_like(rms), box, mode="same")
    lo, hi = int(lo_s / _FRAME_S), max(int(lo_s / _FRAME_S) + 1, min(len(smooth), int(hi_s / _FRAME_S)))
    if lo >= len(smooth):
        return min(len(audio), int(lo_s * sample_rate))
    return (lo + int(np.argmin(smooth[lo:hi]))) * int(_FRAME_S * sample_rate)


_WORD_KEY = re.compile(r"[^\w']+")


def _key(word: str) -> str:
    return _WORD_KEY.sub("", word.lower())


def merge_overlap(left: str, right: str, max_left: int = 17, max_right: int | None = None) -> str:
    """Join the transcripts of two overlapping windows, dropping the words said twice.

    Finds the longest common run of words between the last ``max_left`` words of ``left``
    and the first ``max_right`` (default: ``max_left``) of ``right`` (case and punctuation
    ignored), keeps ``left`` up to the run's end and ``right`` after it. Searching only the
    words that can lie in the overlap keeps a phrase repeated elsewhere in the audio from
    matching; among equally long runs the one nearest the seam wins. Words at a window's
    edge are often cut in half or dropped, which is why the seam is placed inside the common
    run. Without a common run the texts are concatenated.
    """
    lw, rw = left.split(), right.split()
    if not lw or not rw:
        return " ".join(lw + rw)
    tail, head = lw[-max_left:], rw[:max_left if max_right is None else max_right]
    tk, hk = [_key(w) for w in tail], [_key(w) for w in head]
    best, best_i, best_j, best_dist = 0, 0, 0, 0
    # Longest common substring over words by dynamic programming (len(tail) x len(head) cells).
    prev = [0] * (len(hk) + 1)
    for i in range(1, len(tk) + 1):
        cur = [0] * (len(hk) + 1)
        for j in range(1, len(hk) + 1):
            if tk[i - 1] and tk[i - 1] == hk[j - 1]:
                cur[j] = prev[j - 1] + 1
                dist = (len(tk) - i) + (j - cur[j])  # words between the run and the seam
                if cur[j] > best or (cur[j] == best and dist < best_dist):
                    best, best_i, best_j, best_dist = cur[j], i, j, dist
        prev = cur
    if best == 0 or (best == 1 and len(hk[best_j - 1]) <= 2):
        return " ".join(lw + rw)  # one short common word ("a", "of") is no evidence of overlap
    cut_left = len(lw) - len(tail) + best_i
    return " ".join(lw[:cut_left] + rw[best_j:])


def _words_in(text: str, part_s: float, whole_s: float) -> int:
    """How many of ``text``'s words can fall in ``part_s`` of its ``whole_s`` seconds: the
    proportional share, with room for uneven speech."""
    n = len(text.split())
    return math.ceil(n * min(1.0, part_s / max(whole_s, 1e-9)) * 1.25) + 3


def stitch(texts: Sequence[str], spans_s: Sequence[tuple[float, float]] | None = None) -> str:
    """Merge the transcripts of consecutive overlapping windows into one text.

    ``spans_s[k]`` is window k's (start, end) in seconds; it tells each seam how many words
    on either side can be in the shared audio. Without it, windows are taken to be 30 s long
    and to overlap by :data:`DEFAULT_OVERLAP_S`.
    """
    if spans_s is None:
        hop = 30.0 - DEFAULT_OVERLAP_S
        spans_s = [(k * hop, k * hop + 30.0) for k in range(len(texts))]
    out = texts[0].strip() if texts else ""
    for k in range(1, len(texts)):
        (a0, a1), (b0, b1) = spans_s[k - 1], spans_s[k]
        shared = max(0.0, a1 - b0)
        right = texts[k].strip()
        out = merge_overlap(out, right, _words_in(texts[k - 1], shared, a1 - a0),
                            _words_in(right, shared, b1 - b0)) if out else right
    return out


# ---- bucketing ---------------------------------------------------------------------------


def bucket_order(durations: Sequence[float], group: int) -> list[int]:
    """An order of item indices in which each run of ``group`` consecutive items has similar
    durations (sorted longest first within each run of ``group`` * 8 items), so batches are
    homogeneous without reordering the whole input (the pipeline still returns results in
    input order). Indices within a lookahead block stay close to their input position, which
    keeps streaming latency and memory bounded."""
    block = max(1, group) * 8
    order: list[int] = []
    for s in range(0, len(durations), block):
        idx = list(range(s, min(s + block, len(durations))))
        order.extend(sorted(idx, key=lambda i: -durations[i]))
    return order
