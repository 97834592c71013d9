"""Configuration, presets and shape arithmetic of :class:`~polyaccel.asr.conformer.ConformerAED`.

Precedence: values passed to a preset function (``canary_1b_flash_shape(vocab_size=...)``)
override the preset's own values, which override the dataclass defaults. A saved
``config.json`` is the complete config and needs no preset to load.

The FLOP counts here are the work the static-shape graphs execute (padded frames and the
whole self-attention cache included), counted as 2 FLOPs per multiply-add of every matmul
and convolution; elementwise work (norms, softmax, activations) is left out.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
from typing import Any


@dataclasses.dataclass(kw_only=True, slots=True)
class ConformerAEDConfig:
    """Shapes and constants of a conformer encoder + transformer decoder ASR model.

    Front end: ``n_mels`` log-mel bins from a ``n_fft``-point STFT with a ``win_length``
    Hann window every ``hop_length`` samples (10 ms at 16 kHz). Feature frames are bucketed
    by ``frame_buckets``; the largest bucket is the longest audio one encoder call takes.
    """

    model_type: str = "conformer_aed"
    # front end
    sample_rate: int = 16000
    n_mels: int = 80
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    # encoder
    d_model: int = 256
    encoder_layers: int = 4
    encoder_heads: int = 4
    encoder_ffn_dim: int = 1024
    conv_kernel_size: int = 9
    subsampling_layers: int = 3  # conv2d stride-2 layers: time is divided by 2**subsampling_layers
    subsampling_channels: int = 256
    # decoder
    decoder_layers: int = 2
    decoder_dim: int = 256
    decoder_heads: int = 4
    decoder_ffn_dim: int = 1024
    decoder_activation: str = "relu"
    tie_word_embeddings: bool = False
    vocab_size: int = 64
    max_decode_len: int = 256
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    layer_norm_eps: float = 1e-5
    # static-shape buckets: feature frames per encoder call, sequences per batch
    frame_buckets: tuple[int, ...] = (1000, 2000, 3000, 4000)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)

    def __post_init__(self) -> None:
        self.frame_buckets = tuple(sorted(int(f) for f in self.frame_buckets))
        self.batch_buckets = tuple(sorted(int(b) for b in self.batch_buckets))
        if self.model_type != "conformer_aed":
            raise ValueError(f"model_type must be 'conformer_aed', got {self.model_type!r}")
        if self.d_model % self.encoder_heads or self.decoder_dim % self.decoder_heads:
            raise ValueError("d_model / decoder_dim must be divisible by their head counts")
        if self.conv_kernel_size % 2 == 0:
            raise ValueError("conv_kernel_size must be odd (same-length depthwise conv)")
        if max(self.pad_token_id, self.bos_token_id, self.eos_token_id) >= self.vocab_size:
            raise ValueError("special token ids must be < vocab_size")

    # ---- derived shapes ----------------------------------------------------------------
    @property
    def subsampling_factor(self) -> int:
        return 2 ** self.subsampling_layers

    @property
    def subsampled_mels(self) -> int:
        """Mel bins left after the stride-2 convs (each rounds up)."""
        return subsampled_length(self.n_mels, self.subsampling_layers)

    @property
    def max_feature_frames(self) -> int:
        return self.frame_buckets[-1]

    @property
    def max_encoder_frames(self) -> int:
        """Encoder frames of the largest bucket: the fixed cross-attention length."""
        return subsampled_length(self.max_feature_frames, self.subsampling_layers)

    @property
    def max_audio_seconds(self) -> float:
        return self.max_feature_frames * self.hop_length / self.sample_rate

    # ---- HF-style config.json ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["frame_buckets"] = list(self.frame_buckets)
        d["batch_buckets"] = list(self.batch_buckets)
        return {"architectures": ["ConformerAED"], **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConformerAEDConfig:
        """Build from a dict; keys that are not fields (``architectures``, ...) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, directory: str | os.PathLike[str]) -> None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ConformerAEDConfig:
        from polyaccel.asr.config_limits import check_sizes, read_json_object

        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in read_json_object(os.path.join(directory, "config.json")).items() if k in names}
        values = {**cls().to_dict(), **given}
        check_values(values, directory)  # the checks of __post_init__ would raise TypeError, ZeroDivisionError
        check_sizes(types.SimpleNamespace(**values), directory)  # before any module of these sizes is made
        return cls.from_dict(values)


