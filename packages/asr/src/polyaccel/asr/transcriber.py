"""Batch transcription: files or arrays in, :class:`TranscriptResult` out, in input order.

A :class:`Transcriber` owns a :class:`polyaccel.core.runtime.ReplicaPool` whose replicas each
hold an :class:`~polyaccel.asr.runner.ASRRunner` (its own graphs, caches and state; replicas on
the same device share the model weights). The calling thread decodes audio, cuts long files
into overlapping windows of ``model.max_audio_seconds()``, orders each lookahead block by
duration so batches are homogeneous, and feeds the pool; the replicas compute features,
encode and decode; windows are stitched back per file. A bad file becomes a result with
``error`` set, never an exception.

Metrics are end to end from the first file read to the last result: RTFx = audio seconds /
wall seconds, with decoding, resampling and feature extraction included.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import numpy as np

from polyaccel.asr.audio import (
    DEFAULT_OVERLAP_S,
    AudioError,
    audio_extent,
    bucket_order,
    load_audio,
    prepare_waveform,  # noqa: F401  (tools/bench_asr.py times it through this module)
    quietest_point,
    speech_seconds,
    speech_spans,
    stitch,
    stream_audio,
    stream_windows,
    voice_spans,
    waveform_from_array,
    window_bounds,
)
from polyaccel.asr.manifest import InputItem
from polyaccel.asr.results_file import printable
from polyaccel.asr.timestamps import (
    TimedText,
    clip_ends_to_speech,
    decode_tail,
    joined,
    seam_word_counts,
    segment_records,
    segments_of,
    stitch_segments,
    trim_silent_starts,
)

AudioInput = str | os.PathLike | np.ndarray | InputItem | tuple
"""A path, an :class:`InputItem`, a mono float32 array at the model's rate, or (array, rate)."""

Recognize = Callable[[list[np.ndarray]], list[str]]
"""What a replica does: waveforms at the model's rate -> one text each (same order)."""

log = logging.getLogger(__name__)

REDECODE_BELOW_WPS = 1.5
"""A window of long audio whose transcript has fewer words per second of speech than this is
decoded again in pieces cut at pauses (Whisper without timestamps often stops after a word or
a sentence when a 30 s window starts mid-speech)."""

WARN_BELOW_WPS, WARN_ABOVE_WPS = 0.5, 6.0
"""Words per second of speech outside these bounds put a warning on the file's result."""

_MIN_SPEECH_S = 5.0  # below this much speech, a low word rate is no evidence of loss

CLOSED_ERROR = "not transcribed: the transcriber was closed (close() during transcribe)"
"""The ``error`` of each input a transcribe call had read but not finished when another thread
called :meth:`Transcriber.close`."""


LOAD_ATTEMPTS = 3
"""Loads of a model whose weight files another process replaced during the load (a conversion
renamed into the cache) before :meth:`Transcriber.from_pretrained` gives up."""


class WeightsReplaced(RuntimeError):
    """The model's weight files were replaced during every one of :data:`LOAD_ATTEMPTS` loads."""


class TranscriberClosed(RuntimeError):
    """A window refused because :meth:`Transcriber.close` closed the pool (becomes
    :data:`CLOSED_ERROR` on its input's result, never raised to the caller)."""


MAX_WHOLE_BYTES = 64 << 20
"""Most decoded float32 (frames x channels x 4 bytes) a file shorter than one window is decoded
whole with; a wider one (libsndfile allows 1024 channels) is streamed, in bounded memory."""


@dataclasses.dataclass(slots=True)
class TranscriptResult:
    """The transcript of one input.

    Attributes:
        path: the input path, or ``"<array i>"`` for in-memory audio.
        text: the transcript ("" when ``error`` is set).
        duration_s: audio length in seconds (0.0 if it could not be read).
        error: a short reason when the input failed, else None.
        windows: how many windows long audio was cut into (1 for short audio).
        ref: the reference text, when one was given with the input.
        warnings: windows whose word rate is implausible for their speech (words may be
            missing, or the model looped); the text is still the best we have.
        segments: with timestamps, ``[{"start", "end", "text"}]`` in seconds from the start
            of the input (windows of long audio stitched; an end run on over a long pause
            moved back to its speech, :func:`~polyaccel.asr.timestamps.clip_ends_to_speech`);
            None without.
    """

    path: str
    text: str = ""
    duration_s: float = 0.0
    error: str | None = None
    windows: int = 1
    ref: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    segments: list[dict[str, Any]] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_record(self, **extra: Any) -> dict[str, Any]:
        """The JSONL line for this result (``extra`` fields such as model and rtf appended)."""
        rec: dict[str, Any] = {"path": self.path, "text": self.text, "duration_s": round(self.duration_s, 3),
                               "error": self.error, "windows": self.windows}
        if self.ref is not None:
            rec["ref"] = self.ref
        if self.warnings:
            rec["warnings"] = list(self.warnings)
        if self.segments is not None:
            rec["segments"] = self.segments
        rec.update(extra)
        return rec


@dataclasses.dataclass(slots=True)
class TranscribeMetrics:
    """Throughput of one ``transcribe`` call (or of all calls, see :attr:`Transcriber.metrics`).

    ``rtfx`` = ``audio_s`` / ``wall_s``; ``features_included`` says feature extraction (and
    audio decoding) ran inside the timed region, as it does here.
    """

    items: int = 0
    failed: int = 0
    audio_s: float = 0.0
    wall_s: float = 0.0
    windows: int = 0
    features_included: bool = True

    @property
    def rtfx(self) -> float:
        return self.audio_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"items": self.items, "failed": self.failed, "windows": self.windows,
                "audio_s": round(self.audio_s, 3), "wall_s": round(self.wall_s, 3),
                "rtfx": round(self.rtfx, 2), "items_per_s": round(self.items_per_s, 3),
                "features_included": self.features_included}


