"""Audio input: decode any file soundfile reads (and, through PyAV, the containers libsndfile
lacks: m4a/AAC, WebM, WMA, ...) to mono float32 at the model's rate, split long audio into
overlapping windows, and stitch the window transcripts back together.

Every way a file can be bad (missing, empty, truncated, not audio, NaN samples...) raises
:class:`AudioError` with a short message, so the pipeline can report it per file and go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

AV_EXTENSIONS = frozenset({".m4a", ".m4b", ".aac", ".mp4", ".webm", ".mka", ".wma", ".amr"})
"""Extensions of formats libsndfile does not read; they are decoded with PyAV (FFmpeg)."""

AUDIO_EXTENSIONS = frozenset({".wav", ".flac", ".ogg", ".oga", ".opus", ".mp3", ".aiff", ".aif",
                              ".au", ".w64", ".rf64", ".caf", ".sph", ".nist", ".raw", ".pcm"}) | AV_EXTENSIONS
"""File extensions the directory walker treats as audio."""

AV_REQUIREMENT = "av==18.1.0"
"""The PyAV release this package is tested with (the ``formats`` extra of polyaccel-asr)."""

RAW_EXTENSIONS = frozenset({".raw", ".pcm"})
DEFAULT_OVERLAP_S = 3.0
MIN_SAMPLE_RATE = 1000
"""Lowest rate taken as audio: a header saying 1 Hz (a corrupt one) would make a 100 kB file
hours of audio to transcribe."""
MAX_SAMPLE_RATE = 768_000
"""Highest rate taken as audio (the fastest audio interfaces): a header saying 100 MHz would make
a 200 MB file "1 s" of audio, decoded whole instead of streamed (memory would grow with the file)."""


class AudioError(ValueError):
    """A file that cannot be turned into audio; ``str(err)`` is a short, user-facing reason."""


def _check_rate(rate: float) -> None:
    """Refuse a sample rate outside [:data:`MIN_SAMPLE_RATE`, :data:`MAX_SAMPLE_RATE`]."""
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise AudioError(f"implausible sample rate ({rate} Hz; a corrupt header?): audio has "
                         f"{MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz")


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
    if raw is None and (kind := _av_kind(path)):
        return np.concatenate(list(_av_stream(path, kind, sample_rate, STREAM_BLOCK_S)))
    name = os.fsencode(path)  # bytes: any file name
    with _decode_errors(path):
        if raw is not None:
            data, rate = sf.read(name, dtype="float32", always_2d=True, samplerate=raw.sample_rate,
                                 channels=raw.channels, subtype=raw.subtype, endian=raw.endian,
                                 format="RAW")
        else:
            info = sf.info(name)
            _check_rate(info.samplerate)  # before reading: a corrupt rate must not decide the memory
            data, rate = sf.read(name, dtype="float32", always_2d=True)
            _check_complete(path, len(data), rate, info.frames)
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
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        if path.is_symlink():  # the same words in the log and in the results line
            raise AudioError(f"broken symbolic link (to {os.readlink(path)})") from None
        raise AudioError("missing file") from None
    except PermissionError:  # stat needs no permission on the file itself, only on its folders
        raise AudioError("permission denied: a folder on its path may not be entered") from None
    except OSError as e:  # a name too long (ENAMETOOLONG), an I/O error
        raise AudioError(f"cannot read it: {e.strerror or e}") from None
    if path.is_dir():
        raise AudioError("is a directory, not an audio file")
    st = path.stat()  # never open(): opening a FIFO blocks until something writes to it
    if not stat.S_ISREG(st.st_mode):
        raise AudioError(f"not a regular file ({_file_kind(st.st_mode)})")
    if st.st_size == 0:
        raise AudioError("empty file (0 bytes)")
    if raw is None and path.suffix.lower() in RAW_EXTENSIONS:
        raw = RawFormat()
    return path, raw


def _file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a special file")


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
    if _ogg_cut_off(path):
        raise AudioError(f"truncated audio: the Ogg stream has no end (file holds {frames_read / rate:.2f} s)")
    declared = _declared_frames(path)
    if declared is None:
        declared = header_frames
    if declared > frames_read and frames_read >= 0:
        if f"{declared / rate:.2f}" == f"{frames_read / rate:.2f}":  # a few samples short
            raise AudioError(f"truncated audio: header declares {declared} samples, file holds {frames_read}")
        raise AudioError(f"truncated audio: header declares {declared / rate:.2f} s, "
                         f"file holds {frames_read / rate:.2f} s")


def _ogg_cut_off(path: Path) -> bool:
    """True for an Ogg file whose last page is cut short or is not an end-of-stream page: Ogg
    declares no length, and libsndfile reads the part that is there without a word."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"OggS":
            return False
        f.seek(max(0, size - 65536))
        tail = f.read()
    at = tail.rfind(b"OggS")
    while at >= 0:
        page = tail[at:]
        if len(page) >= 27 and page[4] == 0:  # version 0: a real page header
            n_seg = page[26]
            if len(page) < 27 + n_seg or len(page) < 27 + n_seg + sum(page[27:27 + n_seg]):
                return True  # the last page is cut
            return not page[5] & 0x04  # header_type bit 2: end of stream
        at = tail.rfind(b"OggS", 0, at)
    return True


