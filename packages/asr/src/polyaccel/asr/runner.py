"""Batch recognition on one device: features -> encoder graph -> greedy decoding, each graph
compiled once per batch bucket by the backend.

A batch of ``n`` utterances is padded up to the smallest batch bucket >= ``n``; padding
rows never influence real ones (rows are independent, and padding rows are masked out of
the stopping rule), so the tokens are the same at every batch size.

Models whose cost follows the audio length (they have ``frame_bucket(num_samples)``, as
ConformerAED does) get variable-length batching: :meth:`ASRRunner.recognize` sorts the clips
by length and batches only clips of the same frame bucket, so each batch is padded to its
own bucket (encoder frames and decoder cross-attention) and a clip gets exactly the padding
it gets alone. Whisper pads everything to 30 s (it is trained so) and batches as given.

With graphs, one generated token is ONE graph replay: the decoder step, the logits rules,
the argmax and the bookkeeping (:func:`~polyaccel.asr.decoding.greedy_update`) are captured
together over per-bucket buffers the runner owns (its :class:`_Slot`), so the host only
launches a replay per token and looks at the ``finished`` flags every few steps.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from polyaccel.asr.decoding import GreedyBuffers, Hypothesis, LogitsRules, greedy_decode, greedy_update
from polyaccel.asr.interface import ASRModel, DecoderState
from polyaccel.core import Backend, GraphCache, GraphSpec, ShapeBuckets, select_backend

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

logger = logging.getLogger(__name__)


class ASRRunner:
    """Runs an :class:`ASRModel` over lists of waveforms with static-shape graphs.

    Args:
        model: the model (on the device the backend drives).
        backend: a backend name for :func:`polyaccel.core.select_backend` or a Backend.
        batch_buckets: batch sizes the graphs are compiled for; larger inputs are split.
        max_new_tokens: cap on generated tokens (default: cache length minus the prompt,
            as Hugging Face ``generate()`` does for Whisper).
        use_graphs: compile graphs with the backend (False: call the model eagerly).
        check_every: steps between host checks of "all rows finished".
        min_new_tokens: suppress ``eos`` until this many tokens (benchmarks: fixed work).
        timestamps: decode with timestamp tokens (Whisper: no ``<|notimestamps|>`` in the
            prompt, the timestamp rules inside the captured greedy step) and give each
            :class:`Hypothesis` its ``segments`` (seconds from the window's start).
        no_speech_threshold: a window whose no-speech probability (Whisper's
            ``<|nocaptions|>`` / ``<|nospeech|>`` right after the start token) is above it
            comes back with no text and no segments (its tokens kept); None: off. Models
            without such a token: ignored.
    """

    def __init__(self, model: ASRModel, backend: str | Backend = "cpu",
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, max_new_tokens: int | None = None,
                 use_graphs: bool = True, check_every: int = 4, min_new_tokens: int = 0,
                 timestamps: bool = False, no_speech_threshold: float | None = None) -> None:
        self.model = model
        self.no_speech_threshold = no_speech_threshold
        no_speech_id = getattr(model, "no_speech_id", None)
        self._no_speech_id = no_speech_id() if no_speech_threshold is not None and no_speech_id else None
        self.backend = select_backend(backend) if isinstance(backend, str) else backend
        self.buckets = ShapeBuckets({"batch": tuple(batch_buckets)})
        self.timestamps = None
        if timestamps:
            rules = getattr(model, "timestamp_rules", None)
            self.timestamps = rules() if rules is not None else None
            if self.timestamps is None:
                raise ValueError(f"{type(model).__name__} does not predict timestamps")
            self.prompt = model.prompt_ids(timestamps=True)
        else:
            self.prompt = model.prompt_ids()
        self.cache_len = model.max_decode_len
        room = self.cache_len - len(self.prompt)
        self.max_new_tokens = room if max_new_tokens is None else min(max_new_tokens, room)
        self.check_every = check_every
        self.min_new_tokens = min(min_new_tokens, self.max_new_tokens)
        self.vocab_size = int(model.config.vocab_size)
        self.graphs = None
        specs = {s.name: s for s in model.graph_specs(self.buckets.sizes["batch"])}
        self._decode_buckets = specs["decode_step"].buckets  # batch, and frames where decoding depends on them
        if use_graphs:
            greedy = GraphSpec("greedy_step", self._greedy_step, self._decode_buckets, self._no_example)
            self.graphs = GraphCache(self.backend, [*specs.values(), greedy])
        self._slots: dict[tuple[tuple[str, int], ...], _Slot] = {}
        self._eager_encode: set[tuple[tuple[str, int], ...]] = set()  # buckets whose capture was refused
        self._on_stream = self.backend.replica_stream(self.device)
        self._rules = LogitsRules(model.suppress_ids(), model.begin_suppress_ids(), model.eos_token_id,
                                  self.min_new_tokens)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def recognize(self, audio: list[np.ndarray]) -> list[Hypothesis]:
        """Greedy transcripts of mono float32 waveforms at the model's sample rate, in order."""
        out: list[Hypothesis | None] = [None] * len(audio)
        with self._on_stream():  # this runner's own stream: replicas on one device overlap
            for idx in self._batches(audio):
                for i, h in zip(idx, self._recognize_batch([audio[i] for i in idx]), strict=True):
                    out[i] = h
        return out  # type: ignore[return-value]

    def _batches(self, audio: list[np.ndarray]) -> list[list[int]]:
        """Indices of ``audio`` per model call, at most the largest batch bucket each: in input
        order, or, for models with length buckets, sorted by length (longest first) and
        never mixing two length buckets."""
        largest = self.buckets.max["batch"]
        bucket_of = getattr(self.model, "frame_bucket", None)
        if bucket_of is None:
            return [list(range(s, min(s + largest, len(audio)))) for s in range(0, len(audio), largest)]
        order = sorted(range(len(audio)), key=lambda i: -len(audio[i]))
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(bucket_of(len(audio[i])), []).append(i)
        return [g[s:s + largest] for _, g in sorted(groups.items(), reverse=True) for s in range(0, len(g), largest)]

    def _recognize_batch(self, audio: list[np.ndarray]) -> list[Hypothesis]:
        n = len(audio)
        bucket = {"batch": self.buckets.pick(batch=n)["batch"]}
        B = bucket["batch"]
        features, lengths = self.model.compute_features(audio)
        if B > n:  # padding rows: any finite input works, rows are independent
            features = F.pad(features, (0, 0, 0, 0, 0, B - n))
            lengths = F.pad(lengths, (0, B - n))
        encode = self._encoder(bucket, features.shape[-1])
        enc, enc_mask = encode(features, lengths)
        slot = self._slot(self._decode_bucket(B, features.shape[-1]))
        self.model.new_decoder_state(enc, enc_mask, self.cache_len, out=slot.state)
        no_speech_id, no_speech = self._no_speech_id, None
        if no_speech_id is not None and len(self.prompt) < 2:
            # The start token is the whole prompt (English-only Whisper with timestamps): its logits
            # come from a step of their own; the first generated step writes that cache entry again.
            buf = slot.buffers
            buf.position.zero_()
            buf.tokens.fill_(self.prompt[0])
            no_speech = torch.softmax(slot.step(buf.tokens, buf.position)[:n].float(), dim=-1)[:, no_speech_id]
            no_speech_id = None
        hyps = greedy_decode(slot.step, batch=B, num_real=n, prompt=self.prompt, eos_id=self.model.eos_token_id,
                             max_new_tokens=self.max_new_tokens, rules=self._rules, device=self.device,
                             check_every=self.check_every, buffers=slot.buffers, advance=slot.advance,
                             vocab_size=self.vocab_size, timestamps=self.timestamps,
                             no_speech_id=no_speech_id)
        for h, p in zip(hyps, no_speech.tolist() if no_speech is not None else []):
            h.no_speech_prob = p
        for h, a in zip(hyps, audio):
            if h.no_speech_prob is not None and h.no_speech_prob > self.no_speech_threshold:
                h.text, h.segments = "", [] if self.timestamps is not None else None
                continue
            h.text = self.model.decode_text(h.tokens)
            if self.timestamps is not None:
                window_s = min(len(a) / self.model.sample_rate, self.model.max_audio_seconds())
                h.segments = self.timestamps.segments(h.tokens, self.model.decode_text, window_s)
        return hyps

    def warmup(self) -> int:
        """Compile every graph of every batch bucket now (instead of at first use)."""
        if self.graphs is None:
            return 0
        with self._on_stream():
            for bucket in self._decode_buckets.all():
                self._slot(bucket)
            for bucket in self.graphs.specs["encode"].buckets.all():
                self.graphs.get("encode", bucket)
        return len(self.graphs)

    # ---- per-bucket state and graphs --------------------------------------------------------
    def _encoder(self, bucket: dict[str, int], frames: int) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        """The encode graph of a batch's bucket; the model's eager ``encode`` without graphs or
        where the backend refused the capture (logged once per bucket; the same results)."""
        if self.graphs is None:
            return self.model.encode
        enc_bucket = dict(bucket)
        if "frames" in self.graphs.specs["encode"].buckets.sizes:  # models with frame buckets
            enc_bucket["frames"] = frames
        key = tuple(sorted(enc_bucket.items()))
        if key in self._eager_encode:
            return self.model.encode
        try:
            return self.graphs.get("encode", enc_bucket)
        except RuntimeError as e:  # a capture the backend refuses: this bucket encodes eagerly
            logger.warning("encoding bucket %s without graphs: capture failed (%s)", enc_bucket, e)
            self._eager_encode.add(key)
            return self.model.encode

    def _decode_bucket(self, B: int, frames: int) -> tuple[tuple[str, int], ...]:
        """The decode graphs' bucket of a batch: its batch bucket, and its feature frames
        where the decode graphs are per frame bucket."""
        if "frames" in self._decode_buckets.sizes:
            return (("batch", B), ("frames", frames))
        return (("batch", B),)

    def _slot(self, key: tuple[tuple[str, int], ...] | dict[str, int]) -> _Slot:
        """The decoder state, greedy buffers and step functions of decode bucket ``key``; the
        graphs are compiled over exactly these tensors, so their in-place updates are ours."""
        key = tuple(sorted(dict(key).items()))
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        bucket = dict(key)
        B = bucket["batch"]
        spec = {s.name: s for s in self.model.graph_specs((B,))}["decode_step"]
        state = DecoderState(*spec.example_inputs(bucket)[2:])
        buf = GreedyBuffers.allocate(B, self.max_new_tokens, self.device)
        twin = next((s for k, s in self._slots.items() if dict(k)["batch"] == B), None)
        if twin is not None:
            # One batch runs at a time, so the frame buckets of one batch size share the
            # self-attention cache (the big tensors) and the greedy buffers.
            state.self_k, state.self_v, buf = twin.state.self_k, twin.state.self_v, twin.buffers
        slot = None
        if self.graphs is not None:
            try:
                slot = self._graphed_slot(bucket, state, buf)
            except RuntimeError as e:  # a capture the backend refuses: this bucket decodes eagerly
                logger.warning("decoding batch bucket %s without graphs: capture failed (%s)", bucket, e)
        if slot is None:
            def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
                return self.model.decode_step(tokens, position, state)
            slot = _Slot(state, buf, step, None)
        self._slots[key] = slot
        return slot

    def _graphed_slot(self, bucket: dict[str, int], state: DecoderState, buf: GreedyBuffers) -> _Slot:
        """The graphed step functions of a decode bucket, compiled over ``state`` and ``buf``."""
        decode = self.graphs.get("decode_step", bucket, example_inputs=[buf.tokens, buf.position, *state.tensors()])
        bias = torch.zeros(self.vocab_size, device=self.device)
        greedy = self.graphs.get("greedy_step", bucket, example_inputs=[*buf.tensors(), bias, *state.tensors()])
        last: list[torch.Tensor | None] = [None]

        def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
            return decode(tokens, position, *state.tensors())

        def advance(bias_V: torch.Tensor) -> None:
            if bias_V is not last[0]:  # the rules hand out one tensor per kind of step
                bias.copy_(bias_V)
                last[0] = bias_V
            greedy(*buf.tensors(), bias, *state.tensors())
        return _Slot(state, buf, step, advance)

    def _greedy_step(self, tokens, position, finished, logprob_sum, counted, out, step, bias, *state) -> torch.Tensor:
        """Decoder step + logits rules + argmax + bookkeeping, all in place (one graph)."""
        buf = GreedyBuffers(tokens, position, finished, logprob_sum, counted, out, step)
        greedy_update(self.model.decode_step(tokens, position, DecoderState(*state)), bias, buf,
                      self.model.eos_token_id, self.timestamps)
        return finished

    @staticmethod
    def _no_example(bucket: dict[str, int]) -> list[torch.Tensor]:
        raise RuntimeError("greedy_step is compiled only over a runner's own buffers (ASRRunner._slot)")


@dataclasses.dataclass(slots=True)
class _Slot:
    """What one batch bucket owns: decoder state, greedy buffers, the prompt step, the fused step."""

    state: DecoderState
    buffers: GreedyBuffers
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    advance: Callable[[torch.Tensor], None] | None
