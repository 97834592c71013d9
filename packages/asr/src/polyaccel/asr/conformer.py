"""ConformerAED: a conformer encoder with a small transformer decoder (attention encoder-decoder).

Our Nova-3-class batch ASR architecture, shaped like NVIDIA's canary-flash models: log-mel
features -> three stride-2 conv2d layers (x8 fewer frames) -> conformer blocks (half-step
FFN, fused-QKV self-attention, depthwise-conv module, half-step FFN) -> a pre-LN transformer
decoder that cross-attends to the encoder output and decodes one token per step over a
static KV cache. Positions are absolute sinusoids (added after subsampling in the encoder,
to the token embeddings in the decoder); there is no relative positional encoding.

Every heavy op goes through :mod:`polyaccel.core.ops` (``conv2d_subsample``, ``ffn``,
``fused_qkv``, ``attention``, ``depthwise_conv1d``, ``layer_norm``), so a backend's kernels
replace them without touching this file. Inference only: the conv module's batch norm
uses its running statistics, folded into the depthwise conv.

Padding never reaches real frames: attention masks padded keys and every convolution over
time sees zeros past each utterance's length, so an utterance in a padded batch gets the
same encoder output on its real frames as it gets alone.

Shape legend: B batch, N audio samples, M mel bins, F feature frames, S encoder frames,
D encoder dim, E decoder dim, NH heads, Dh head dim, T decoder tokens, C cache positions,
L decoder layers, V vocabulary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from torch import nn

from polyaccel.asr.char_tokenizer import CharTokenizer
from polyaccel.asr.conformer_config import ConformerAEDConfig, subsampled_length
from polyaccel.asr.interface import ASRModel, DecoderState
from polyaccel.asr.upload import padded_batch
from polyaccel.asr.weights import require_regular
from polyaccel.core import ops
from polyaccel.core.graphs import GraphSpec, ShapeBuckets

WEIGHTS_NAME = "model.safetensors"


def sinusoids(length: int, dim: int) -> torch.Tensor:
    """Absolute sinusoidal positions [length, dim]: sin on even channels, cos on odd ones."""
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles)
    return table


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: int) -> torch.Tensor:
    """Triangular filters evenly spaced on the HTK mel scale from 0 Hz to Nyquist, each
    normalized to unit area: [n_fft // 2 + 1, n_mels] float32."""
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)

    bin_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(0.0, hz_to_mel(np.array(sample_rate / 2)), n_mels + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (bin_hz[None, :] - lower) / (center - lower)
    falling = (upper - bin_hz[None, :]) / (upper - center)
    filters = np.clip(np.minimum(rising, falling), 0.0, None) * (2.0 / (upper - lower))
    return torch.from_numpy(filters.T.astype(np.float32))


def lengths_to_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B] lengths -> [B, max_len] bool, True on the first ``lengths[b]`` positions."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` parameters, computed by the core ``layer_norm`` op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