def _declared_frames(path: Path) -> int | None:
    """Frames the file's header declares, for the formats whose header states its data length
    (WAV, RF64/BW64, Wave64, AIFF, AU, NIST SPHERE): libsndfile quietly shortens a cut-off
    file to what is there. None: another format, or a header that says "unknown length" (or
    sizes no file system can seek to: libsndfile judges such a file)."""
    with open(path, "rb") as f:
        head = f.read(12)
        f.seek(0)
        try:
            if head[:4] in (b"RIFF", b"RF64", b"BW64") and head[8:12] == b"WAVE":
                return _wav_declared_frames(f)
            if head[:4] == b"riff" and len(head) == 12:
                return _w64_declared_frames(f)
            if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
                return _aiff_declared_frames(f)
            if head[:4] == b".snd":
                return _au_declared_frames(f)
            if head[:7] == b"NIST_1A":
                m = re.search(rb"\nsample_count -i (\d+)", f.read(1024))
                return int(m[1]) if m else None
        except (OSError, OverflowError):
            return None
    return None


_UNKNOWN_SIZES = (0, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FFFF000)  # streaming writers' size fields (SoX: 0x7ffff000)


def _wav_declared_frames(f: Any) -> int | None:
    """Frames a RIFF/WAVE (or RF64/BW64, sized by its ``ds64`` chunk) header declares in its
    data chunk (None: no data chunk, or a streaming writer's "unknown length" marker)."""
    f.seek(12)
    block_align = ds64_size = 0
    while True:
        chunk = f.read(8)
        if len(chunk) < 8:
            return None
        cid, size = chunk[:4], int.from_bytes(chunk[4:], "little")
        if cid in (b"fmt ", b"ds64"):
            body = f.read(min(size, 64))  # what is needed; a header cannot make this read large
            if cid == b"fmt ":
                block_align = int.from_bytes(body[12:14], "little") if len(body) >= 14 else 0
            elif len(body) >= 16:
                ds64_size = int.from_bytes(body[8:16], "little")
            f.seek(size - len(body) + size % 2, 1)
        elif cid == b"data":
            size = ds64_size if size == 0xFFFFFFFF and ds64_size else size
            if not block_align or size in _UNKNOWN_SIZES:
                return None
            return size // block_align
        else:
            f.seek(size + size % 2, 1)


def _w64_declared_frames(f: Any) -> int | None:
    """Frames a Sony Wave64 header declares (chunks: 16-byte GUID, 64-bit size that counts the
    24-byte chunk header, 8-byte aligned)."""
    f.seek(40)  # riff GUID, riff size, wave GUID
    block_align = 0
    while True:
        chunk = f.read(24)
        if len(chunk) < 24:
            return None
        cid, size = chunk[:4], int.from_bytes(chunk[16:], "little")
        if size < 24:
            return None
        if cid == b"fmt ":
            body = f.read(min(size - 24, 64))
            block_align = int.from_bytes(body[12:14], "little") if len(body) >= 14 else 0
            f.seek(size - 24 - len(body) + -size % 8, 1)
        elif cid == b"data":
            return (size - 24) // block_align if block_align else None
        else:
            f.seek(size - 24 + -size % 8, 1)


