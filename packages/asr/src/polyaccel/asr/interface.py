"""What an ASR model gives the pipeline: features, a static-shape encoder, a one-token
decoder step over a preallocated cache, and its tokenizer. Whisper and ConformerAED both
implement :class:`ASRModel`; decoding (:mod:`polyaccel.asr.decoding`) and the transcriber
are written once against it.

Shape legend: B batch, M mel bins, F feature frames, S encoder frames, D model dim,
L decoder layers, NH heads, Dh head dim, C max decoder length (cache size), V vocab.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from polyaccel.core.graphs import GraphSpec


@dataclasses.dataclass
class DecoderState:
    """Everything one decode step reads and updates in place (fixed shapes per batch bucket).

    self_k/self_v: [L, B, NH, C, Dh] self-attention cache, written at ``position``.
    cross_k/cross_v: [L, B, NH, S, Dh] cross-attention K/V, computed once per utterance.
    enc_mask: [B, S] bool, True where the encoder frame is real (not padding).
    cross_scale: None, or [2, L, B, NH, S] fp32 when cross_k/cross_v hold e4m3 rows: key
    (or value) s stands for ``cross_k[..., s, :] * cross_scale[0, ..., s]`` (``[1]``: values).
    """

    self_k: torch.Tensor
    self_v: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor
    enc_mask: torch.Tensor
    cross_scale: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        made = [self.self_k, self.self_v, self.cross_k, self.cross_v, self.enc_mask]
        return made if self.cross_scale is None else [*made, self.cross_scale]

    def cross_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s (key scales, value scales) [B, NH, S], or None (K/V not e4m3)."""
        return None if self.cross_scale is None else (self.cross_scale[0, layer], self.cross_scale[1, layer])

    @classmethod
    def start(cls, cross_k: torch.Tensor, cross_v: torch.Tensor, enc_mask: torch.Tensor, max_len: int,
              out: DecoderState | None = None) -> DecoderState:
        """A state for new utterances: these cross-attention K/V [L, B, NH, S, Dh] and mask,
        and an empty self-attention cache of ``max_len`` positions. With ``out`` (same shapes)
        everything is written into it instead, so captured graphs keep reading its memory."""
        if out is not None:
            out.cross_k.copy_(cross_k)
            out.cross_v.copy_(cross_v)
            out.enc_mask.copy_(enc_mask)
            out.self_k.zero_()
            out.self_v.zero_()
            return out
        L, B, NH, _, Dh = cross_k.shape
        self_k = cross_k.new_zeros(L, B, NH, max_len, Dh)
        return cls(self_k, torch.zeros_like(self_k), cross_k.contiguous(), cross_v.contiguous(),
                   enc_mask.contiguous().clone())


class ASRModel(nn.Module, abc.ABC):
    """An attention encoder-decoder speech recognizer with static-shape graphs.

    Subclasses set ``sample_rate``, ``n_mels``, ``max_decode_len`` and the token ids, and
    implement the abstract methods. All tensors live on the model's device.
    """

    sample_rate: int = 16000
    n_mels: int = 80
    max_decode_len: int = 448
    eos_token_id: int = 0

    @property
    def device(self) -> torch.device:
        """Where the weights live (and where every tensor the model returns lives)."""
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (features are returned in it)."""
        return next(self.parameters()).dtype

    # ---- front end ---------------------------------------------------------------
    @abc.abstractmethod
    def compute_features(self, audio: list[np.ndarray], num_frames: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features for mono float32 waveforms at ``sample_rate``.

        Returns (features [B, M, F] in the model's dtype on its device, lengths [B] int64
        valid frames). ``num_frames`` pads/crops F to a bucket size (Whisper: always 3000).
        """

    @abc.abstractmethod
    def max_audio_seconds(self) -> float:
        """Longest audio one encoder call accepts; longer audio is chunked by the pipeline."""

    # ---- encoder -----------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, M, F], lengths [B] -> (encoder hidden [B, S, D], encoder mask [B, S] bool)."""

    # ---- decoder -----------------------------------------------------------------
    @abc.abstractmethod
    def prompt_ids(self) -> list[int]:
        """Tokens fed before the first generated token (e.g. <|startoftranscript|>...)."""

    def decode_state_bytes(self, batch: int) -> int:
        """Bytes of decoder state (self-attention cache, cross-attention K/V) a runner holds for
        a batch bucket of ``batch`` rows; 0 when the model cannot say."""
        return 0

    @abc.abstractmethod
    def new_decoder_state(self, enc: torch.Tensor, enc_mask: torch.Tensor, max_len: int,
                          out: DecoderState | None = None) -> DecoderState:
        """Allocate the static self-attention cache of ``max_len`` positions and compute the
        cross-attention K/V from ``enc`` once. With ``out`` (a state of the same shapes), write
        into it in place and return it, so captured graphs keep reading the same memory."""

    @abc.abstractmethod
    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """One decoder step for every sequence: tokens [B] int64 at ``position`` (int64 [B]),
        writes K/V at ``position`` into ``state`` in place, returns logits [B, V] (fp32).

        Must be capturable in a CUDA graph: no host syncs, no shape-dependent Python branches.
        """

    @abc.abstractmethod
    def decode_text(self, ids: list[int]) -> str:
        """Token ids (generated part only) -> text, special tokens removed."""

    def suppress_ids(self) -> list[int]:
        """Token ids never generated (Whisper's suppress_tokens); empty by default."""
        return []

    def begin_suppress_ids(self) -> list[int]:
        """Token ids not allowed as the first generated token (Whisper's
        begin_suppress_tokens); empty by default."""
        return []

    # ---- static graphs -------------------------------------------------------------
    def graph_specs(self, batch_buckets: Sequence[int]) -> list[GraphSpec]:
        """``encode`` (features [B, M, F], lengths [B] -> enc [B, S, D], enc mask [B, S]) and ``decode_step`` (tokens [B],
        position [B], then ``DecoderState.tensors()`` -> logits [B, V] fp32) per batch bucket,
        as :class:`polyaccel.core.graphs.GraphSpec`s; the runner compiles them through
        :class:`polyaccel.core.graphs.GraphCache`."""
        raise NotImplementedError(f"{type(self).__name__} declares no static graphs")