_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "tuple[int, ...]": "a non-empty list of integers"}
MAX_BUCKET = {"batch_buckets": 1 << 16, "frame_buckets": 1 << 17}
"""Largest batch and feature-frame bucket a config may ask for (graphs and buffers are sized by them)."""


def check_values(values: dict[str, Any], source: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``source``'s config.json when a field of ``values`` (every
    field of :class:`ConformerAEDConfig`) is not of its type (a string for a size, ``null`` for
    a token id, a list for a bucket), a special token id is outside [0, vocab_size), a bucket
    is outside [1, :data:`MAX_BUCKET`], ``layer_norm_eps`` is not in (0, 1) or
    ``decoder_activation`` is not one core's ops know."""
    from polyaccel.core.ops import _ACTIVATIONS

    where = f"{source}/config.json"

    def bad(name: str, want: str) -> ValueError:
        text = repr(values[name])
        return ValueError(f"{where}: {name}={text if len(text) <= 60 else text[:57] + '...'} is not {want} "
                          "(a corrupt or hand-edited config?)")

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    for f in dataclasses.fields(ConformerAEDConfig):
        v = values[f.name]
        ok = {"int": is_int(v), "float": is_int(v) or isinstance(v, float) and math.isfinite(v),
              "str": isinstance(v, str), "bool": isinstance(v, bool),
              "tuple[int, ...]": isinstance(v, (list, tuple)) and bool(v) and all(is_int(x) for x in v)}[f.type]
        if not ok:
            raise bad(f.name, _KINDS[f.type])
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if not 0 <= values[name] < values["vocab_size"]:
            raise bad(name, f"a token id in [0, vocab_size={values['vocab_size']})")
    for name, top in MAX_BUCKET.items():
        if not all(1 <= b <= top for b in values[name]):
            raise bad(name, f"a list of sizes in [1, {top}]")
    if not 0 < values["layer_norm_eps"] < 1:
        raise bad("layer_norm_eps", "a number in (0, 1)")
    if values["decoder_activation"] not in _ACTIVATIONS:
        raise bad("decoder_activation", f"one of {', '.join(_ACTIVATIONS)}")


def subsampled_length(n: int, layers: int) -> int:
    """Length after ``layers`` convs of kernel 3, stride 2, padding 1: ceil(n / 2) per layer."""
    for _ in range(layers):
        n = (n + 1) // 2
    return n


# ---- presets ---------------------------------------------------------------------------------

def tiny(**overrides: Any) -> ConformerAEDConfig:
    """A few-hundred-thousand-parameter model for tests (up to 8 s of audio)."""
    values: dict[str, Any] = dict(
        n_mels=80, d_model=64, encoder_layers=2, encoder_heads=4, encoder_ffn_dim=128,
        conv_kernel_size=9, subsampling_channels=8, decoder_layers=2, decoder_dim=64,
        decoder_heads=4, decoder_ffn_dim=128, vocab_size=64, max_decode_len=48,
        frame_buckets=(200, 400, 800), batch_buckets=(1, 2, 4, 8),
    )
    return ConformerAEDConfig(**{**values, **overrides})


def canary_180m_flash_shape(**overrides: Any) -> ConformerAEDConfig:
    """Shaped like NVIDIA canary-180m-flash: 17-layer d_model 512 encoder, 4-layer d 1024
    decoder (so the encoder output is projected 512 -> 1024), 128 mels, 5248 tokens."""
    values: dict[str, Any] = dict(
        n_mels=128, d_model=512, encoder_layers=17, encoder_heads=8, encoder_ffn_dim=2048,
        conv_kernel_size=9, subsampling_channels=256, decoder_layers=4, decoder_dim=1024,
        decoder_heads=8, decoder_ffn_dim=4096, vocab_size=5248, max_decode_len=512,
    )
    return ConformerAEDConfig(**{**values, **overrides})


