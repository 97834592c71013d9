"""Whisper (Radford et al., 2022, "Robust Speech Recognition via Large-Scale Weak
Supervision") as a polyaccel :class:`~polyaccel.asr.interface.ASRModel`.

One file, top to bottom: config, log-mel front end, attention, encoder and decoder layers,
encoder, decoder, and the model with its static-shape graphs. It loads Hugging Face
Whisper checkpoints (``config.json`` + ``model.safetensors``; parameter names match, minus
the ``model.`` prefix) and gives the same greedy tokens as ``transformers``' ``generate()``.

Decoding runs one token per call over a preallocated self-attention cache of ``C`` positions
written in place at ``position`` (a scatter; no host syncs, no data-dependent shapes), so a
backend can capture ``decode_step`` once per batch bucket. Cross-attention K/V are computed
once per utterance in :meth:`WhisperASR.new_decoder_state`.

Shape legend: B batch, N audio samples, M mel bins, F feature frames (3000 per 30 s),
S encoder frames (F / 2 = 1500), T decoder tokens, C cache length (max_target_positions),
D model dim, NH heads, Dh head dim, L decoder layers, V vocab, K n_fft // 2 + 1 bins.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from polyaccel.asr.batch_invariant import conv1d_as_gemm, fixed_rows_linear
from polyaccel.asr.config_limits import check_sizes, check_weights_fit
from polyaccel.asr.decoding import TimestampRules
from polyaccel.asr.interface import ASRModel, DecoderState
from polyaccel.asr.upload import padded_batch
from polyaccel.core import ops
from polyaccel.core.graphs import GraphSpec, ShapeBuckets

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_NO_TIMESTAMPS_ID = 50362  # <|notimestamps|> of the English-only checkpoints


# ---- config ----------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True)
class WhisperConfig:
    """Architecture and decoding facts of one checkpoint.

    Read from a Hugging Face directory by :meth:`from_pretrained`: dimensions from
    ``config.json``, token ids and suppression rules from ``generation_config.json``
    (falling back to ``config.json``).
    """

    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_attention_heads: int = 6
    decoder_ffn_dim: int = 1536
    vocab_size: int = 51864
    max_source_positions: int = 1500
    max_target_positions: int = 448
    layer_norm_eps: float = 1e-5
    # decoding
    decoder_start_token_id: int = 50257
    eos_token_id: int = 50256
    no_timestamps_token_id: int | None = _NO_TIMESTAMPS_ID
    max_initial_timestamp_index: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    is_multilingual: bool = False
    lang_to_id: dict[str, int] = dataclasses.field(default_factory=dict)
    task_to_id: dict[str, int] = dataclasses.field(default_factory=dict)
    # audio front end
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_seconds: int = 30

    @property
    def n_samples(self) -> int:
        return self.sample_rate * self.chunk_seconds

    @property
    def n_frames(self) -> int:
        return self.n_samples // self.hop_length

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> WhisperConfig:
        from polyaccel.asr.config_limits import read_json_object

        path = Path(path)
        cfg = read_json_object(path / "config.json")
        if cfg.get("model_type") != "whisper":
            raise ValueError(f"{path}/config.json: model_type {cfg.get('model_type')!r} is not 'whisper'")
        gen_path = path / "generation_config.json"
        gen = read_json_object(gen_path) if gen_path.is_file() else {}
        if cfg.get("activation_function", "gelu") != "gelu" or cfg.get("scale_embedding", False):
            raise ValueError(f"{path}: only Whisper's gelu activation without embedding scaling is supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in fields}
        for k in ("decoder_start_token_id", "eos_token_id", "no_timestamps_token_id", "max_initial_timestamp_index",
                  "suppress_tokens",
                  "begin_suppress_tokens", "is_multilingual", "lang_to_id", "task_to_id"):
            if gen.get(k) is not None:
                kw[k] = gen[k]
        if isinstance(kw.get("eos_token_id"), list) and kw["eos_token_id"]:
            kw["eos_token_id"] = kw["eos_token_id"][0]
        for k in ("suppress_tokens", "begin_suppress_tokens"):
            kw[k] = tuple(kw[k]) if isinstance(kw.get(k), list) else kw.get(k) or ()
        kw.setdefault("is_multilingual", cfg.get("vocab_size", 51864) >= 51865)
        vocab = kw.get("vocab_size", 51864)
        if "no_timestamps_token_id" not in kw and isinstance(vocab, int) and vocab <= _NO_TIMESTAMPS_ID:
            kw["no_timestamps_token_id"] = None  # not named, and the default is beyond this vocabulary
        config = cls(**kw)
        check_sizes(config, path)  # before any module or buffer of these sizes is made
        check_decoding(config, path)
        if config.n_frames != 2 * config.max_source_positions:
            raise ValueError(f"{path}/config.json: a {config.chunk_seconds} s window at {config.sample_rate} Hz, "
                             f"hop {config.hop_length}, is {config.n_frames} frames; the encoder takes "
                             f"{2 * config.max_source_positions} (2 x max_source_positions)")
        return config


def check_decoding(config: WhisperConfig, path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming the files when a decoding field of ``config`` is not what
    decoding indexes with: token ids (start, eos, ``<|notimestamps|>``, suppressed tokens,
    ``lang_to_id``/``task_to_id``) that are not integers in [0, vocab_size), a
    ``max_initial_timestamp_index`` that is not an integer >= 0, a ``layer_norm_eps`` that is
    not a finite number > 0, an ``is_multilingual`` that is not true or false. Without this a
    corrupt or hand-edited config failed every file at recognition, or decoded garbage (an
    eos id beyond the vocabulary never ends a text)."""
    where = f"{path}/config.json or generation_config.json"
    vocab = config.vocab_size

    def bad(name: str, value: Any, want: str) -> ValueError:
        return ValueError(f"{where}: {name}={_short(value)} is not {want} (a corrupt or hand-edited config?)")

    def is_id(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab

    token_id = f"a token id in [0, {vocab})"
    for name in ("decoder_start_token_id", "eos_token_id"):
        if not is_id(getattr(config, name)):
            raise bad(name, getattr(config, name), token_id)
    if config.no_timestamps_token_id is not None and not is_id(config.no_timestamps_token_id):
        raise bad("no_timestamps_token_id", config.no_timestamps_token_id, token_id)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        ids = getattr(config, name)
        if not isinstance(ids, tuple) or not all(is_id(i) for i in ids):
            raise bad(name, ids, f"a list of token ids in [0, {vocab})")
    mi = config.max_initial_timestamp_index
    if mi is not None and (isinstance(mi, bool) or not isinstance(mi, int) or mi < 0):
        raise bad("max_initial_timestamp_index", mi, "an integer >= 0")
    eps = config.layer_norm_eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise bad("layer_norm_eps", eps, "a number in (0, 1)")
    if not isinstance(config.is_multilingual, bool):
        raise bad("is_multilingual", config.is_multilingual, "true or false")
    for name in ("lang_to_id", "task_to_id"):
        table = getattr(config, name)
        if not isinstance(table, dict) or not all(isinstance(k, str) and is_id(v) for k, v in table.items()):
            raise bad(name, table, f"an object of token ids in [0, {vocab})")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- log-mel front end --------------------------------------------------------------------

def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    log_step = np.log(6.4) / 27.0
    return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / log_step)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    log_step = np.log(6.4) / 27.0
    return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp(log_step * (m - 15.0)))