def _aiff_declared_frames(f: Any) -> int | None:
    """Frames an AIFF/AIFC ``COMM`` chunk declares."""
    f.seek(12)
    while True:
        chunk = f.read(8)
        if len(chunk) < 8:
            return None
        cid, size = chunk[:4], int.from_bytes(chunk[4:], "big")
        if cid == b"COMM":
            body = f.read(6)
            return int.from_bytes(body[2:6], "big") if len(body) == 6 else None
        f.seek(size + size % 2, 1)


_AU_SAMPLE_BYTES = {1: 1, 2: 1, 3: 2, 4: 3, 5: 4, 6: 4, 7: 8, 27: 1}  # by encoding; others: unknown


def _au_declared_frames(f: Any) -> int | None:
    """Frames a Sun/NeXT AU header declares (its data size, in bytes, or ~0 for unknown)."""
    head = f.read(24)
    if len(head) < 24:
        return None
    size, encoding, _, channels = (int.from_bytes(head[i:i + 4], "big") for i in (8, 12, 16, 20))
    width = _AU_SAMPLE_BYTES.get(encoding, 0) * channels
    return size // width if width and size not in _UNKNOWN_SIZES else None


def _describe_decode_error(path: Path, detail: str) -> str:
    with open(path, "rb") as f:
        head = f.read(512)
    if head and _looks_like_text(head):
        return "not an audio file (looks like text)"
    if (path.suffix.lower() not in AUDIO_EXTENSIONS and not head.startswith((b"RIFF", b"fLaC", b"OggS"))
            and _magic_kind(head) is None):
        return f"unsupported audio format ({path.suffix or 'no extension'})"
    detail = detail.strip().splitlines()[-1] if detail.strip() else "unreadable"
    detail = detail.split("': ", 1)[-1]  # drop libsndfile's "Error opening '<path>'" prefix
    if "does not exist or is not a regular file" in detail:  # libsndfile's word for an undecodable MP3
        detail = "Format not recognised."
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
    if data.ndim not in (1, 2):
        raise AudioError(f"expected a [T] or [T, C] waveform, got shape {data.shape}")
    if data.size == 0:  # (also [T, 0] or [0, C]: no channel to pick)
        raise AudioError("empty audio (0 samples)")
    if data.ndim == 2:
        data = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    _check_rate(rate)
    if np.issubdtype(data.dtype, np.integer):
        data = data.astype(np.float32) / float(np.iinfo(data.dtype).max)
    data = data.astype(np.float32, copy=False)
    lo, hi = float(data.min()), float(data.max())  # NaN and inf propagate; no temporary arrays
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise AudioError("audio contains NaN or infinite samples")
    if rate != sample_rate:
        import soxr

        data = soxr.resample(data, rate, sample_rate, quality="HQ").astype(np.float32, copy=False)
        if data.size == 0:  # a sample or two at a higher rate
            raise AudioError(f"empty audio (0 samples at {sample_rate} Hz: shorter than one sample)")
        lo, hi = float(data.min()), float(data.max())
    if lo < -1.0 or hi > 1.0:  # float files may exceed full scale; resampling can overshoot
        data = np.clip(data, -1.0, 1.0)
    return data


MAX_ARRAY_CHANNELS = 1024
"""Most channels an in-memory array may have (libsndfile's own limit)."""


def waveform_from_array(data: np.ndarray, rate: int, sample_rate: int = 16000) -> np.ndarray:
    """:func:`prepare_waveform` for an array a caller built: [T], [T, C] or [C, T] (channels
    are the shorter axis), float or integer PCM of up to 32 bits (signed ints scaled by
    2**(bits-1), unsigned ones centred first, as libsndfile reads them). Raises
    :class:`AudioError` for a square (ambiguous) or too-wide array, for non-real dtypes (bool,
    complex, object) and for 64-bit integers: no PCM format, but what numpy makes of a list of
    Python ints, whose 16-bit samples scaled by 2**63 would be silence."""
    data = np.asarray(data)
    if data.dtype.kind not in "iuf":
        raise AudioError(f"audio must be a real-valued (float or integer PCM) array, got dtype {data.dtype}")
    if data.dtype.kind in "iu" and data.dtype.itemsize > 4:
        raise AudioError(f"{data.dtype} audio is no PCM format (numpy's default for Python ints): pass float32 in "
                         "[-1, 1], or int16 / int32 PCM (e.g. arr.astype(np.int16) for 16-bit samples)")
    if data.ndim == 2:
        data = _channels_last(data)
    if data.dtype.kind in "iu":
        data = _int_pcm_to_float(data)
    return prepare_waveform(data, rate, sample_rate)


