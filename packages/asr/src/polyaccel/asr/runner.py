"""Batch recognition on one device: features -> encoder graph -> greedy decoding through the
decoder-step graph, each compiled once per batch bucket by the backend.

A batch of ``n`` utterances is padded up to the smallest batch bucket >= ``n``; padding
rows never influence real ones (rows are independent, and padding rows are masked out of
the stopping rule), so the tokens are the same at every batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from polyaccel.asr.decoding import Hypothesis, LogitsRules, greedy_decode
from polyaccel.asr.interface import ASRModel, DecoderState
from polyaccel.core import Backend, GraphCache, ShapeBuckets, select_backend

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


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
    """

    def __init__(self, model: ASRModel, backend: str | Backend = "cpu",
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, max_new_tokens: int | None = None,
                 use_graphs: bool = True, check_every: int = 4, min_new_tokens: int = 0) -> None:
        self.model = model
        self.backend = select_backend(backend) if isinstance(backend, str) else backend
        self.buckets = ShapeBuckets({"batch": tuple(batch_buckets)})
        self.prompt = model.prompt_ids()
        self.cache_len = model.max_decode_len
        room = self.cache_len - len(self.prompt)
        self.max_new_tokens = room if max_new_tokens is None else min(max_new_tokens, room)
        self.check_every = check_every
        self.min_new_tokens = min(min_new_tokens, self.max_new_tokens)
        self.graphs = GraphCache(self.backend, model.graph_specs(self.buckets.sizes["batch"])) if use_graphs else None
        self._states: dict[int, DecoderState] = {}
        self._rules = LogitsRules(model.suppress_ids(), model.begin_suppress_ids())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def recognize(self, audio: list[np.ndarray]) -> list[Hypothesis]:
        """Greedy transcripts of mono float32 waveforms at the model's sample rate, in order."""
        largest = self.buckets.max["batch"]
        out: list[Hypothesis] = []
        for start in range(0, len(audio), largest):
            out += self._recognize_batch(audio[start:start + largest])
        return out

    def _recognize_batch(self, audio: list[np.ndarray]) -> list[Hypothesis]:
        n = len(audio)
        bucket = {"batch": self.buckets.pick(batch=n)["batch"]}
        B = bucket["batch"]
        features, lengths = self.model.compute_features(audio)
        if B > n:  # padding rows: any finite input works, rows are independent
            features = F.pad(features, (0, 0, 0, 0, 0, B - n))
            lengths = F.pad(lengths, (0, B - n))
        if self.graphs is not None:
            enc_bucket = dict(bucket)
            if "frames" in self.graphs.specs["encode"].buckets.sizes:  # models with frame buckets
                enc_bucket["frames"] = features.shape[-1]
            enc, enc_mask = self.graphs("encode", enc_bucket, features, lengths)
        else:
            enc, enc_mask = self.model.encode(features, lengths)
        state = self._decoder_state(B, enc, enc_mask)

        if self.graphs is not None:
            tensors = state.tensors()
            # The persistent per-bucket state doubles as the graph's input buffers, so a backend
            # that keeps its example inputs (CUDA graphs) updates this very cache in place.
            # A capture's warm-up may write at position 0, which the first prompt step overwrites.
            zeros = torch.zeros(B, dtype=torch.int64, device=self.device)
            graph = self.graphs.get("decode_step", bucket, example_inputs=[zeros, zeros.clone(), *tensors])

            def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
                return graph(tokens, position, *tensors)
        else:
            def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
                return self.model.decode_step(tokens, position, state)

        hyps = greedy_decode(step, batch=B, num_real=n, prompt=self.prompt, eos_id=self.model.eos_token_id,
                             max_new_tokens=self.max_new_tokens, rules=self._rules,
                             device=self.device, check_every=self.check_every,
                             min_new_tokens=self.min_new_tokens)
        for h in hyps:
            h.text = self.model.decode_text(h.tokens)
        return hyps

    def _decoder_state(self, B: int, enc: torch.Tensor, enc_mask: torch.Tensor) -> DecoderState:
        """One state per bucket, reused across batches so captured graphs read the same memory."""
        state = self.model.new_decoder_state(enc, enc_mask, self.cache_len, out=self._states.get(B))
        self._states[B] = state
        return state