@dataclasses.dataclass(slots=True)
class _Window:
    """One unit of pool work: window ``win`` of input ``idx``, starting ``start_s`` into it;
    ``long``: one of several windows (so it may be re-decoded in pieces); ``speech_s``: its
    seconds of speech, measured where it is read (off the replica threads, which keep the
    accelerator fed); ``shared_s``: seconds at its start that the previous window also holds."""

    idx: int
    win: int
    audio: np.ndarray
    start_s: float
    long: bool
    speech_s: float
    shared_s: float = 0.0


@dataclasses.dataclass(slots=True)
class _Decoded:
    """A window's transcript, the seconds of speech in it, whether it was re-decoded, and
    ``head_s``: seconds at the window's start the transcript leaves out (re-decoded from the
    pause that ends the audio the previous window holds)."""

    text: str
    speech_s: float
    redecoded: bool = False
    head_s: float = 0.0
    speech_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    voice_spans: list[tuple[float, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class _Pending:
    """An input whose windows are in flight: their texts so far, how many are out, whether
    its reader has submitted them all, and (streamed inputs) whether its header says it is
    longer than one window; ``heads_s``: seconds at each window's start its text leaves out."""

    result: TranscriptResult
    texts: list[str | None] = dataclasses.field(default_factory=list)
    spans_s: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    heads_s: list[float] = dataclasses.field(default_factory=list)
    speech: list[list[tuple[float, float]]] = dataclasses.field(default_factory=list)
    voice: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    left: int = 0
    read: bool = True
    long: bool = False

    @property
    def done(self) -> bool:
        return self.read and self.left == 0

    @property
    def text_spans_s(self) -> list[tuple[float, float]]:
        """The stretch of the file each window's text covers: its span less its skipped head."""
        return [(a + h, b) for (a, b), h in zip(self.spans_s, self.heads_s, strict=True)]

    def add(self, w: _Window, sample_rate: int) -> None:
        self.texts.append(None)
        self.heads_s.append(0.0)
        self.speech.append([])
        self.spans_s.append((w.start_s, w.start_s + len(w.audio) / sample_rate))
        self.left += 1


def _check_overlap(overlap_s: float) -> None:
    """Refuse a negative or non-finite overlap (a negative one would skip audio between windows)."""
    if not (isinstance(overlap_s, (int, float)) and math.isfinite(overlap_s) and overlap_s >= 0):
        raise ValueError(f"overlap_s must be a finite number of seconds >= 0, got {overlap_s!r}")


class Transcriber:
    """Transcribes many files fast: decoding on the caller's thread, recognition on a pool of
    replicas.

    ``model_name`` is the model's resolved name (``whisper-tiny.en`` for ``openai/whisper-tiny.en``,
    a directory's absolute path) and ``weights_sha256`` the hash of its weight files (set by
    :meth:`from_pretrained`; None for a model plugged in as a replica factory), as are
    ``dtype_name``, the dtype the weights were loaded in (``"bfloat16"``), and
    ``no_speech_threshold`` (None: off).

    Build one with :meth:`from_pretrained`; the constructor takes a ready replica factory,
    which is also how another model (or a fake, in tests) is plugged in.

    Args:
        replica_factory: ``factory(i) -> recognize`` for replica ``i``, called in that
            replica's worker thread; ``recognize(list[np.ndarray]) -> list[str]``.
        sample_rate: the rate (Hz) waveforms are resampled to.
        max_audio_seconds: longest window one recognize call gets; longer audio is split.
        replicas / batch_size: pool size and most windows per recognize call.
        overlap_s: seconds consecutive windows share.
        bucket_s: if set, batch only windows whose lengths fall in the same ``bucket_s``
            seconds bucket (for encoders whose cost follows the input length).
        pool_options: extra :class:`~polyaccel.core.runtime.ReplicaPool` arguments.
        compile_fn: ``compile_fn(i) -> graphs compiled`` for :meth:`compile_all`.
    """

    def __init__(self, replica_factory: Callable[[int], Recognize], *, sample_rate: int = 16000,
                 max_audio_seconds: float = 30.0, replicas: int = 1, batch_size: int = 8,
                 overlap_s: float = DEFAULT_OVERLAP_S, bucket_s: float | None = None,
                 model_name: str = "", backend_name: str = "cpu", pool_options: dict[str, Any] | None = None,
                 compile_fn: Callable[[int], Any] | None = None):
        _check_overlap(overlap_s)
        if overlap_s > max_audio_seconds / 2:
            raise ValueError(f"overlap_s must be at most half the model's {max_audio_seconds:g} s window "
                             f"({max_audio_seconds / 2:g} s), got {overlap_s:g}")
        self.sample_rate = sample_rate
        self.max_audio_seconds = max_audio_seconds
        self.replicas = max(1, replicas)
        self.batch_size = max(1, batch_size)
        self.overlap_s = overlap_s
        self.model_name = model_name
        self.weights_sha256: str | None = None
        self.fp8_encoder = False  # Whisper encoder GEMMs in FP8 (set by from_pretrained)
        self.batch_invariant = False  # Whisper's batch-invariant kernels (set by from_pretrained)
        self.dtype_name: str | None = None  # "bfloat16", ... (set by from_pretrained)
        self.no_speech_threshold: float | None = None  # Whisper's, None: off (set by from_pretrained)
        self.backend_name = backend_name
        self.metrics = TranscribeMetrics()
        self.last_metrics = TranscribeMetrics()
        self._factory = replica_factory
        self._pool_options = {"bucket_s": bucket_s, **(pool_options or {})}
        self._compile_fn = compile_fn
        self._running: tuple[TranscribeMetrics, float] | None = None
        self._pool: Any = None
        self._lock = threading.Lock()
        self._runs: set[threading.Event] = set()  # one per transcribe call in progress; close() sets them

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_name: str | os.PathLike = "whisper-tiny.en", *, backend: Any = "auto",
                        replicas: int | None = None, batch_size: int | None = None, dtype: Any = None,
                        overlap_s: float = DEFAULT_OVERLAP_S, use_graphs: bool = True,
                        max_new_tokens: int | None = None, timestamps: bool = False,
                        fp8_encoder: bool = False, batch_invariant: bool = False,
                        **runner_options: Any) -> Transcriber:
        """Load a model (a directory, or a known name such as ``"whisper-tiny.en"``) and build
        ``replicas`` runners on ``backend`` (``"auto"``, ``"cpu"``, ``"cuda"``, ``"neuron"``).

        ``replicas`` defaults to the backend's ``default_replicas()`` (1 on CPU, 2 per GPU) and
        ``batch_size`` to its ``default_batch_size`` (8 on CPU, 64 on a GPU). Replicas on one device
        share the weights; each owns its runner, graphs and caches. ``dtype`` defaults to the
        backend's. Extra keyword arguments go to the runner (e.g. ``batch_buckets``, ``no_speech_threshold``).
        ``timestamps``: decode with Whisper's timestamp tokens; each result gets ``segments``.
        ``fp8_encoder``: Whisper's encoder GEMMs in FP8 and its cross-attention K/V in e4m3
        (:mod:`polyaccel.asr.fp8`; tokens may differ from bf16's; ``ValueError`` where the
        device or model cannot).
        ``batch_invariant``: Whisper in bf16/fp16 on CUDA gives the same tokens whatever batch
        a window lands in (:mod:`polyaccel.asr.batch_invariant`; slower; ``ValueError`` for
        other models).
        """
        from polyaccel.core import select_backend

        if batch_invariant and fp8_encoder:
            raise ValueError("batch_invariant and fp8_encoder exclude each other: the FP8 GEMMs are not "
                             "batch-invariant kernels")
        if replicas is not None and not (isinstance(replicas, int) and replicas >= 1):
            raise ValueError(f"replicas must be an integer >= 1 (None: the backend's default), got {replicas!r}")
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be an integer >= 1 (None: the backend's default), got {batch_size!r}")
        _check_overlap(overlap_s)
        nst = runner_options.get("no_speech_threshold")
        if nst is not None and not (isinstance(nst, (int, float)) and not isinstance(nst, bool)
                                    and math.isfinite(nst) and nst >= 0):
            raise ValueError(f"no_speech_threshold must be a finite number >= 0 (None: off), got {nst!r}")
        be = select_backend(backend)
        batch_size = batch_size or be.default_batch_size
        n = replicas or be.default_replicas()
        dtype = dtype or be.default_dtype()
        devices = be.replica_devices(n)
        models: dict[str, Any] = {}
        load_lock = threading.Lock()

        def model_on(device: Any) -> Any:
            with load_lock:
                key = str(device)
                if key not in models:
                    models[key] = _load_model(path, device, dtype)
                    if batch_invariant:
                        if not hasattr(models[key], "batch_invariant"):
                            raise ValueError(f"{path_or_name}: batch-invariant kernels exist for Whisper only")
                        models[key].batch_invariant = True
                    if fp8_encoder:
                        from polyaccel.asr.fp8 import fp8_encoder as to_fp8

                        to_fp8(models[key])
                return models[key]

        for attempt in range(1, LOAD_ATTEMPTS + 1):
            resolved = _resolve_model(path_or_name)  # offline: installed packages, directories, HF cache
            path = resolved.path
            models.clear()
            before = _weights_identity(path)
            first = model_on(devices[0])  # loaded up front: its rate and window length shape the job
            sha = _weights_sha256(path)  # once per transcriber; cached by path, size, mtime, inode
            if _weights_identity(path) == before:
                break
            # Another process renamed a new conversion in (a new folder, swapped in whole): the
            # hash must be of the weights loaded, so load what is there now.
            log.warning("%s: the model's weights were replaced while they loaded (converted again by another "
                        "process?); loading them again (%d of %d)", printable(path), attempt, LOAD_ATTEMPTS)
        else:
            raise WeightsReplaced(f"{path}: the model's weights were replaced while it loaded, {LOAD_ATTEMPTS} "
                                  "times (converted again and again by another process?); load it again")
        if replicas is None and be.device_type == "cuda":
            import torch

            per_device = be.replicas_per_device
            fit = replicas_that_fit(per_device, torch.cuda.mem_get_info(devices[0])[0],
                                    first.decode_state_bytes(batch_size))
            if fit < per_device:
                log.info("%d replicas per GPU would not fit this model's decoder state at batch %d: %d",
                         per_device, batch_size, fit)
                n = fit * max(1, be.device_count())
                devices = be.replica_devices(n)
        if timestamps and getattr(first, "timestamp_rules", lambda: None)() is None:
            raise ValueError(f"{path_or_name}: this model does not predict timestamps")
        if runner_options.get("no_speech_threshold") is not None and getattr(first, "no_speech_id", lambda: None)() is None:
            # else every record would claim a threshold that was never applied
            raise ValueError(f"{path_or_name}: this model has no no-speech token (Whisper's <|nocaptions|> / "
                             "<|nospeech|>): --no-speech-threshold cannot apply")
        if batch_invariant and be.device_type != "cuda":
            raise ValueError(f"batch-invariant kernels are CUDA's; on {be.name} they would change nothing "
                             "(decode in float32 for the same tokens at every batch size)")

        def make_runner(i: int) -> Any:
            from polyaccel.asr.runner import ASRRunner

            opts = {"batch_buckets": _batch_buckets(batch_size), **runner_options}
            return ASRRunner(model_on(devices[i % len(devices)]), backend=be,
                             max_new_tokens=max_new_tokens, use_graphs=use_graphs, timestamps=timestamps, **opts)

        def replica_factory(i: int) -> Recognize:
            runner = make_runner(i)
            if timestamps:
                return lambda audio: [TimedText(h.text, h.segments or []) for h in runner.recognize(audio)]
            return lambda audio: [h.text for h in runner.recognize(audio)]

        def compile_replica(i: int) -> int:
            return make_runner(i).warmup()

        # Whisper pads every window to 30 s, so mixing lengths in a batch costs nothing; other
        # encoders batch windows of similar length (5 s buckets).
        bucket_s = None if _model_type(path) == "whisper" else 5.0
        tr = cls(replica_factory, sample_rate=int(first.sample_rate),
                 max_audio_seconds=float(first.max_audio_seconds()), replicas=n, batch_size=batch_size,
                 overlap_s=overlap_s, bucket_s=bucket_s, model_name=resolved.name,
                 backend_name=be.name, compile_fn=compile_replica)
        tr.weights_sha256 = sha  # the weights loaded (checked above), not whatever is there now
        tr.fp8_encoder = fp8_encoder
        tr.batch_invariant = batch_invariant
        tr.dtype_name = str(dtype).removeprefix("torch.")  # what the weights were loaded in
        tr.no_speech_threshold = runner_options.get("no_speech_threshold")
        return tr

    def made_with(self) -> dict[str, Any]:
        """What each result record says of how it was made, besides the model's name: the
        weights' hash, dtype and window overlap, and the options that change the text when on
        (no-speech threshold, FP8 encoder GEMMs, batch invariance); what a resume compares."""
        made: dict[str, Any] = {"weights_sha256": self.weights_sha256}
        if self.dtype_name is not None:  # (None: a model plugged in as a replica factory)
            made["dtype"] = self.dtype_name
        made["overlap_s"] = self.overlap_s
        if self.no_speech_threshold is not None:
            made["no_speech_threshold"] = self.no_speech_threshold
        if self.fp8_encoder:
            made["encoder_gemms"] = "fp8"  # not bf16's exact tokens: say so in each record
        if self.batch_invariant:
            made["batch_invariant"] = True
        return made

    # ---- running ---------------------------------------------------------------------------

    def transcribe(self, inputs: Iterable[AudioInput]) -> list[TranscriptResult]:
        """Transcribe everything in ``inputs``; one result per input, in input order."""
        return list(self.transcribe_iter(inputs))

    def transcribe_iter(self, inputs: Iterable[AudioInput], lookahead: int | None = None
                        ) -> Iterator[TranscriptResult]:
        """Yield one result per input, in input order, as soon as it and all before it are
        done. Inputs are read ``lookahead`` at a time (default: 4 batches per replica); each
        block is ordered by duration before it goes to the pool.

        If another thread calls :meth:`close` meanwhile, the call ends cleanly, without an
        exception: results finished before the close are yielded as usual, every other input
        already read gets a result with ``error`` = :data:`CLOSED_ERROR`, and inputs not yet
        read are left in ``inputs`` (no result: compare the count with what you gave)."""
        block = lookahead or max(8, 4 * self.batch_size * self.replicas)
        m = TranscribeMetrics()
        start = time.perf_counter()
        self._running = (m, start)
        pending: dict[int, _Pending] = {}
        next_out = 0
        source = _Guarded(iter(inputs))
        stop = threading.Event()
        with self._lock:
            self._runs.add(stop)
        windows = self._windows(source, block, pending, m)
        outcomes = self._pool_map(_until(stop, windows))
        try:
            for win, out in outcomes:
                p = pending[win.idx]
                if isinstance(out, BaseException) or not isinstance(out, _Decoded):
                    p.result.error = p.result.error or _window_error(out, stop)
                    p.texts[win.win] = ""
                else:
                    p.texts[win.win] = out.text
                    p.heads_s[win.win] = out.head_s
                    p.speech[win.win] = out.speech_spans
                    p.voice += [(a + win.start_s, b + win.start_s) for a, b in out.voice_spans]
                    self._check_rate(p, win, out)
                p.left -= 1
                while next_out in pending and pending[next_out].done:
                    yield self._finish(pending.pop(next_out), m, start)
                    next_out += 1
            while next_out in pending:  # inputs that failed before producing any window (or cut by close())
                yield self._finish(_closed_if_unfinished(pending.pop(next_out)), m, start)
                next_out += 1
            source.reraise()  # the caller's iterable failed: every input read before it has its result
        finally:
            outcomes.close()  # cancels windows still waiting (the caller stopped early)
            windows.close()  # stops long files' reader threads at once
            with self._lock:
                self._runs.discard(stop)
            m.wall_s = time.perf_counter() - start
            self.last_metrics = m
            with self._lock:
                t = self.metrics
                t.items += m.items
                t.failed += m.failed
                t.audio_s += m.audio_s
                t.wall_s += m.wall_s
                t.windows += m.windows

    def running_rtfx(self) -> float:
        """RTFx of the ``transcribe_iter`` in progress (or the last one) up to now."""
        if self._running is None:
            return 0.0
        m, start = self._running
        wall = time.perf_counter() - start
        return m.audio_s / wall if wall > 0 else 0.0

    def compile_all(self) -> int:
        """Build every replica's runner and compile all its (graph, bucket) pairs ahead of
        time; returns how many graphs were compiled (0 on backends that run eagerly)."""
        if self._compile_fn is None:
            return 0
        return sum(int(self._compile_fn(i) or 0) for i in range(self.replicas))

    def _check_rate(self, p: _Pending, win: _Window, out: _Decoded) -> None:
        """Warn (on the result and in the log) about a window whose word rate is implausible."""
        words = len(out.text.split())
        rate = words / max(out.speech_s, 1e-9)
        if out.speech_s >= _MIN_SPEECH_S and rate < WARN_BELOW_WPS:
            what = "words may be missing"
        elif out.speech_s >= 2.0 and rate > WARN_ABOVE_WPS:
            what = "the model may have repeated itself"
        else:
            return
        a, b = p.spans_s[win.win]
        note = (f"window {win.win} ({a:.1f}-{b:.1f} s): {words} words in {out.speech_s:.1f} s of speech "
                f"({rate:.2f} words/s{', after re-decoding' if out.redecoded else ''}); {what}")
        p.result.warnings.append(note)
        log.warning("%s: %s", printable(p.result.path), note)

    def _finish(self, p: _Pending, m: TranscribeMetrics, start: float) -> TranscriptResult:
        r = p.result
        r.warnings.sort(key=lambda w: int(w.split()[1]))  # window order, whatever the finishing order
        if r.error is None:
            texts = [t or "" for t in p.texts]
            r.text = (stitch(texts, p.text_spans_s, seam_word_counts(texts, p.spans_s)) if len(texts) > 1
                      else texts[0].strip())
            segs = stitch_segments([segments_of(t) for t in p.texts], p.spans_s, p.speech)
            r.segments = segment_records(None if segs is None else clip_ends_to_speech(segs, p.voice))
            m.audio_s += r.duration_s
        else:
            r.text = ""
            m.failed += 1
        m.items += 1
        m.wall_s = time.perf_counter() - start
        return r

    def _windows(self, inputs: Iterator[AudioInput], block: int, pending: dict[int, _Pending],
                 m: TranscribeMetrics) -> Iterator[_Window]:
        """Read inputs ``block`` at a time, register each in ``pending`` and yield its windows:
        first those of the block's inputs that fit in memory whole, sorted by duration (longest
        first), then each long file's, streamed as it is read."""
        idx = 0
        while items := _take(inputs, block):
            numbered: list[_Window] = []
            streams: list[tuple[int, str]] = []
            for result, source in self._open_block(idx, items):
                pending[idx] = p = _Pending(result)
                if isinstance(source, np.ndarray):
                    numbered += self._cut(idx, source, p)
                elif source is not None:
                    p.read, p.long = False, result.duration_s > self.max_audio_seconds
                    streams.append((idx, source))
                idx += 1
            m.windows += len(numbered)
            # long files decode on their own threads while the short ones are recognized
            ahead = _StreamsAhead(streams, self._stream_source)
            try:
                for j in bucket_order([len(w.audio) for w in numbered], self.batch_size):
                    yield numbered[j]
                del numbered
                yield from self._streamed(ahead, pending, m)
            finally:
                ahead.close()
            if len(items) < block:
                return

    def _cut(self, idx: int, audio: np.ndarray, p: _Pending) -> list[_Window]:
        """Windows of a whole waveform (views of it), registered in ``p``."""
        bounds = window_bounds(len(audio), self.sample_rate, self.max_audio_seconds, self.overlap_s)
        out = [_Window(idx, k, audio[a:b], a / self.sample_rate, len(bounds) > 1,
                       speech_seconds(audio[a:b], self.sample_rate),
                       max(0, bounds[k - 1][1] - a) / self.sample_rate if k else 0.0)
               for k, (a, b) in enumerate(bounds)]
        for w in out:
            p.add(w, self.sample_rate)
        p.result.windows = len(out)
        return out

    def _streamed(self, ahead: _StreamsAhead, pending: dict[int, _Pending], m: TranscribeMetrics
                  ) -> Iterator[_Window]:
        """The long files' windows as their readers hand them out, registered in ``pending``;
        a file's read error becomes its error once its reader stops."""
        for i, kind, x in ahead.windows():
            p = pending[i]
            if kind == "window":
                w, speech = x
                win = _Window(i, w.index, w.audio, w.start_s, long=p.long or w.index > 0, speech_s=speech,
                              shared_s=_shared_s(p, w.start_s))
                p.add(win, self.sample_rate)
                p.result.duration_s = p.spans_s[-1][1]
                m.windows += 1
                yield win
                continue
            if kind == "error":
                self._stream_failed(p.result, x)
            p.read = True
            p.result.windows = len(p.texts)

    def _stream_source(self, path: str) -> Iterator[Any]:
        """A long file's windows as it is decoded: (``audio.StreamWindow``, seconds of speech)."""
        blocks = stream_audio(path, self.sample_rate)
        for w in stream_windows(blocks, self.sample_rate, self.max_audio_seconds, self.overlap_s):
            yield w, speech_seconds(w.audio, self.sample_rate)

    @classmethod
    def _stream_failed(cls, result: TranscriptResult, e: BaseException) -> None:
        """A read error at any point of a long file (a corrupt block, a truncated end) is the
        file's error; a missing decoder is not a bad file (it is raised, once)."""
        if isinstance(e, ImportError) or not isinstance(e, Exception):
            raise e
        cls._read_failed(result, str(e) if isinstance(e, AudioError) else _unreadable(e))

    def _open_block(self, first: int, items: list[AudioInput]) -> list[tuple[TranscriptResult, np.ndarray | str | None]]:
        """:meth:`_open` of each of ``items`` (numbered from ``first``), in input order, on the
        shared decode threads (soundfile and soxr release the GIL), so decoding and resampling
        keep up with an accelerator that recognizes thousands of audio seconds per second."""
        pool = _decode_pool()
        if pool is None or len(items) < 2:
            return [self._open(first + k, item) for k, item in enumerate(items)]
        return list(pool.map(self._open, range(first, first + len(items)), items))

    def _open(self, idx: int, item: AudioInput) -> tuple[TranscriptResult, np.ndarray | str | None]:
        """Decode one input whole, or name the file to stream when it is longer than one
        window or its decoded samples exceed :data:`MAX_WHOLE_BYTES`; a failure becomes a
        result with ``error`` set and no audio."""
        ref = None
        if isinstance(item, InputItem):
            ref, item = item.ref, item.path
        in_memory = isinstance(item, (np.ndarray, tuple))
        if not in_memory and not isinstance(item, (str, os.PathLike)):
            return self._read_failed(TranscriptResult(f"<input {idx}>", ref=ref), _unsupported(item)), None
        name = f"<array {idx}>" if in_memory else os.fspath(item)
        result = TranscriptResult(name, ref=ref)
        try:
            if isinstance(item, tuple):
                arr, rate = _array_and_rate(item)
                audio = waveform_from_array(arr, rate, self.sample_rate)
            elif isinstance(item, np.ndarray):
                audio = waveform_from_array(item, self.sample_rate, self.sample_rate)
            else:
                seconds, samples = audio_extent(name)
                if seconds > self.max_audio_seconds or 4 * samples > MAX_WHOLE_BYTES:
                    result.duration_s = seconds
                    return result, name
                audio = load_audio(name, self.sample_rate)
        except AudioError as e:
            return self._read_failed(result, str(e)), None
        except ImportError:
            raise  # a missing decoder is not a bad file: say what to install, once
        except Exception as e:  # never let one input stop the job
            return self._read_failed(result, _unreadable(e)), None
        result.duration_s = len(audio) / self.sample_rate
        return result, audio

    @staticmethod
    def _read_failed(result: TranscriptResult, reason: str) -> TranscriptResult:
        """Mark ``result`` as a read error (no audio time counted) and log it with its path."""
        result.error, result.duration_s, result.windows = reason, 0.0, 0
        log.warning("%s", printable(f"{result.path}: {reason}"))
        return result

    # ---- the pool ---------------------------------------------------------------------------

    def _pool_map(self, windows: Iterator[_Window]) -> Iterator[tuple[_Window, Any]]:
        """Run ``windows`` through the replica pool; yield (window, text or exception) in
        submission order."""
        pool = self._ensure_pool()
        yield from pool.map_items(windows)

    def _ensure_pool(self) -> Any:
        with self._lock:
            if self._pool is None:
                self._pool = _PoolAdapter(self._factory, self.replicas, self.batch_size,
                                          self.sample_rate, self._pool_options)
            return self._pool

    def pool_metrics(self) -> dict[str, Any]:
        """The replica pool's own counters (busy time per replica, queue depth...), if started."""
        return self._pool.metrics() if self._pool is not None else {}

    def close(self) -> None:
        """Stop the replica threads (the transcriber can be used again; it restarts them).

        A transcribe call running on another thread ends cleanly: batches already running
        finish, the rest of what it read gets :data:`CLOSED_ERROR` (see :meth:`transcribe_iter`)."""
        with self._lock:
            for stop in self._runs:
                stop.set()
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> Transcriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _PoolAdapter:
    """Binds the transcriber's windows to :class:`polyaccel.core.runtime.ReplicaPool`."""

    def __init__(self, factory: Callable[[int], Recognize], replicas: int, batch_size: int,
                 sample_rate: int, options: dict[str, Any]):
        from polyaccel.core.runtime import ReplicaPool

        def make(i: int) -> Callable[[list[_Window]], list[_Decoded]]:
            recognize = factory(i)

            def run(batch: list[_Window]) -> list[_Decoded]:
                texts = recognize([w.audio for w in batch])
                return [_plausible(w, t, recognize, sample_rate) for w, t in zip(batch, texts)]
            return run

        options = dict(options)
        bucket_s = options.pop("bucket_s", None)
        opts = {"queue_capacity": max(8, 4 * replicas * batch_size), "parallel_start": False,
                "name": "polyaccel-asr", **options}
        if bucket_s:  # variable-length encoders batch windows of similar length together
            opts.setdefault("batch_key", lambda w: math.ceil(len(w.audio) / sample_rate / bucket_s))
        self.pool = ReplicaPool(make, replicas, batch_size=batch_size,
                                work_units=lambda w: len(w.audio) / sample_rate, **opts)
        self.window = opts["queue_capacity"] + replicas * batch_size  # most windows in flight

    def map_items(self, windows: Iterator[_Window]) -> Iterator[tuple[_Window, Any]]:
        """(window, text or exception) in submission order, at most :attr:`window` in flight.

        Once the pool is closed, no window is taken from ``windows`` any more; those submitted
        still come back (finished, or cancelled), the one refused as :class:`TranscriberClosed`.
        Windows still waiting when the iterator is dropped are cancelled."""
        from polyaccel.core.runtime import PoolClosed

        inflight: deque[tuple[_Window, Any]] = deque()
        refused: _Window | None = None
        try:
            for w in windows:
                try:
                    inflight.append((w, self.pool.submit(w)))
                except PoolClosed:
                    refused = w
                    break
                while inflight and (len(inflight) >= self.window or inflight[0][1].done()):
                    yield _outcome(*inflight.popleft())
            while inflight:
                yield _outcome(*inflight.popleft())
            if refused is not None:
                yield refused, TranscriberClosed(CLOSED_ERROR)
        finally:
            for _, future in inflight:
                future.cancel()

    def metrics(self) -> dict[str, Any]:
        return self.pool.metrics().as_dict()

    def close(self) -> None:
        self.pool.close(cancel_pending=True)


def _outcome(w: _Window, future: Any) -> tuple[_Window, Any]:
    """(window, its text, or the exception it failed with), waiting for it if need be."""
    r = future.result()
    return w, (r.value if r.error is None else r.error)


def _until(stop: threading.Event, windows: Iterator[_Window]) -> Iterator[_Window]:
    """``windows`` until ``stop`` is set (no input is read after a close())."""
    for w in windows:
        if stop.is_set():
            return
        yield w


def _window_error(out: Any, stop: threading.Event) -> str:
    """A failed window's error: :data:`CLOSED_ERROR` when close() cancelled or refused it."""
    if stop.is_set() and isinstance(out, (CancelledError, TranscriberClosed)):
        return CLOSED_ERROR
    return f"recognition failed: {_short(out)}"


def _closed_if_unfinished(p: _Pending) -> _Pending:
    """``p``, with :data:`CLOSED_ERROR` if close() stopped the call before its windows were all done."""
    if not p.done and p.result.error is None:
        p.result.error = CLOSED_ERROR
    return p


# ---- re-decoding windows that lost words ---------------------------------------------------------


def _plausible(w: _Window, text: str, recognize: Recognize, sample_rate: int) -> _Decoded:
    """``text``, or, for a window of long audio that says too few words for its speech, the
    transcript of the window decoded again in pieces cut at pauses (if that has more words)."""
    if not isinstance(text, str):
        return text  # the pool reports it as a failure
    out = _redecoded_if_short(w, text, recognize, sample_rate)
    if w.long and isinstance(text, TimedText):  # where the seams count the speech segments cover
        out.speech_spans = speech_spans(w.audio, sample_rate)
    if isinstance(text, TimedText):  # where the segments' ends are clipped to
        out.voice_spans = voice_spans(w.audio, sample_rate)
    return out


def _redecoded_if_short(w: _Window, text: str, recognize: Recognize, sample_rate: int) -> _Decoded:
    """:func:`_plausible`'s transcript (its segments, if any, start where their speech does)."""
    speech = w.speech_s
    if w.long and isinstance(text, TimedText):  # with timestamps: seek past the last segment, as Whisper does
        text = decode_tail(w.audio, text, recognize, sample_rate)
    if not w.long or not _too_few_words(text, speech):
        return _Decoded(_trimmed(w, text, sample_rate), speech)
    again, head_s = _decode_in_pieces(w.audio, recognize, sample_rate, skip_head_s=min(DEFAULT_OVERLAP_S, w.shared_s),
                                      depth=2)
    if len(again.split()) > len(text.split()):
        return _Decoded(_trimmed(w, again, sample_rate), speech, redecoded=True, head_s=head_s)
    return _Decoded(_trimmed(w, text, sample_rate), speech)


def _trimmed(w: _Window, text: str, sample_rate: int) -> str:
    """A long file's window's segments starting where their speech does (:func:`trim_silent_starts`)."""
    return trim_silent_starts(w.audio, text, sample_rate) if w.long and isinstance(text, TimedText) else text


def _shared_s(p: _Pending, start_s: float) -> float:
    """Seconds from ``start_s`` that the last window registered in ``p`` also holds."""
    return max(0.0, p.spans_s[-1][1] - start_s) if p.spans_s else 0.0


def _too_few_words(text: str, speech_s: float) -> bool:
    return speech_s >= _MIN_SPEECH_S and len(text.split()) < REDECODE_BELOW_WPS * speech_s


def _decode_in_pieces(audio: np.ndarray, recognize: Recognize, sample_rate: int, *, skip_head_s: float,
                      depth: int) -> tuple[str, float]:
    """Decode ``audio`` as two pieces split at its quietest point near the middle; (the text,
    the seconds dropped at its head).

    The audio before the first pause in the first ``skip_head_s`` seconds (audio the previous
    window also holds: no more than the windows share) is dropped, so no piece starts in the
    middle of a word. A piece that still says too few words is split again, ``depth`` levels deep."""
    start = quietest_point(audio, sample_rate, 0.0, skip_head_s) if skip_head_s > 0 else 0
    audio = audio[start:]
    seconds = len(audio) / sample_rate
    cut = quietest_point(audio, sample_rate, seconds / 3, 2 * seconds / 3)
    parts = [(o, p) for o, p in ((0, audio[:cut]), (cut, audio[cut:])) if len(p) >= sample_rate // 10]
    pieces = [p for _, p in parts]
    texts = recognize(pieces)
    for k, (piece, text) in enumerate(zip(pieces, texts)):
        if depth > 1 and len(piece) >= 10 * sample_rate and _too_few_words(text, speech_seconds(piece, sample_rate)):
            again, _ = _decode_in_pieces(piece, recognize, sample_rate, skip_head_s=0.0, depth=depth - 1)
            texts[k] = again if len(again.split()) > len(text.split()) else text
    return joined(texts, [(start + o) / sample_rate for o, _ in parts]), start / sample_rate  # segments: from the window's start


# ---- helpers ----------------------------------------------------------------------------------


DECODE_THREADS = int(os.environ.get("POLYACCEL_DECODE_THREADS", "0")) or min(8, os.cpu_count() or 1)
"""Threads that decode and resample input files (``$POLYACCEL_DECODE_THREADS``; 1: the caller's)."""
_DECODE_POOL: Any = None


def _decode_pool() -> Any:
    """The process-wide decode thread pool (None with one thread), made on first use."""
    global _DECODE_POOL
    if DECODE_THREADS <= 1:
        return None
    if _DECODE_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        with _DECODE_LOCK:
            if _DECODE_POOL is None:
                _DECODE_POOL = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="polyaccel-decode")
    return _DECODE_POOL


_DECODE_LOCK = threading.Lock()


STREAM_AHEAD_WINDOWS = 2
"""Windows each long file may decode ahead of the replicas (30 s of 16 kHz float32: 1.9 MB each)."""


class _StreamsAhead:
    """Decodes a block's long files on their own threads, :data:`DECODE_THREADS` files at a time,
    each at most :data:`STREAM_AHEAD_WINDOWS` windows ahead of the consumer, and hands out
    their windows as they come (files interleave: windows are independent work, and results
    are put back in input order downstream). Workers only decode; every bookkeeping step
    stays with the consumer. With one decode thread the consumer decodes the files in turn.

    :meth:`windows` yields ``(idx, kind, payload)``: ``"window"`` with what ``source`` yields
    (a window and its speech seconds), then one ``"end"`` or ``"error"`` (the exception) per file."""

    def __init__(self, streams: list[tuple[int, str]], source: Callable[[str], Iterator[Any]]) -> None:
        import queue

        self._todo = list(streams)
        self._source = source
        self._q: Any = queue.Queue()
        self._stop = threading.Event()
        self._credits: dict[int, threading.Semaphore] = {}
        self._live = 0
        self._threaded = DECODE_THREADS > 1
        if self._threaded:
            for _ in range(min(DECODE_THREADS, len(self._todo))):
                self._start_next()

    def _start_next(self) -> None:
        if self._todo:
            idx, path = self._todo.pop(0)
            self._credits[idx] = threading.Semaphore(STREAM_AHEAD_WINDOWS)
            self._live += 1
            # a daemon thread per file: an interrupted job (Ctrl-C) never waits on a reader at exit
            threading.Thread(target=self._run, args=(idx, path), daemon=True,
                             name=f"polyaccel-stream-{idx}").start()

    def _run(self, idx: int, path: str) -> None:
        credit = self._credits[idx]
        try:
            for w in self._source(path):
                while not credit.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._q.put((idx, "window", w))
            self._q.put((idx, "end", None))
        except BaseException as e:  # handed to the consumer, which decides what it means
            self._q.put((idx, "error", e))

    def windows(self) -> Iterator[tuple[int, str, Any]]:
        if not self._threaded:
            for idx, path in self._todo:
                try:
                    for w in self._source(path):
                        yield idx, "window", w
                except Exception as e:
                    yield idx, "error", e
                else:
                    yield idx, "end", None
            return
        while self._live:
            idx, kind, x = self._q.get()
            if kind == "window":
                self._credits[idx].release()
            else:
                self._live -= 1
                self._start_next()
            yield idx, kind, x

    def close(self) -> None:
        self._stop.set()


def replicas_that_fit(wanted: int, free_bytes: int, state_bytes: int) -> int:
    """Replicas (at most ``wanted``, at least 1) whose decoder state fits in 90% of a device's
    ``free_bytes``: ``state_bytes`` at the largest batch bucket, twice over (the smaller buckets
    sum to about as much) and twice again (encoder activations, graph pools). 0: unknown, all fit."""
    if state_bytes <= 0:
        return wanted
    return max(1, min(wanted, int(0.9 * free_bytes) // (4 * state_bytes)))


class _Guarded:
    """The caller's input iterator; an exception it raises ends the input (as exhaustion
    would) and is raised again by :meth:`reraise` once the inputs read before it are done."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._error: BaseException | None = None

    def __iter__(self) -> _Guarded:
        return self

    def __next__(self) -> Any:
        if self._error is not None:
            raise StopIteration
        try:
            return next(self._it)
        except StopIteration:
            raise
        except Exception as e:
            self._error = e
            raise StopIteration from None

    def reraise(self) -> None:
        if self._error is not None:
            raise self._error


def _take(it: Iterator[Any], n: int) -> list[Any]:
    out = []
    for x in it:
        out.append(x)
        if len(out) == n:
            break
    return out


def _unsupported(item: Any) -> str:
    return (f"unsupported input of type {type(item).__name__}: give a path, an InputItem, a waveform "
            "array or an (array, sample_rate) tuple")


def _array_and_rate(item: tuple) -> tuple[np.ndarray, int]:
    """An ``(array, sample_rate)`` input, checked: the rate must be a whole number of Hz."""
    if len(item) != 2:
        raise AudioError(f"a tuple input is (array, sample_rate), got {len(item)} elements")
    arr, rate = item
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer, float, np.floating)) \
            or not math.isfinite(rate) or rate != int(rate):
        raise AudioError(f"sample rate must be a whole number of Hz, got {rate!r}")
    return arr, int(rate)


def _unreadable(e: Exception) -> str:
    """A file's error for an exception its reading raised (not an :class:`AudioError`)."""
    if isinstance(e, PermissionError):  # mode 000, an ACL, a file of another user
        return "permission denied: the file may not be read"
    return f"could not read: {_short(e)}"


def _short(e: Any) -> str:
    s = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else repr(e)
    return s.splitlines()[0][:200] if s else type(e).__name__


def _batch_buckets(batch_size: int) -> tuple[int, ...]:
    """Batch sizes a runner compiles: powers of two up to ``batch_size``, and it."""
    sizes = {batch_size}
    b = 1
    while b < batch_size:
        sizes.add(b)
        b *= 2
    return tuple(sorted(sizes))


def _resolve_model(path_or_name: str | os.PathLike) -> Any:
    from polyaccel.asr.weights import resolve

    return resolve(str(path_or_name))


def _weights_sha256(path: Path) -> str:
    from polyaccel.asr.weights import weights_sha256

    return weights_sha256(path)


def _weights_identity(path: Path) -> list[tuple]:
    from polyaccel.asr.weights import weights_identity

    return weights_identity(path)


def _model_type(path: Path) -> str:
    from polyaccel.asr.config_limits import read_json_object

    cfg = read_json_object(path / "config.json") if (path / "config.json").is_file() else {}
    return str(cfg.get("model_type", "whisper"))


def _load_model(path: Path, device: Any, dtype: Any) -> Any:
    """Load the ASR model in ``path`` (Whisper or ConformerAED, by ``config.json``). Weights that
    cannot be read (a cut-off or corrupt ``*.safetensors``) or do not fit the config, and a
    Whisper tokenizer that cannot be read, are a ``ValueError`` naming the file: found here, not
    as every input's error after it was decoded."""
    from safetensors import SafetensorError

    try:
        return _load_model_of_type(_model_type(path), path, device, dtype)
    except SafetensorError as e:
        raise ValueError(f"{path}: unreadable weights (a cut-off or corrupt *.safetensors file?): {e}") from None


def _load_model_of_type(kind: str, path: Path, device: Any, dtype: Any) -> Any:
    if kind == "whisper":
        from polyaccel.asr.whisper import WhisperASR

        model = WhisperASR.from_pretrained(path, device=device, dtype=dtype).eval()
        model.load_tokenizer()
        return model
    try:
        from polyaccel.asr.conformer import ConformerAED
    except ImportError:
        raise ValueError(f"{path}: model_type {kind!r} is not supported by this installation") from None
    return ConformerAED.from_pretrained(path, device=device, dtype=dtype).eval()