def _int_pcm_to_float(data: np.ndarray) -> np.ndarray:
    """Integer PCM -> float32 in [-1, 1): divided by 2**(bits-1), unsigned centred on it first."""
    full = 2.0 ** (8 * data.dtype.itemsize - 1)
    x = data.astype(np.float32 if data.dtype.itemsize <= 2 else np.float64)
    if data.dtype.kind == "u":
        x -= full
    x /= full
    return x.astype(np.float32, copy=False)


def _channels_last(data: np.ndarray) -> np.ndarray:
    """A 2-D array as [T, C]: the longer axis is time."""
    frames, channels = data.shape
    if frames == channels and frames > 1:
        raise AudioError(f"a {data.shape} array is ambiguous: is it [T, C] or [C, T]? pass a [T] waveform")
    if frames < channels:
        data, frames, channels = data.T, channels, frames
    if channels > MAX_ARRAY_CHANNELS:
        raise AudioError(f"a {data.shape} array has no channel axis of at most {MAX_ARRAY_CHANNELS}; "
                         "pass [T], [T, C] or [C, T]")
    return data


def audio_duration(path: str | os.PathLike, raw: RawFormat | None = None) -> float:
    """Duration in seconds from the header alone (no decoding).

    Raises :class:`AudioError` (with the same reasons as :func:`load_audio`) when the file
    cannot be read: a bad file never passes for 0 s of audio."""
    return audio_extent(path, raw)[0]


_RAW_SAMPLE_BYTES = {"PCM_S8": 1, "PCM_U8": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4, "FLOAT": 4, "DOUBLE": 8}


def audio_extent(path: str | os.PathLike, raw: RawFormat | None = None) -> tuple[float, int]:
    """(seconds, samples) from the header alone: :func:`audio_duration`'s seconds, and the
    float32 samples :func:`load_audio` decodes at once (frames x channels; PyAV's formats are
    mixed to mono frame by frame: frames). Raises :class:`AudioError` as :func:`audio_duration`."""
    path, raw = _checked_path(path, raw)
    if raw is not None:
        sample_bytes = _RAW_SAMPLE_BYTES.get(raw.subtype, 2)
        size = path.stat().st_size
        return size / (raw.channels * sample_bytes) / raw.sample_rate, size // sample_bytes
    if kind := _av_kind(path):
        seconds, rate = _av_duration(path, kind)
        return seconds, math.ceil(seconds * rate)
    with _decode_errors(path):
        info = _soundfile().info(os.fsencode(path))
    if info.frames <= 0:
        _check_rate(info.samplerate)
        declared = _declared_frames(path)  # a header whose data was cut off is no empty recording
        if declared:
            raise AudioError(f"truncated audio: header declares {declared / info.samplerate:.2f} s, file holds 0.00 s")
        raise AudioError("empty audio (0 samples)")
    _check_rate(info.samplerate)
    return float(info.frames) / info.samplerate, info.frames * info.channels


# ---- streaming: bounded memory whatever the file length ----------------------------------

STREAM_BLOCK_S = 10.0
"""Seconds of audio :func:`stream_audio` decodes at a time."""

STREAM_BLOCK_SAMPLES = 1 << 22
"""Most samples (frames x channels: 16 MiB of float32) :func:`stream_audio` decodes in one read,
so a block's memory does not grow with the channel count (libsndfile allows 1024)."""