def canary_1b_flash_shape(**overrides: Any) -> ConformerAEDConfig:
    """Shaped like NVIDIA canary-1b-flash: 32-layer d_model 1024 encoder, 4-layer d 1024
    decoder, 128 mels, 5248 tokens."""
    values: dict[str, Any] = dict(
        n_mels=128, d_model=1024, encoder_layers=32, encoder_heads=8, encoder_ffn_dim=4096,
        conv_kernel_size=9, subsampling_channels=256, decoder_layers=4, decoder_dim=1024,
        decoder_heads=8, decoder_ffn_dim=4096, vocab_size=5248, max_decode_len=512,
    )
    return ConformerAEDConfig(**{**values, **overrides})


PRESETS = {"tiny": tiny, "canary_180m_flash_shape": canary_180m_flash_shape,
           "canary_1b_flash_shape": canary_1b_flash_shape}


# ---- FLOPs -------------------------------------------------------------------------------------

def encode_flops(cfg: ConformerAEDConfig, feature_frames: int) -> dict[str, int]:
    """FLOPs of one ``encode`` call for one utterance padded to ``feature_frames`` frames.

    Returns ``{"subsampling": ..., "encoder_layers": ...}`` (the attention score and value
    matmuls included, over the padded length).
    """
    c, t, f = cfg.subsampling_channels, feature_frames, cfg.n_mels
    sub, cin = 0, 1
    for _ in range(cfg.subsampling_layers):
        t, f = (t + 1) // 2, (f + 1) // 2
        sub += 2 * t * f * c * cin * 9
        cin = c
    s, d = t, cfg.d_model
    sub += 2 * s * (c * f) * d  # the linear projection to d_model
    per_layer = (
        2 * 2 * (2 * s * d * cfg.encoder_ffn_dim)  # two half-step FFNs, two matmuls each
        + 2 * s * d * 3 * d + 2 * s * d * d  # fused QKV, output projection
        + 2 * 2 * s * s * d  # scores and weighted values
        + 2 * s * d * 2 * d + 2 * s * d * cfg.conv_kernel_size + 2 * s * d * d  # conv module
    )
    return {"subsampling": sub, "encoder_layers": cfg.encoder_layers * per_layer}


def decoder_state_flops(cfg: ConformerAEDConfig, encoder_frames: int) -> int:
    """FLOPs of ``new_decoder_state`` for one utterance: projecting the encoder output to the
    decoder (when the dims differ) and the cross-attention K/V of every layer."""
    d, s = cfg.decoder_dim, encoder_frames
    proj = 2 * s * cfg.d_model * d if cfg.d_model != d else 0
    return proj + cfg.decoder_layers * 2 * s * d * 2 * d


def decode_step_flops(cfg: ConformerAEDConfig, cache_len: int, encoder_frames: int) -> int:
    """FLOPs of one ``decode_step`` for one sequence, attending over the whole static cache
    of ``cache_len`` positions and ``encoder_frames`` cross-attention frames."""
    d = cfg.decoder_dim
    per_layer = (
        2 * d * 3 * d + 2 * d * d + 2 * 2 * cache_len * d  # self-attention
        + 2 * d * d + 2 * d * d + 2 * 2 * encoder_frames * d  # cross-attention (q, out)
        + 2 * 2 * d * cfg.decoder_ffn_dim
    )
    return cfg.decoder_layers * per_layer + 2 * d * cfg.vocab_size


def flops_per_audio_second(cfg: ConformerAEDConfig, *, audio_seconds: float = 30.0,
                           num_tokens: int = 96, cache_len: int | None = None) -> dict[str, float]:
    """FLOPs per second of audio for one utterance of ``audio_seconds`` decoded for
    ``num_tokens`` steps (the TARGETS workload: 30 s, 96 tokens), split by stage."""
    frames = math.ceil(audio_seconds * cfg.sample_rate / cfg.hop_length)
    enc = encode_flops(cfg, frames)
    s_cross = cfg.max_encoder_frames  # decode_step graphs attend over the largest bucket
    out = {
        "subsampling": enc["subsampling"],
        "encoder_layers": enc["encoder_layers"],
        "decoder_state": decoder_state_flops(cfg, subsampled_length(frames, cfg.subsampling_layers)),
        "decoder_steps": num_tokens * decode_step_flops(cfg, cache_len or cfg.max_decode_len, s_cross),
    }
    out["total"] = sum(out.values())
    return {k: v / audio_seconds for k, v in out.items()}