def mel_filterbank(n_mels: int, n_fft: int = 400, sample_rate: int = 16000,
                   fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Triangular mel filters with Slaney area normalization, float64 [K, M].

    Each filter rises from mel point ``i`` to ``i + 1`` and falls to ``i + 2`` (points evenly
    spaced in mel between ``fmin`` and ``fmax``) and is scaled by ``2 / bandwidth_hz`` so all
    filters have equal area -- Whisper's front end (the librosa default).
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_hz = np.linspace(0.0, sample_rate // 2, n_fft // 2 + 1)
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    width = np.diff(edges_hz)                                   # [M + 1]
    dist = edges_hz[None, :] - fft_hz[:, None]                  # [K, M + 2]
    rising = -dist[:, :-2] / width[:-1]
    falling = dist[:, 2:] / width[1:]
    filters = np.maximum(0.0, np.minimum(rising, falling))      # [K, M]
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


class LogMel(nn.Module):
    """Whisper's log-mel spectrogram on the model's device.

    Waveforms [B, N] (N = 30 s of samples) -> [B, M, F] float32: STFT (Hann window of
    ``n_fft``, hop ``hop_length``, reflect-padded, last frame dropped), power, mel filters,
    ``log10`` clamped at 1e-10, floored at (per-utterance max - 8), then ``(x + 4) / 4``.
    """

    def __init__(self, n_mels: int, n_fft: int = 400, hop_length: int = 160, sample_rate: int = 16000) -> None:
        super().__init__()
        self.n_mels, self.n_fft, self.hop_length, self.sample_rate = n_mels, n_fft, hop_length, sample_rate
        self._make_buffers(None)

    def _make_buffers(self, device: torch.device | None) -> None:
        filters = mel_filterbank(self.n_mels, self.n_fft, self.sample_rate).astype(np.float32)
        self.register_buffer("window", torch.hann_window(self.n_fft, device=device), persistent=False)
        self.register_buffer("filters_MK", torch.from_numpy(filters.T.copy()).to(device), persistent=False)

    def _apply(self, fn, recurse=True):
        # The front end stays fp32 whatever the model dtype: recompute rather than cast.
        super()._apply(fn, recurse)
        self._make_buffers(self.window.device)
        return self

    def forward(self, audio_BN: torch.Tensor) -> torch.Tensor:
        stft = torch.stft(audio_BN.float(), self.n_fft, self.hop_length, window=self.window, return_complex=True)
        power_BKF = (stft[..., :-1].abs() ** 2).contiguous()
        log_BMF = torch.clamp(self.filters_MK @ power_BKF, min=1e-10).log10()
        peak = log_BMF.amax(dim=(1, 2), keepdim=True)
        return (torch.maximum(log_BMF, peak - 8.0) + 4.0) / 4.0


# ---- attention ---------------------------------------------------------------------------

class WhisperAttention(nn.Module):
    """Multi-head attention with Whisper's projections (no bias on ``k_proj``)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        return x_BTD.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def query(self, x_BTD: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """[B, T, D] -> q [B, NH, T, Dh]. ``invariant``: batch-invariant kernels (decoder steps)."""
        return self._heads(_proj(self.q_proj, x_BTD, invariant))

    def key_value(self, x_BTD: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, D] -> (k, v) [B, NH, T, Dh]."""
        return self._heads(_proj(self.k_proj, x_BTD, invariant)), self._heads(_proj(self.v_proj, x_BTD, invariant))

    def attend(self, q_BHTd: torch.Tensor, k_BHSd: torch.Tensor, v_BHSd: torch.Tensor,
               mask: torch.Tensor | None = None, causal: bool = False, invariant: bool = False,
               kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Softmax attention then the output projection: -> [B, T, D].

        SDPA rather than ``ops.attention``: it is the fused kernel every backend already has,
        and the reference op's explicit fp32 scores would cost [B, NH, S, S] memory here.
        ``invariant``: the batch-invariant kernels (:mod:`polyaccel.asr.batch_invariant`).
        ``kv_scales``: k and v are e4m3 rows with these scales [B, NH, S] (decoder steps).
        """
        if kv_scales is not None:
            if q_BHTd.shape[2] != 1:
                raise ValueError("e4m3 keys and values are read by decoder steps (one query token) only")
            o_BHTd = ops.decode_attention(q_BHTd, k_BHSd, v_BHSd, mask, *kv_scales)
        elif invariant and q_BHTd.shape[2] == 1:  # a decoder step: the same key split at every batch
            o_BHTd = ops.decode_attention(q_BHTd, k_BHSd, v_BHSd, mask)
        else:
            o_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BHSd, v_BHSd, attn_mask=mask, is_causal=causal)
        B, _, T, _ = o_BHTd.shape
        return _proj(self.out_proj, o_BHTd.transpose(1, 2).reshape(B, T, -1), invariant)

    def fused_self_attention(self, ln: nn.LayerNorm, x_B1D: torch.Tensor, position_B: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """``x + self_attention(ln(x))`` for one token per row in three fused ops: norm and
        q/k/v projections with this token's k, v written into the cache at ``position_B``;
        attention to cache positions ``<= position_B``; output projection with the residual."""
        q_BH1d = ops.ln_qkv_into_cache_(x_B1D, ln.weight, ln.bias, ln.eps,
                                        (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight),
                                        (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias),
                                        cache_k, cache_v, position_B)
        return self._output_residual(ops.cached_decode_attention(q_BH1d, cache_k, cache_v, position_B), x_B1D)

    def fused_cross_attention(self, ln: nn.LayerNorm, x_B1D: torch.Tensor, cross_k: torch.Tensor,
                              cross_v: torch.Tensor,
                              kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x + cross_attention(ln(x))`` for one token per row in fused ops (``kv_scales``:
        see :meth:`attend`)."""
        q_B1D = ops.ln_linear(x_B1D, ln.weight, ln.bias, ln.eps, self.q_proj.weight, self.q_proj.bias)
        o_BH1d = ops.decode_attention(self._heads(q_B1D), cross_k, cross_v, None, *(kv_scales or (None, None)))
        return self._output_residual(o_BH1d, x_B1D)

    def _output_residual(self, o_BH1d: torch.Tensor, x_B1D: torch.Tensor) -> torch.Tensor:
        o_B1D = o_BH1d.transpose(1, 2).reshape(x_B1D.shape)
        return ops.linear_residual(o_B1D, self.out_proj.weight, self.out_proj.bias, x_B1D)


def _proj(linear: nn.Module, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``linear(x)``; ``invariant``: on fixed row blocks (the same bits at every batch size)."""
    return fixed_rows_linear(x, linear.weight, linear.bias) if invariant else linear(x)


def _layer_norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return ops.layer_norm(x, ln.weight, ln.bias, ln.eps)


def _fused_mlp(ln: nn.LayerNorm, fc1: nn.Linear, fc2: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``x + fc2(gelu(fc1(ln(x))))`` in two fused ops."""
    h = ops.ln_linear(x, ln.weight, ln.bias, ln.eps, fc1.weight, fc1.bias, activation="gelu")
    return ops.linear_residual(h, fc2.weight, fc2.bias, x)


def _mlp(fc1: nn.Module, fc2: nn.Module, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    if invariant:
        return _proj(fc2, F.gelu(_proj(fc1, x, invariant)), invariant)
    return ops.ffn(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, activation="gelu")


# ---- layers ------------------------------------------------------------------------------

class WhisperEncoderLayer(nn.Module):
    """Pre-LN transformer block: self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h = _layer_norm(self.self_attn_layer_norm, x_BSD)
        x_BSD = x_BSD + self.self_attn.attend(self.self_attn.query(h), *self.self_attn.key_value(h))
        return x_BSD + _mlp(self.fc1, self.fc2, _layer_norm(self.final_layer_norm, x_BSD))


class WhisperDecoderLayer(nn.Module):
    """Pre-LN block: causal self-attention, cross-attention to the encoder, GELU MLP."""

    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(c.d_model, c.decoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.encoder_attn = WhisperAttention(c.d_model, c.decoder_attention_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.fc1 = nn.Linear(c.d_model, c.decoder_ffn_dim)
        self.fc2 = nn.Linear(c.decoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)

    def _cross_and_mlp(self, x_BTD: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                       invariant: bool = False,
                       cross_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        h = _layer_norm(self.encoder_attn_layer_norm, x_BTD)
        q = self.encoder_attn.query(h, invariant)
        x_BTD = x_BTD + self.encoder_attn.attend(q, cross_k, cross_v, invariant=invariant, kv_scales=cross_scales)
        return x_BTD + _mlp(self.fc1, self.fc2, _layer_norm(self.final_layer_norm, x_BTD), invariant)

    def forward(self, x_BTD: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor) -> torch.Tensor:
        """Whole sequence at once (teacher forcing), causal self-attention."""
        h = _layer_norm(self.self_attn_layer_norm, x_BTD)
        x_BTD = x_BTD + self.self_attn.attend(self.self_attn.query(h), *self.self_attn.key_value(h), causal=True)
        return self._cross_and_mlp(x_BTD, cross_k, cross_v)

    def step(self, x_B1D: torch.Tensor, position_B: torch.Tensor, visible_B11C: torch.Tensor,
             cache_k: torch.Tensor, cache_v: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
             invariant: bool = False,
             cross_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One token per sequence. Writes this token's K/V into ``cache_k``/``cache_v``
        [B, NH, C, Dh] at ``position_B`` and attends to the positions ``visible_B11C`` marks.
        ``cross_scales``: the cross-attention K/V are e4m3 rows with these scales."""
        h = _layer_norm(self.self_attn_layer_norm, x_B1D)
        k_BH1d, v_BH1d = self.self_attn.key_value(h, invariant)
        where = position_B.view(-1, 1, 1, 1).expand_as(k_BH1d)
        cache_k.scatter_(2, where, k_BH1d)
        cache_v.scatter_(2, where, v_BH1d)
        x_B1D = x_B1D + self.self_attn.attend(self.self_attn.query(h, invariant), cache_k, cache_v,
                                              mask=visible_B11C, invariant=invariant)
        return self._cross_and_mlp(x_B1D, cross_k, cross_v, invariant, cross_scales)

    def fused_step(self, x_B1D: torch.Tensor, position_B: torch.Tensor, cache_k: torch.Tensor,
                   cache_v: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                   cross_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """:meth:`step` through core's fused decoder ops (``WhisperASR.fused_decode``)."""
        x_B1D = self.self_attn.fused_self_attention(self.self_attn_layer_norm, x_B1D, position_B, cache_k, cache_v)
        x_B1D = self.encoder_attn.fused_cross_attention(self.encoder_attn_layer_norm, x_B1D, cross_k, cross_v,
                                                        cross_scales)
        return _fused_mlp(self.final_layer_norm, self.fc1, self.fc2, x_B1D)


# ---- encoder and decoder -------------------------------------------------------------------

class WhisperEncoder(nn.Module):
    """Two conv1d (kernel 3; the second stride 2) with GELU, fixed positions, pre-LN blocks."""

    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.d_model)
        self.layers = nn.ModuleList(WhisperEncoderLayer(c) for _ in range(c.encoder_layers))
        self.layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)

    def forward(self, features_BMF: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """``invariant``: the convolutions as GEMMs on CUDA (the same kernel at every batch)."""
        if invariant:
            x_BFD = F.gelu(conv1d_as_gemm(features_BMF.transpose(1, 2), self.conv1.weight, self.conv1.bias))
            x_BSD = F.gelu(conv1d_as_gemm(x_BFD, self.conv2.weight, self.conv2.bias, stride=2))
        else:
            x_BSD = F.gelu(self.conv2(F.gelu(self.conv1(features_BMF)))).transpose(1, 2)
        # contiguous: a transposed view here would make the whole residual stream keep the
        # [B, D, S] memory layout, and every residual add a strided, unvectorized kernel
        x_BSD = x_BSD.contiguous() + self.embed_positions.weight[: x_BSD.shape[1]]
        for layer in self.layers:
            x_BSD = layer(x_BSD)
        return _layer_norm(self.layer_norm, x_BSD)


class WhisperDecoder(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm."""

    def __init__(self, c: WhisperConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_target_positions, c.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(c) for _ in range(c.decoder_layers))
        self.layer_norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)

    def logits(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Final norm and the output projection tied to ``embed_tokens``: [..., D] -> [..., V] fp32."""
        h, w = _layer_norm(self.layer_norm, x), self.embed_tokens.weight
        return (fixed_rows_linear(h, w) if invariant else F.linear(h, w)).float()

    def fused_logits(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` as one fused op (norm, projection, fp32 out)."""
        ln = self.layer_norm
        return ops.ln_linear(x, ln.weight, ln.bias, ln.eps, self.embed_tokens.weight, out_dtype=torch.float32)


# ---- the model ---------------------------------------------------------------------------------

class WhisperASR(ASRModel):
    """Whisper encoder-decoder with static-shape ``encode`` and ``decode_step`` graphs.

    Build it with :meth:`from_pretrained` from a Hugging Face Whisper directory (see
    :func:`polyaccel.asr.weights.resolve_model` for names and CTranslate2 checkpoints).
    ``language``/``task`` pick the prompt of multilingual checkpoints (ignored for ``.en``).
    """

    def __init__(self, config: WhisperConfig, tokenizer_file: str | os.PathLike | None = None, *,
                 language: str = "en", task: str = "transcribe") -> None:
        super().__init__()
        self.config = config
        self.n_mels = config.num_mel_bins
        self.sample_rate = config.sample_rate
        self.max_decode_len = config.max_target_positions
        self.eos_token_id = config.eos_token_id
        self.language, self.task = language, task
        self.batch_invariant = False
        """bf16/fp16 on CUDA: the same tokens at every batch size, through kernels that do not
        change with the batch (:mod:`polyaccel.asr.batch_invariant`; slower, measured in
        docs/asr_whisper.md). fp32 and the CPU need no help. Set before graphs are captured."""
        self.fused_decode: bool | None = None
        """Decode through core's fused decoder-step ops (:meth:`WhisperDecoderLayer.fused_step`):
        ~9 kernels per layer on CUDA instead of ~23 (docs/asr.md). ``None`` (the default): on
        CUDA unless ``batch_invariant`` is set; ``True`` forces it (not combined with
        ``batch_invariant``); ``False`` keeps the plain step. Set before graphs are captured."""
        self.fp8_cross_kv = False
        """Keep the cross-attention K/V as e4m3 rows, one fp32 scale per (layer, row, head,
        frame): half the bytes each decoder step reads (set by :func:`polyaccel.asr.fp8.fp8_encoder`;
        tokens may differ from bf16's). Set before graphs are captured."""
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)
        self.log_mel = LogMel(config.num_mel_bins, config.n_fft, config.hop_length, config.sample_rate)
        self._tokenizer = None
        self._tokenizer_file = Path(tokenizer_file) if tokenizer_file else None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None, language: str = "en",
                        task: str = "transcribe") -> WhisperASR:
        """Load a Hugging Face Whisper directory (``config.json``, ``model.safetensors`` or the
        shards its index names, ``generation_config.json``, ``tokenizer.json``) onto ``device`` in ``dtype`` (default:
        the checkpoint's, fp32 for converted ones). A known
        name (``whisper-tiny.en``) or a CTranslate2 directory is converted first (cached)."""
        from safetensors.torch import load_file

        from polyaccel.asr.weights import loaded_weight_files, resolve_model

        path = resolve_model(path)
        config = WhisperConfig.from_pretrained(path)
        with torch.device("meta"):
            model = cls(config, path / "tokenizer.json", language=language, task=task)
        model.prompt_ids()  # a language or task the checkpoint lacks: refused here, not when a replica starts
        state: dict[str, torch.Tensor] = {}
        files = loaded_weight_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        source: dict[str, Path] = {}
        for f in files:
            for k, v in load_file(str(f)).items():
                if k in source:  # a later file's tensor would silently replace the earlier one's
                    raise ValueError(f"{path}: the tensor {k} is in both {source[k].name} and {f.name}; keep one "
                                     "model's weights in the folder (or name the shards in "
                                     "model.safetensors.index.json)")
                source[k], state[k] = f, v
        state = {k.removeprefix("model."): v for k, v in state.items() if k != "proj_out.weight"}
        check_weights_fit({k: v.shape for k, v in model.state_dict().items()}, {k: v.shape for k, v in state.items()},
                          path)
        model.load_state_dict(state, strict=True, assign=True)
        # Buffers are computed, not stored: rebuild them off the meta device.
        model.log_mel = LogMel(config.num_mel_bins, config.n_fft, config.hop_length, config.sample_rate)
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    # ---- front end ---------------------------------------------------------------------
    def max_audio_seconds(self) -> float:
        return float(self.config.chunk_seconds)

    def compute_features(self, audio: list[np.ndarray], num_frames: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of 30 s windows: each waveform zero-padded (or cut) to 30 s.

        Returns ([B, M, 3000] in the model dtype, valid frames [B] int64). ``num_frames``
        must be None or 3000: Whisper's encoder only takes full windows.
        """
        n = self.config.n_samples
        if num_frames not in (None, self.config.n_frames):
            raise ValueError(f"Whisper takes {self.config.n_frames} frames per window, not {num_frames}")
        lengths = [-(-min(np.asarray(a).size, n) // self.config.hop_length) for a in audio]
        # only the real samples cross to the device (real clips are mostly 2-15 s, the windows 30 s)
        feats = self.log_mel(padded_batch(audio, n, self.device))
        return feats.to(self.dtype), torch.tensor(lengths, dtype=torch.int64, device=self.device)

    # ---- encoder -------------------------------------------------------------------------
    def encode(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, M, 3000] -> (enc [B, S, D], mask [B, S] all True: Whisper attends to
        the whole 30 s window, padding included, as it was trained)."""
        enc_BSD = self.encoder(features, invariant=self.batch_invariant)
        return enc_BSD, torch.ones(enc_BSD.shape[:2], dtype=torch.bool, device=enc_BSD.device)

    # ---- decoder ---------------------------------------------------------------------------
    def prompt_ids(self, timestamps: bool = False) -> list[int]:
        """``<|startoftranscript|>`` [``<|lang|>`` ``<|task|>``] ``<|notimestamps|>`` (left out
        with ``timestamps``: the model then predicts timestamp tokens)."""
        c = self.config
        ids = [c.decoder_start_token_id]
        if c.is_multilingual:
            lang = self.language if self.language.startswith("<|") else f"<|{self.language}|>"
            if lang not in c.lang_to_id or self.task not in c.task_to_id:
                raise ValueError(f"language {self.language!r} / task {self.task!r} not in this checkpoint's "
                                 f"generation_config (lang_to_id / task_to_id)")
            ids += [c.lang_to_id[lang], c.task_to_id[self.task]]
        if c.no_timestamps_token_id is not None and not timestamps:
            ids.append(c.no_timestamps_token_id)
        return ids

    def no_speech_id(self) -> int | None:
        """The id of the no-speech token (``<|nospeech|>``, ``<|nocaptions|>`` before
        large-v3), whose probability after the start token says the window holds no speech;
        None when the tokenizer has neither."""
        tokenizer = self.load_tokenizer()
        for name in ("<|nospeech|>", "<|nocaptions|>"):
            if (i := tokenizer.token_to_id(name)) is not None and i < self.config.vocab_size:
                return i
        return None

    def timestamp_rules(self) -> TimestampRules | None:
        """Whisper's timestamp rules for this checkpoint (None if it has no timestamp tokens):
        ``<|0.00|>`` is the id after ``<|notimestamps|>``, 0.02 s per id."""
        c = self.config
        if c.no_timestamps_token_id is None or c.no_timestamps_token_id + 1 >= c.vocab_size:
            return None
        return TimestampRules(begin=c.no_timestamps_token_id + 1, no_timestamps=c.no_timestamps_token_id,
                              eos=c.eos_token_id, max_initial_index=c.max_initial_timestamp_index)

    def suppress_ids(self) -> list[int]:
        return list(self.config.suppress_tokens)

    def begin_suppress_ids(self) -> list[int]:
        return list(self.config.begin_suppress_tokens)

    def decode_state_bytes(self, batch: int) -> int:
        c = self.config
        head_dim = c.d_model // c.decoder_attention_heads
        cross_bytes = 1 + 4 / head_dim if self.fp8_cross_kv else self.dtype.itemsize  # per element
        per_position = 2 * c.decoder_layers * batch * c.d_model
        return int(per_position * (self.max_decode_len * self.dtype.itemsize + c.max_source_positions * cross_bytes))

    def new_decoder_state(self, enc: torch.Tensor, enc_mask: torch.Tensor, max_len: int,
                          out: DecoderState | None = None) -> DecoderState:
        """Cross-attention K/V of every layer from ``enc`` [B, S, D] and an empty self-attention
        cache of ``max_len`` positions. With ``out`` (same shapes) the tensors are written into
        it instead, so a captured ``decode_step`` keeps reading the same memory. Each layer's
        K/V go straight from their projection into the state (e4m3 rows where
        :attr:`fp8_cross_kv`), never stacked first."""
        layers = self.decoder.layers
        B, S, D = enc.shape
        heads = layers[0].encoder_attn.num_heads
        if out is None:
            L, Dh = len(layers), D // heads
            cross_dtype = torch.float8_e4m3fn if self.fp8_cross_kv else self.dtype
            cross = torch.empty(L, B, heads, S, Dh, device=enc.device, dtype=cross_dtype)
            scale = torch.empty(2, L, B, heads, S, device=enc.device) if self.fp8_cross_kv else None
            self_k = torch.zeros(L, B, heads, max_len, Dh, device=enc.device, dtype=self.dtype)
            out = DecoderState(self_k, torch.zeros_like(self_k), cross, torch.empty_like(cross),
                               enc_mask.contiguous().clone(), scale)
        else:
            if (out.cross_scale is not None) != self.fp8_cross_kv:
                raise ValueError("e4m3 cross-attention K/V need a state made for them (cross_scale), and only they")
            out.enc_mask.copy_(enc_mask)
            out.self_k.zero_()
            out.self_v.zero_()
        for i, layer in enumerate(layers):
            attn = layer.encoder_attn
            for j, (proj, dst) in enumerate(((attn.k_proj, out.cross_k[i]), (attn.v_proj, out.cross_v[i]))):
                y_BSD = _proj(proj, enc, False)
                if out.cross_scale is None:
                    dst.copy_(attn._heads(y_BSD))
                    continue
                values, scale = ops.rows_to_fp8(y_BSD.view(B, S, heads, -1))  # a row per (frame, head)
                dst.copy_(values.view(B, S, heads, -1).transpose(1, 2))
                out.cross_scale[j, i].copy_(scale.view(B, S, heads).transpose(1, 2))
        return out

    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """tokens [B] at position [B] -> logits [B, V] fp32; K/V written into ``state``."""
        dec = self.decoder
        x_B1D = (dec.embed_tokens(tokens) + dec.embed_positions(position)).unsqueeze(1)
        fused = self.fused_decode if self.fused_decode is not None else (x_B1D.is_cuda and not self.batch_invariant)
        if fused:
            if self.batch_invariant:
                raise ValueError("fused_decode and batch_invariant together are not supported: the fused ops "
                                 "take cuBLAS above 16 rows")
            for i, layer in enumerate(dec.layers):
                x_B1D = layer.fused_step(x_B1D, position, state.self_k[i], state.self_v[i],
                                         state.cross_k[i], state.cross_v[i], state.cross_scales(i))
            return dec.fused_logits(x_B1D[:, 0])
        C = state.self_k.shape[3]
        visible_B11C = (torch.arange(C, device=position.device) <= position[:, None])[:, None, None, :]
        for i, layer in enumerate(dec.layers):
            x_B1D = layer.step(x_B1D, position, visible_B11C, state.self_k[i], state.self_v[i],
                               state.cross_k[i], state.cross_v[i], invariant=self.batch_invariant,
                               cross_scales=state.cross_scales(i))
        return dec.logits(x_B1D[:, 0], invariant=self.batch_invariant)

    def forward(self, features: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits without a cache: features [B, M, F], ids [B, T] -> [B, T, V].
        The full-recompute reference ``decode_step`` is checked against."""
        return self.decoder_logits(self.encoder(features), decoder_input_ids)

    def decoder_logits(self, enc_BSD: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """Decoder over a whole token sequence (causal, no cache): ids [B, T] -> [B, T, V] fp32."""
        dec = self.decoder
        T = decoder_input_ids.shape[1]
        x_BTD = dec.embed_tokens(decoder_input_ids) + dec.embed_positions.weight[:T]
        for layer in dec.layers:
            x_BTD = layer(x_BTD, *layer.encoder_attn.key_value(enc_BSD))
        return dec.logits(x_BTD)

    def load_tokenizer(self) -> Any:
        """The tokenizer of ``tokenizer.json``, read once: ``FileNotFoundError`` when it is
        missing, ``ValueError`` naming it when it cannot be parsed."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            if self._tokenizer_file is None or not self._tokenizer_file.is_file():
                raise FileNotFoundError(f"tokenizer.json not found ({self._tokenizer_file})")
            try:
                self._tokenizer = Tokenizer.from_file(str(self._tokenizer_file))
            except Exception as e:  # the tokenizers library raises a bare Exception
                raise ValueError(f"{self._tokenizer_file}: not a readable tokenizer ({e})") from None
        return self._tokenizer

    def decode_text(self, ids: list[int]) -> str:
        """Generated ids -> text; special and timestamp tokens (ids >= <|endoftext|>) dropped."""
        return self.load_tokenizer().decode([i for i in ids if i < self.eos_token_id]).strip()

    # ---- static graphs -----------------------------------------------------------------------
    def graph_specs(self, batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[GraphSpec]:
        """``encode`` (features [B, M, 3000], lengths [B] -> enc [B, S, D], mask [B, S]) and ``decode_step`` (tokens,
        position, then the five :class:`DecoderState` tensors -> logits [B, V]) per batch bucket;
        frames and cache length are fixed, so batch is the only bucketed dimension."""
        c, dev, dt = self.config, self.device, self.dtype
        buckets = ShapeBuckets({"batch": tuple(batch_buckets)})
        heads = c.decoder_attention_heads
        head_dim = c.d_model // heads
        S = c.max_source_positions

        def encode_fn(features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.encode(features, lengths)

        def decode_fn(tokens, position, *state: torch.Tensor) -> torch.Tensor:
            return self.decode_step(tokens, position, DecoderState(*state))

        def encode_example(b: dict[str, int]) -> list[torch.Tensor]:
            return [torch.zeros(b["batch"], c.num_mel_bins, c.n_frames, device=dev, dtype=dt),
                    torch.full((b["batch"],), c.n_frames, dtype=torch.int64, device=dev)]

        def decode_example(b: dict[str, int]) -> list[torch.Tensor]:
            B, L = b["batch"], c.decoder_layers
            self_kv = torch.zeros(L, B, heads, self.max_decode_len, head_dim, device=dev, dtype=dt)
            cross_dt = torch.float8_e4m3fn if self.fp8_cross_kv else dt
            cross_kv = torch.zeros(L, B, heads, S, head_dim, device=dev, dtype=cross_dt)
            scale = [torch.ones(2, L, B, heads, S, device=dev)] if self.fp8_cross_kv else []
            return [torch.zeros(B, dtype=torch.int64, device=dev), torch.zeros(B, dtype=torch.int64, device=dev),
                    self_kv, self_kv.clone(), cross_kv, cross_kv.clone(),
                    torch.ones(B, S, dtype=torch.bool, device=dev), *scale]

        return [GraphSpec("encode", encode_fn, buckets, encode_example),
                GraphSpec("decode_step", decode_fn, buckets, decode_example)]