def stream_audio(path: str | os.PathLike, sample_rate: int = 16000, *, block_s: float = STREAM_BLOCK_S,
                 raw: RawFormat | None = None) -> Iterator[np.ndarray]:
    """Yield ``path`` as consecutive mono float32 blocks at ``sample_rate`` Hz, decoding and
    resampling ``block_s`` seconds at a time, so memory does not grow with the file.

    The concatenated blocks equal :func:`load_audio`'s waveform sample for sample (soxr's
    streaming resampler gives its one-shot result). libsndfile decodes every format it reads
    (wav, flac, ogg/vorbis/opus, raw) incrementally, and so does PyAV (m4a/AAC, WebM, ...: one
    FFmpeg frame at a time). MP3 is the exception: libsndfile 1.2's MP3 reader garbles ~70 ms
    after every partial read (a whole-file read is right), so MP3 streams through PyAV, whose
    samples equal libsndfile's whole-file ones; without PyAV it is read whole (memory grows
    with the file; a warning says so). Raises :class:`AudioError` as
    :func:`load_audio` does; a truncated file is detected only at its end, after the blocks
    before it were yielded, so callers must treat an error at any point as the file's error.
    """
    sf = _soundfile()
    path, raw = _checked_path(path, raw)
    if raw is None and (kind := _av_kind(path) or _mp3_kind(path)):
        if kind != _MP3 or _has_av():
            yield from _av_stream(path, kind, sample_rate, block_s)
            return
        _warn_mp3_whole(path)
        block_s = math.inf
    opts = {} if raw is None else dict(samplerate=raw.sample_rate, channels=raw.channels,
                                       subtype=raw.subtype, endian=raw.endian, format="RAW")
    with _decode_errors(path), sf.SoundFile(os.fsencode(path), **opts) as f:
        rate, header_frames = f.samplerate, f.frames
        resample = _Resampler(rate, sample_rate)
        frames_read = 0
        block = -1 if math.isinf(block_s) else max(1, int(block_s * rate))  # -1: all that is left
        for mono in _mono_blocks(f, block):
            frames_read += len(mono)
            yield resample(mono)
        if raw is None:
            _check_complete(path, frames_read, rate, header_frames)
        if frames_read == 0:
            raise AudioError("empty audio (0 samples)")
        if len(tail := resample(np.zeros(0, np.float32), last=True)):
            yield tail


def _mono_blocks(f: Any, block: int) -> Iterator[np.ndarray]:
    """Mono blocks of ``block`` frames (the last may be shorter; -1: all, in one read) of the
    open SoundFile ``f``, each read :data:`STREAM_BLOCK_SAMPLES` samples at most at a time and
    mixed down as it is read, so memory is bounded whatever the channel count."""
    if block < 0:  # one read: libsndfile garbles MP3 read in parts
        if len(data := f.read(-1, dtype="float32", always_2d=True)):
            yield _mono_finite(data)
        return
    step = max(1, STREAM_BLOCK_SAMPLES // f.channels)
    while True:
        parts: list[np.ndarray] = []
        n = 0
        while n < block and len(data := f.read(min(step, block - n), dtype="float32", always_2d=True)):
            parts.append(_mono_finite(data))
            n += len(data)
        if parts:
            yield parts[0] if len(parts) == 1 else np.concatenate(parts)
        if n < block:  # the end of the file
            return


class _Resampler:
    """Chunk-wise soxr resampling (identity at equal rates), clipped to [-1, 1] as
    :func:`prepare_waveform` does."""

    def __init__(self, rate: int, sample_rate: int) -> None:
        _check_rate(rate)
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


# ---- formats libsndfile lacks: PyAV (FFmpeg) -------------------------------------------


def _libsndfile_version() -> tuple[int, ...]:
    try:
        text = _soundfile().__libsndfile_version__
    except (ImportError, AttributeError):
        return (0,)
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3]) or (0,)


def _magic_kind(head: bytes) -> str | None:
    """The format PyAV must decode, by the file's first bytes (None: libsndfile's, or unknown)."""
    if head[4:8] == b"ftyp":
        return "MP4/M4A (AAC)"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska"
    if head[:8] == b"\x30\x26\xb2\x75\x8e\x66\xcf\x11":
        return "ASF/WMA"
    if head[:5] == b"#!AMR":
        return "AMR"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:  # MPEG sync, layer 0: ADTS
        return "ADTS AAC"
    if _libsndfile_version() < (1, 1, 0) and (head[:3] == b"ID3" or (
            len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0)):
        return "MP3 (libsndfile < 1.1 lacks it)"
    if _libsndfile_version() < (1, 0, 29) and head[:4] == b"OggS" and b"OpusHead" in head:
        return "Ogg/Opus (libsndfile < 1.0.29 lacks it)"
    return None


_MP3 = "MP3"
_mp3_warned: set[str] = set()