class FeedForward(nn.Module):
    """Position-wise two-layer MLP through the core ``ffn`` op: [..., dim] -> [..., dim]."""

    def __init__(self, dim: int, hidden_dim: int, activation: str) -> None:
        super().__init__()
        self.linear1 = nn.Linear(dim, hidden_dim)
        self.linear2 = nn.Linear(hidden_dim, dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.ffn(x, self.linear1.weight, self.linear1.bias, self.linear2.weight,
                       self.linear2.bias, self.activation)


# ---- encoder -----------------------------------------------------------------------------------

class ConvSubsampling(nn.Module):
    """Three 3x3 stride-2 conv2d + ReLU over (time, mel), then a linear projection:
    features [B, M, F] -> [B, S, D] with S = ceil(F / 8)."""

    def __init__(self, config: ConformerAEDConfig) -> None:
        super().__init__()
        channels = [1] + [config.subsampling_channels] * config.subsampling_layers
        self.convs = nn.ModuleList(
            nn.Conv2d(c_in, c_out, kernel_size=3, stride=2, padding=1)
            for c_in, c_out in zip(channels[:-1], channels[1:])
        )
        self.out = nn.Linear(config.subsampling_channels * config.subsampled_mels, config.d_model)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = features.transpose(1, 2).unsqueeze(1)  # [B, 1, F, M]
        # each layer's input zeroed past each length (ReLU(bias) there otherwise)
        x = ops.conv2d_subsample(x, [c.weight for c in self.convs], [c.bias for c in self.convs], lengths=lengths)
        for _ in self.convs:
            lengths = (lengths + 1) // 2
        B, C, S, M = x.shape
        return self.out(x.permute(0, 2, 1, 3).reshape(B, S, C * M)), lengths


class ConformerSelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection; padded keys are masked."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = ops.fused_qkv(x, self.qkv_proj.weight, self.qkv_proj.bias, self.num_heads)
        out = ops.attention(q, k, v, mask=mask[:, None, None, :])  # [B, NH, S, Dh]
        return self.out_proj(out.transpose(1, 2).reshape(B, S, D))


class ConformerConvModule(nn.Module):
    """Pointwise conv + GLU -> depthwise conv over time -> batch norm -> SiLU -> pointwise conv.

    Pointwise convs are linears over channels. Batch norm (running statistics) is folded into
    the depthwise conv's weight and bias, so the core ``depthwise_conv1d`` op does both.
    """

    def __init__(self, dim: int, kernel_size: int) -> None:
        super().__init__()
        self.pointwise_in = nn.Linear(dim, 2 * dim)
        self.depthwise = nn.Conv1d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)
        self.norm = nn.BatchNorm1d(dim)
        self.pointwise_out = nn.Linear(dim, dim)

    def folded_depthwise(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise weight [D, 1, K] and bias [D] with the batch norm applied (computed in fp32)."""
        bn = self.norm
        scale = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)
        weight = self.depthwise.weight.float() * scale[:, None, None]
        bias = (self.depthwise.bias.float() - bn.running_mean.float()) * scale + bn.bias.float()
        return weight.to(self.depthwise.weight.dtype), bias.to(self.depthwise.weight.dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = F.glu(self.pointwise_in(x), dim=-1)
        x = x.masked_fill(~mask[:, :, None], 0.0)  # the kernel must see zeros past the end
        weight, bias = self.folded_depthwise()
        # [B, D, S]; backends that keep the input's layout (CUDA) hand back a view of a [B, S, D]
        # tensor, so the linear layer after it reads a contiguous input
        x = ops.depthwise_conv1d(x.transpose(1, 2), weight, bias)
        return self.pointwise_out(F.silu(x).transpose(1, 2))


class ConformerBlock(nn.Module):
    """Macaron conformer block: x + FFN/2, + MHSA, + conv, + FFN/2, then LayerNorm (pre-LN)."""

    def __init__(self, config: ConformerAEDConfig) -> None:
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.ffn1_norm = LayerNorm(d, eps=eps)
        self.ffn1 = FeedForward(d, config.encoder_ffn_dim, "silu")
        self.self_attn_norm = LayerNorm(d, eps=eps)
        self.self_attn = ConformerSelfAttention(d, config.encoder_heads)
        self.conv_norm = LayerNorm(d, eps=eps)
        self.conv = ConformerConvModule(d, config.conv_kernel_size)
        self.ffn2_norm = LayerNorm(d, eps=eps)
        self.ffn2 = FeedForward(d, config.encoder_ffn_dim, "silu")
        self.out_norm = LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.add(x, self.ffn1(self.ffn1_norm(x)), alpha=0.5)  # one pass: x + FFN / 2
        x = x + self.self_attn(self.self_attn_norm(x), mask)
        x = x + self.conv(self.conv_norm(x), mask)
        x = torch.add(x, self.ffn2(self.ffn2_norm(x)), alpha=0.5)
        return self.out_norm(x)


class ConformerEncoder(nn.Module):
    """features [B, M, F], lengths [B] -> hidden [B, S, D], mask [B, S] (True = real frame)."""

    def __init__(self, config: ConformerAEDConfig) -> None:
        super().__init__()
        self.subsampling = ConvSubsampling(config)
        self.register_buffer("positions", sinusoids(config.max_encoder_frames, config.d_model),
                             persistent=False)
        self.layers = nn.ModuleList(ConformerBlock(config) for _ in range(config.encoder_layers))

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, lengths = self.subsampling(features, lengths)
        S = x.shape[1]
        if S > self.positions.shape[0]:
            raise ValueError(f"{S} encoder frames exceed the largest frame bucket "
                             f"({self.positions.shape[0]}); chunk the audio")
        x = x + self.positions[:S].to(x.dtype)
        mask = lengths_to_mask(lengths, S)
        for layer in self.layers:
            x = layer(x, mask)
        return x, mask


# ---- decoder -----------------------------------------------------------------------------------

class DecoderSelfAttention(nn.Module):
    """Causal self-attention with a fused QKV projection.

    Without a cache it attends over the whole prefix [B, T, E] (teacher forcing, the
    reference). With one it takes one token per sequence [B, 1, E], writes its K/V into the
    static cache [B, NH, C, Dh] at ``position`` [B] in place and attends to positions
    <= ``position``: fixed shapes, no host sync, so a step can be captured as a graph.
    """

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cache_k: torch.Tensor | None = None,
                cache_v: torch.Tensor | None = None, position: torch.Tensor | None = None) -> torch.Tensor:
        B, T, E = x.shape
        q, k, v = ops.fused_qkv(x, self.qkv_proj.weight, self.qkv_proj.bias, self.num_heads)
        if cache_k is None or cache_v is None or position is None:
            out = ops.attention(q, k, v, causal=True)
        else:
            index = position.view(B, 1, 1, 1).expand(B, self.num_heads, 1, k.shape[-1])
            cache_k.scatter_(2, index, k)
            cache_v.scatter_(2, index, v)
            # positions <= position only: backends read no further into the cache
            out = ops.cached_decode_attention(q, cache_k, cache_v, position)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, E))


class DecoderCrossAttention(nn.Module):
    """Attention from decoder tokens to encoder frames; K/V come precomputed per utterance."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.kv_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def project_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """enc [B, S, E] -> k, v [B, NH, S, Dh]."""
        B, S, E = enc.shape
        k, v = self.kv_proj(enc).view(B, S, 2, self.num_heads, E // self.num_heads).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        B, T, E = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, E // self.num_heads).transpose(1, 2)
        mask = enc_mask[:, None, None, :]
        # a decoder step: one query token, the same key split at every batch size
        out = ops.decode_attention(q, k, v, mask) if T == 1 else ops.attention(q, k, v, mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, E))


class TransformerDecoderLayer(nn.Module):
    """Pre-LN decoder layer: causal self-attention, cross-attention, FFN."""

    def __init__(self, config: ConformerAEDConfig) -> None:
        super().__init__()
        e, eps = config.decoder_dim, config.layer_norm_eps
        self.self_attn_norm = LayerNorm(e, eps=eps)
        self.self_attn = DecoderSelfAttention(e, config.decoder_heads)
        self.cross_attn_norm = LayerNorm(e, eps=eps)
        self.cross_attn = DecoderCrossAttention(e, config.decoder_heads)
        self.ffn_norm = LayerNorm(e, eps=eps)
        self.ffn = FeedForward(e, config.decoder_ffn_dim, config.decoder_activation)

    def forward(self, x: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor, enc_mask: torch.Tensor,
                cache_k: torch.Tensor | None = None, cache_v: torch.Tensor | None = None,
                position: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_norm(x), cache_k, cache_v, position)
        x = x + self.cross_attn(self.cross_attn_norm(x), cross_k, cross_v, enc_mask)
        return x + self.ffn(self.ffn_norm(x))


class TransformerDecoder(nn.Module):
    """Token embeddings + sinusoidal positions -> decoder layers -> LayerNorm -> logits (fp32).

    When the encoder and decoder widths differ (canary-180m-flash: 512 -> 1024) the encoder
    output is projected once, before the cross-attention K/V.
    """

    def __init__(self, config: ConformerAEDConfig) -> None:
        super().__init__()
        e = config.decoder_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, e)
        self.register_buffer("positions", sinusoids(config.max_decode_len, e), persistent=False)
        self.encoder_proj = nn.Linear(config.d_model, e) if config.d_model != e else nn.Identity()
        self.layers = nn.ModuleList(TransformerDecoderLayer(config) for _ in range(config.decoder_layers))
        self.final_norm = LayerNorm(e, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(e, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def cross_kv(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """enc [B, S, D] -> cross-attention k, v [L, B, NH, S, Dh] for every layer."""
        enc = self.encoder_proj(enc)
        ks, vs = zip(*(layer.cross_attn.project_kv(enc) for layer in self.layers))
        return torch.stack(ks), torch.stack(vs)

    def forward(self, input_ids: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                enc_mask: torch.Tensor, position: torch.Tensor | None = None,
                self_k: torch.Tensor | None = None, self_v: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] fp32.

        Without ``position``: the whole prefix from position 0, causally masked. With
        ``position`` [B] (T = 1): one cached step writing into ``self_k``/``self_v`` [L, B, NH, C, Dh].
        """
        if position is None:
            pos = self.positions[: input_ids.shape[1]][None]
        else:
            pos = self.positions[position][:, None]
        x = self.embed_tokens(input_ids) + pos.to(self.embed_tokens.weight.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cross_k[i], cross_v[i], enc_mask,
                      None if self_k is None else self_k[i], None if self_v is None else self_v[i], position)
        return self.lm_head(self.final_norm(x)).float()


# ---- the model ---------------------------------------------------------------------------------

class ConformerAED(ASRModel):
    """Conformer encoder + transformer decoder speech recognizer with static-shape graphs.

    ``encode`` and ``decode_step`` are one graph each per (batch, frames) bucket: a batch of
    short clips is padded to its own frame bucket in the encoder and cross-attended over that
    bucket's frames while decoding (the runner batches clips of one bucket together). Weights
    are random unless loaded (there are no public ones).
    """

    def __init__(self, config: ConformerAEDConfig, tokenizer: CharTokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer or CharTokenizer()
        if len(self.tokenizer) > config.vocab_size:
            raise ValueError(f"tokenizer has {len(self.tokenizer)} ids but vocab_size is {config.vocab_size}")
        for token, idx in (("<pad>", config.pad_token_id), ("<bos>", config.bos_token_id),
                           ("<eos>", config.eos_token_id)):
            if self.tokenizer.token_id(token) != idx:
                raise ValueError(f"tokenizer id of {token} is {self.tokenizer.token_id(token)}, config says {idx}")
        self.sample_rate = config.sample_rate
        self.n_mels = config.n_mels
        self.max_decode_len = config.max_decode_len
        self.eos_token_id = config.eos_token_id
        self.encoder = ConformerEncoder(config)
        self.decoder = TransformerDecoder(config)
        # Front-end constants per device, fp32 whatever the model dtype; built on first use.
        self._frontend: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- front end -------------------------------------------------------------------------
    def max_audio_seconds(self) -> float:
        return self.config.max_audio_seconds

    def feature_frames(self, num_samples: int) -> int:
        """Feature frames of ``num_samples`` samples: ceil(N / hop), at least 1."""
        return max(1, -(-num_samples // self.config.hop_length))

    def frame_bucket(self, num_samples: int) -> int:
        """The smallest frame bucket holding ``num_samples`` samples (the largest if none does)."""
        frames = self.feature_frames(num_samples)
        return next((f for f in self.config.frame_buckets if f >= frames), self.config.max_feature_frames)

    def compute_features(self, audio: list[np.ndarray], num_frames: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized log-mel features [B, M, F] (model dtype) and valid frames [B] int64.

        Frame f covers the 25 ms window centred on sample ``f * hop``; an utterance of N
        samples has ceil(N / hop) frames. Each mel bin is normalized to zero mean and unit
        variance over the utterance's own frames, and frames past its length are zero, so
        padding the result further with zeros is the same as asking for more frames.
        ``num_frames`` defaults to the smallest frame bucket that holds the longest
        utterance (so F names the ``encode`` graph's bucket); longer audio is cropped.
        """
        hop = self.config.hop_length
        n_frames = num_frames or self.frame_bucket(max(len(a) for a in audio))
        wave = padded_batch(audio, n_frames * hop, self.device)  # only the real samples cross
        lengths = torch.tensor([min(self.feature_frames(np.asarray(a).size), n_frames) for a in audio],
                               dtype=torch.int64)
        features = self.log_mel(wave, lengths.to(self.device))
        return features.to(self.dtype), lengths.to(self.device)

    def log_mel(self, wave: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """wave [B, F * hop] fp32, lengths [B] frames -> normalized log-mel [B, M, F] fp32."""
        cfg = self.config
        window, filters = self._frontend_constants(wave.device)
        num_frames = wave.shape[1] // cfg.hop_length
        # Zero ("constant") centre padding: a frame near the end sees zeros, as it would in a
        # longer padded batch, where reflection would mirror different samples.
        spec = torch.stft(wave, cfg.n_fft, cfg.hop_length, cfg.win_length, window, center=True,
                          pad_mode="constant", return_complex=True)[..., :num_frames]
        power = torch.view_as_real(spec).pow(2).sum(-1)  # [B, n_fft // 2 + 1, F]
        log_mel = torch.log(torch.matmul(filters.T, power) + 2.0 ** -24)  # [B, M, F]
        valid = lengths_to_mask(lengths, num_frames)[:, None, :].float()
        n = lengths.clamp(min=1)[:, None, None].float()
        mean = (log_mel * valid).sum(-1, keepdim=True) / n
        var = ((log_mel - mean).pow(2) * valid).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
        return (log_mel - mean) / (var.sqrt() + 1e-5) * valid

    def _frontend_constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._frontend:
            cfg = self.config
            self._frontend[device] = (
                torch.hann_window(cfg.win_length, periodic=True, device=device),
                mel_filterbank(cfg.n_mels, cfg.n_fft, cfg.sample_rate).to(device),
            )
        return self._frontend[device]

    # ---- encoder / decoder -------------------------------------------------------------------
    def encode(self, features: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(features.to(self.dtype), lengths)

    def prompt_ids(self) -> list[int]:
        return [self.config.bos_token_id]

    def decode_state_bytes(self, batch: int) -> int:
        """One self-attention cache per batch size, cross-attention K/V per frame bucket."""
        cfg = self.config
        frames = sum(subsampled_length(f, cfg.subsampling_layers) for f in cfg.frame_buckets)
        return 2 * cfg.decoder_layers * batch * cfg.decoder_dim * (cfg.max_decode_len + frames) * self.dtype.itemsize

    def new_decoder_state(self, enc: torch.Tensor, enc_mask: torch.Tensor, max_len: int,
                          out: DecoderState | None = None) -> DecoderState:
        """Zeroed self-attention cache [L, B, NH, max_len, Dh]; cross K/V [L, B, NH, S, Dh]
        computed here once, zero-padded (and masked) to :meth:`cross_frames` of the encoder
        length: the encoder frames of the smallest frame bucket that holds it, so short audio
        is not attended over as if it were the longest. With ``out`` (a state of the same
        shapes) the tensors are written into it, so a captured ``decode_step`` keeps reading
        the same memory."""
        cross_k, cross_v = self.decoder.cross_kv(enc.to(self.dtype))
        pad = max(0, self.cross_frames(enc.shape[1]) - enc.shape[1])
        if pad:
            cross_k, cross_v = F.pad(cross_k, (0, 0, 0, pad)), F.pad(cross_v, (0, 0, 0, pad))
            enc_mask = F.pad(enc_mask, (0, pad), value=False)
        return DecoderState.start(cross_k, cross_v, enc_mask, max_len, out=out)

    def cross_frames(self, encoder_frames: int) -> int:
        """Cross-attention length for ``encoder_frames``: the encoder frames of the smallest
        frame bucket holding them (of the largest bucket when none does)."""
        cfg = self.config
        sizes = [subsampled_length(f, cfg.subsampling_layers) for f in cfg.frame_buckets]
        return next((s for s in sizes if s >= encoder_frames), sizes[-1])

    def decode_step(self, tokens: torch.Tensor, position: torch.Tensor, state: DecoderState) -> torch.Tensor:
        logits = self.decoder(tokens[:, None], state.cross_k, state.cross_v, state.enc_mask,
                              position=position, self_k=state.self_k, self_v=state.self_v)
        return logits[:, 0]

    def forward(self, features: torch.Tensor, lengths: torch.Tensor, decoder_input_ids: torch.Tensor
                ) -> torch.Tensor:
        """Teacher-forced logits [B, T, V] fp32 for ``decoder_input_ids`` [B, T], recomputing
        the whole prefix (no cache): the reference ``decode_step`` is checked against."""
        enc, enc_mask = self.encode(features, lengths)
        cross_k, cross_v = self.decoder.cross_kv(enc)
        return self.decoder(decoder_input_ids, cross_k, cross_v, enc_mask)

    def decode_text(self, ids: list[int]) -> str:
        ids = list(ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tokenizer.decode(ids)

    def suppress_ids(self) -> list[int]:
        """pad, bos, unk and the embedding rows the tokenizer does not use."""
        cfg = self.config
        unused = range(len(self.tokenizer), cfg.vocab_size)
        return [cfg.pad_token_id, cfg.bos_token_id, self.tokenizer.token_id(self.tokenizer.unk_token), *unused]

    # ---- static graphs -------------------------------------------------------------------------
    def graph_specs(self, batch_buckets: Sequence[int] | None = None) -> list[GraphSpec]:
        """``encode(features, lengths)`` and ``decode_step(tokens, position,
        *DecoderState.tensors())``, each per (batch, frames) bucket (batch buckets default to
        the config's; frame buckets are always the config's). A decode step of frame bucket F
        cross-attends over F's encoder frames only.

        ``compute_features`` pads F to a frame bucket, so ``features.shape[-1]`` is the
        ``frames`` key of the encode graph to use; a caller that buckets by batch only gets the
        largest frame bucket's graph (pass ``num_frames=max(frame_buckets)`` then). The decode
        graph updates the self-attention cache it is given in place: callers that replay a
        captured graph keep their state in the graph's own input buffers.
        """
        cfg = self.config
        batches = tuple(batch_buckets or cfg.batch_buckets)
        frames = cfg.frame_buckets

        def encode_inputs(bucket: dict[str, int]) -> list[torch.Tensor]:
            b, f = bucket["batch"], bucket.get("frames", cfg.max_feature_frames)
            return [torch.zeros(b, cfg.n_mels, f, dtype=self.dtype, device=self.device),
                    torch.full((b,), f, dtype=torch.int64, device=self.device)]

        def decode_step_graph(tokens: torch.Tensor, position: torch.Tensor, self_k: torch.Tensor,
                              self_v: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                              enc_mask: torch.Tensor) -> torch.Tensor:
            return self.decode_step(tokens, position, DecoderState(self_k, self_v, cross_k, cross_v, enc_mask))

        def decode_inputs(bucket: dict[str, int]) -> list[torch.Tensor]:
            b, dev = bucket["batch"], self.device
            s = subsampled_length(bucket.get("frames", cfg.max_feature_frames), cfg.subsampling_layers)
            L, NH, E = cfg.decoder_layers, cfg.decoder_heads, cfg.decoder_dim
            cache = torch.zeros(L, b, NH, cfg.max_decode_len, E // NH, dtype=self.dtype, device=dev)
            cross = torch.zeros(L, b, NH, s, E // NH, dtype=self.dtype, device=dev)
            return [torch.full((b,), cfg.bos_token_id, dtype=torch.int64, device=dev),
                    torch.zeros(b, dtype=torch.int64, device=dev), cache, cache.clone(), cross, cross.clone(),
                    torch.ones(b, s, dtype=torch.bool, device=dev)]

        buckets = ShapeBuckets({"batch": batches, "frames": frames})
        return [GraphSpec("encode", self.encode, buckets, encode_inputs),
                GraphSpec("decode_step", decode_step_graph, buckets, decode_inputs)]

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write ``config.json``, ``tokenizer.json`` and ``model.safetensors`` into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        self.config.save(directory)
        self.tokenizer.save(directory)
        save_model(self, os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> ConformerAED:
        """Load a directory written by :meth:`save_pretrained`; returns the model in eval mode."""
        config = ConformerAEDConfig.load(directory)
        has_tokenizer = os.path.exists(os.path.join(directory, "tokenizer.json"))
        tokenizer = CharTokenizer.load(directory) if has_tokenizer else None
        require_regular(os.path.join(directory, WEIGHTS_NAME))
        _check_fits_weights(cls, config, os.path.join(directory, WEIGHTS_NAME))
        with torch.device(device):
            model = cls(config, tokenizer)
        try:
            load_model(model, os.path.join(directory, WEIGHTS_NAME), strict=True, device=str(torch.device(device)))
        except RuntimeError as e:  # missing, unexpected or misshapen tensors: one line, not every name
            detail = " ".join(str(e).split())
            raise ValueError(f"{directory}: the weights do not fit config.json "
                             f"({detail[:300]}{'...' if len(detail) > 300 else ''})") from None
        if dtype is not None:
            model.to(dtype)
        return model.eval()

    @classmethod
    def from_config(cls, config: ConformerAEDConfig, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, seed: int | None = None) -> ConformerAED:
        """A randomly initialized model (``seed`` makes it reproducible) in eval mode."""
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = cls(config)
        if dtype is not None:
            model.to(dtype)
        return model.eval()


def _check_fits_weights(cls: type, config: ConformerAEDConfig, weights: str) -> None:
    """Refuse a config whose parameters could not be in ``weights`` (at least one byte each),
    counted on the meta device before the model is allocated for real."""
    with torch.device("meta"):
        numel = sum(p.numel() for p in cls(config).parameters())
    size = os.path.getsize(weights)
    if numel > size:
        raise ValueError(f"{os.path.dirname(weights)}/config.json describes {numel:,} parameters but "
                         f"{weights} holds {size:,} bytes: config and weights do not match")