def _mp3_kind(path: Path) -> str | None:
    """``"MP3"`` for an MP3 file libsndfile reads (an ID3 tag, or an MPEG frame sync that is
    not ADTS), else None."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0
                              and head[1] & 0x06):
        return _MP3
    return None


def _has_av() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _warn_mp3_whole(path: Path) -> None:
    import logging

    from polyaccel.asr.results_file import printable

    if not _mp3_warned:
        logging.getLogger(__name__).warning(
            "%s: long MP3 read whole (libsndfile garbles MP3 read in blocks); for bounded memory "
            "pip install '%s'", printable(path), AV_REQUIREMENT)
    _mp3_warned.add(str(path))


_SNDFILE_MAGIC = (b"RIFF", b"RIFX", b"RF64", b"BW64", b"fLaC", b"OggS", b"FORM", b".snd", b"caff",
                  b"NIST_1A", b"ID3")


def _av_kind(path: Path) -> str | None:
    """What PyAV decodes this file as, or None when libsndfile reads it (its own formats are
    never sent to PyAV: libsndfile detects truncation the way the rest of this module expects)."""
    with open(path, "rb") as f:
        head = f.read(64)
    if kind := _magic_kind(head):
        return kind
    suffix = path.suffix.lower()
    if suffix in AV_EXTENSIONS and not head.startswith(_SNDFILE_MAGIC):
        return f"{suffix[1:]} audio"
    return None


def _av_module(kind: str) -> Any:
    """The ``av`` module, or a per-file :class:`AudioError` naming what to install."""
    try:
        import av
    except ImportError:
        raise AudioError(f"{kind} needs PyAV (FFmpeg), which is not installed: "
                         f"pip install '{AV_REQUIREMENT}' (or 'polyaccel-asr[formats]')") from None
    return av


@contextlib.contextmanager
def _av_open(path: Path, kind: str) -> Iterator[tuple[Any, Any]]:
    """(container, its first audio stream), FFmpeg's errors as :class:`AudioError`."""
    av = _av_module(kind)
    name = os.fspath(path)
    try:
        name.encode("utf-8")
        source: Any = name
    except UnicodeEncodeError:  # a name that is not UTF-8: hand FFmpeg a Python file object
        source = open(path, "rb")  # noqa: SIM115 (closed below)
    try:
        # tags are not audio: a Latin-1 title from an old tagger must not make the file unreadable
        with av.open(source, "r", metadata_errors="replace") as c:
            if not c.streams.audio:
                raise AudioError("no audio stream in the file")
            if c.streams.audio[0].codec_context is None:
                raise AudioError("unsupported audio codec (FFmpeg has no decoder for it; a corrupt header?)")
            yield c, c.streams.audio[0]
    except av.FFmpegError as e:
        raise AudioError(_describe_decode_error(path, str(getattr(e, "strerror", None) or e))) from None
    finally:
        if source is not name:
            source.close()


def _av_declared_s(c: Any, s: Any) -> float | None:
    """Seconds the container's header declares (MP4, Matroska, ASF store it; ADTS and AMR do
    not, and FFmpeg's estimate from the bit rate is no promise)."""
    fmt = c.format.name
    if ("mp4" in fmt or "mov" in fmt) and s.duration:
        return float(s.duration * s.time_base)
    if ("matroska" in fmt or "asf" in fmt) and c.duration:
        return c.duration / 1e6
    return None


def _av_duration(path: Path, kind: str) -> tuple[float, int]:
    """(seconds, sample rate) of a file PyAV decodes."""
    with _av_open(path, kind) as (c, s):
        rate = int(s.codec_context.sample_rate or 0)
        seconds = _av_declared_s(c, s)
        if seconds is None and c.duration:
            seconds = c.duration / 1e6
    if seconds is None:  # nothing says: decode (one block at a time) and count
        seconds = sum(len(b) for b in _av_stream(path, kind, 16000, STREAM_BLOCK_S)) / 16000
    if seconds <= 0:
        raise AudioError("empty audio (0 samples)")
    return float(seconds), rate


_AV_TRUNCATION_SLACK_S = 0.1  # codec delay and frame granularity: what a complete file may miss


def _av_stream(path: Path, kind: str, sample_rate: int, block_s: float) -> Iterator[np.ndarray]:
    """:func:`stream_audio` through PyAV: FFmpeg frames, mixed to mono, gathered into blocks
    of ``block_s`` seconds, resampled with soxr as libsndfile's blocks are. Samples past the
    duration an MP4 header declares (the encoder's end padding) are dropped; a file that
    holds less than its header declares is an error, as with libsndfile."""
    with _av_open(path, kind) as (c, s):
        av = _av_module(kind)
        declared_s = _av_declared_s(c, s)
        convert = av.AudioResampler(format="fltp")
        rate = 0
        resample: _Resampler | None = None
        pending: list[np.ndarray] = []
        n_pending = total = 0
        cap = None
        for frame in c.decode(s):
            for f in convert.resample(frame):
                x = f.to_ndarray()  # [C, n] float32
                if not rate:
                    rate = int(f.rate)
                    resample = _Resampler(rate, sample_rate)
                    cap = None if declared_s is None or "mp4" not in c.format.name else round(declared_s * rate)
                elif int(f.rate) != rate:
                    raise AudioError(f"sample rate changes mid-file ({rate} -> {f.rate} Hz)")
                mono = x.mean(axis=0) if x.shape[0] > 1 else x[0]
                if cap is not None:
                    mono = mono[: max(0, cap - total)]
                total += len(mono)
                pending.append(mono)
                n_pending += len(mono)
                if n_pending >= block_s * rate:
                    yield resample(_mono_finite(np.concatenate(pending)[:, None]))
                    pending, n_pending = [], 0
        if n_pending:
            yield resample(_mono_finite(np.concatenate(pending)[:, None]))
        if total == 0:
            raise AudioError("empty audio (0 samples)")
        if declared_s is not None and total / rate < declared_s - _AV_TRUNCATION_SLACK_S:
            raise AudioError(f"truncated audio: header declares {declared_s:.2f} s, "
                             f"file holds {total / rate:.2f} s")
        if len(tail := resample(np.zeros(0, np.float32), last=True)):
            yield tail


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
    loud, frame_s = speech_frames(audio, sample_rate, floor)
    return float(np.count_nonzero(loud)) * frame_s


def speech_frames(audio: np.ndarray, sample_rate: int, floor: float = 0.005) -> tuple[np.ndarray, float]:
    """(whether each 20 ms frame of ``audio`` is loud enough to be speech, as
    :func:`speech_seconds` judges it; the frame length in seconds)."""
    rms = _frame_rms(audio, sample_rate)
    if not len(rms):
        return np.zeros(0, bool), _FRAME_S
    return rms > max(floor, 0.1 * float(np.percentile(rms, 95))), _FRAME_S


def speech_spans(audio: np.ndarray, sample_rate: int) -> list[tuple[float, float]]:
    """(start, end) seconds of each run of 20 ms frames :func:`speech_seconds` counts as speech."""
    loud, frame_s = speech_frames(audio, sample_rate)
    edges = np.flatnonzero(np.diff(np.r_[0, loud.astype(np.int8), 0]))
    return [(round(float(a) * frame_s, 3), round(float(b) * frame_s, 3)) for a, b in zip(edges[::2], edges[1::2])]


def voice_frames(audio: np.ndarray, sample_rate: int) -> tuple[np.ndarray, float]:
    """(whether each 20 ms frame of ``audio`` holds voice, the frame length in seconds): its RMS
    is 12 dB above the audio's own noise floor (its 10th-percentile frame) and above -60 dBFS, or
    at least half the loud level (the 95th-percentile frame) whatever the floor: a noise floor
    near the speech's level (a music bed) makes everything voice, so what this finds silent is."""
    rms = _frame_rms(audio, sample_rate)
    if not len(rms):
        return np.zeros(0, bool), _FRAME_S
    noise, loud = np.percentile(rms, [10, 95])
    return rms > min(max(4.0 * float(noise), 1e-3), 0.5 * float(loud)), _FRAME_S


def voice_spans(audio: np.ndarray, sample_rate: int) -> list[tuple[float, float]]:
    """(start, end) seconds of each run of 20 ms frames :func:`voice_frames` finds voiced."""
    loud, frame_s = voice_frames(audio, sample_rate)
    edges = np.flatnonzero(np.diff(np.r_[0, loud.astype(np.int8), 0]))
    return [(round(float(a) * frame_s, 3), round(float(b) * frame_s, 3)) for a, b in zip(edges[::2], edges[1::2])]


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
    run. A run is taken only if, with the two texts aligned on it, more than a third of the
    word pairs that face each other match (the run and any other agreeing words): two windows
    that heard the same words agree up to their edges but for a few words heard differently,
    while a phrase a passage says twice ("he might have been made still more respectable than
    he was. He might even have been made") is no overlap when the later window left out the
    words it shares. Without a common run the texts are concatenated.
    """
    lw, rw = left.split(), right.split()
    if not lw or not rw:
        return " ".join(lw + rw)
    tail, head = lw[-max_left:], rw[:max_left if max_right is None else max_right]
    tk, hk = [_key(w) for w in tail], [_key(w) for w in head]
    best, best_i, best_j, best_dist = 0, 0, 0, 0
    reach = len(tail) + len(head)  # the pairs that face each other can run past the searched words
    lk, rk = [_key(w) for w in lw[-reach:]], [_key(w) for w in rw[:reach]]
    agree, shift = _agreement(lk, rk), len(lk) - len(tk)
    # Longest common substring over words by dynamic programming (len(tail) x len(head) cells).
    prev = [0] * (len(hk) + 1)
    for i in range(1, len(tk) + 1):
        cur = [0] * (len(hk) + 1)
        for j in range(1, len(hk) + 1):
            if tk[i - 1] and tk[i - 1] == hk[j - 1]:
                cur[j] = prev[j - 1] + 1
                dist = (len(tk) - i) + (j - cur[j])  # words between the run and the seam
                if not agree[i - j + shift]:
                    continue
                if cur[j] > best or (cur[j] == best and dist < best_dist):
                    best, best_i, best_j, best_dist = cur[j], i, j, dist
        prev = cur
    if best == 0 or (best == 1 and len(hk[best_j - 1]) <= 2):
        return " ".join(lw + rw)  # one short common word ("a", "of") is no evidence of overlap
    cut_left = len(lw) - len(tail) + best_i
    return " ".join(lw[:cut_left] + rw[best_j:])


def _agreement(lk: list[str], rk: list[str]) -> dict[int, bool]:
    """For each alignment of ``rk`` under ``lk`` (offset: ``lk`` index minus ``rk`` index),
    whether more than a third of the word pairs that face each other are equal."""
    matches: dict[int, int] = {}
    for i, a in enumerate(lk):
        for j, b in enumerate(rk):
            if a and a == b:
                matches[i - j] = matches.get(i - j, 0) + 1
    return {o: 3 * m > min(len(lk), len(rk) + o) - max(0, o) for o, m in matches.items()}


def _words_in(text: str, part_s: float, whole_s: float) -> int:
    """How many of ``text``'s words can fall in ``part_s`` of its ``whole_s`` seconds: the
    proportional share, with room for uneven speech; 1 (a word the cut halves) for no audio."""
    if part_s <= 0:
        return 1
    n = len(text.split())
    return math.ceil(n * min(1.0, part_s / max(whole_s, 1e-9)) * 1.25) + 3


def stitch(texts: Sequence[str], spans_s: Sequence[tuple[float, float]] | None = None,
           seam_words: Sequence[tuple[int, int] | None] | None = None) -> str:
    """Merge the transcripts of consecutive overlapping windows into one text.

    ``spans_s[k]`` is window k's (start, end) in seconds; it tells each seam how many words
    on either side can be in the shared audio. Without it, windows are taken to be 30 s long
    and to overlap by :data:`DEFAULT_OVERLAP_S`. ``seam_words[k - 1]``, where given, is that
    count for the seam between windows k - 1 and k, (words at the end of the left text, words
    at the start of the right one), known from the words' times
    (:func:`~polyaccel.asr.timestamps.seam_word_counts`) instead of guessed from the lengths.
    """
    if spans_s is None:
        hop = 30.0 - DEFAULT_OVERLAP_S
        spans_s = [(k * hop, k * hop + 30.0) for k in range(len(texts))]
    out = texts[0].strip() if texts else ""
    for k in range(1, len(texts)):
        (a0, a1), (b0, b1) = spans_s[k - 1], spans_s[k]
        shared = max(0.0, a1 - b0)
        right = texts[k].strip()
        known = seam_words[k - 1] if seam_words is not None else None
        left_n, right_n = known or (_words_in(texts[k - 1], shared, a1 - a0), _words_in(right, shared, b1 - b0))
        out = merge_overlap(out, right, left_n, right_n) if out else right
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
