"""Bounds on the sizes a model's ``config.json`` may ask for, checked before anything is built.

A config is read from a folder anyone may hand us; its sizes decide what is allocated (the
model's modules, the mel filterbank, per-batch buffers) before the weights are compared with
it. ``d_model: 1000000000`` or ``n_fft: 1000000000`` would otherwise allocate terabytes (or
build millions of layers) before the first error. The bounds are far above every real
checkpoint (Whisper large-v3: d_model 1280, 32 layers, 128 mels).
"""

from __future__ import annotations

import json
import os
from typing import Any

LIMITS: dict[str, tuple[int, int]] = {
    "d_model": (1, 16384), "decoder_dim": (1, 16384),
    "num_mel_bins": (1, 1024), "n_mels": (1, 1024),
    "encoder_layers": (1, 256), "decoder_layers": (1, 256), "subsampling_layers": (0, 8),
    "encoder_attention_heads": (1, 1024), "decoder_attention_heads": (1, 1024),
    "encoder_heads": (1, 1024), "decoder_heads": (1, 1024),
    "encoder_ffn_dim": (1, 131072), "decoder_ffn_dim": (1, 131072),
    "subsampling_channels": (1, 16384), "conv_kernel_size": (1, 1024),
    "vocab_size": (1, 1 << 20),
    "max_source_positions": (1, 1 << 20), "max_target_positions": (1, 1 << 16), "max_decode_len": (1, 1 << 16),
    "n_fft": (16, 1 << 16), "win_length": (1, 1 << 16), "hop_length": (1, 1 << 16),
    "sample_rate": (1000, 768_000), "chunk_seconds": (1, 3600),
}
"""Inclusive (lowest, highest) value of each integer size field that a config may set."""

MAX_CHUNK_SAMPLES = 1 << 26
"""Most samples in one window (sample_rate x chunk_seconds): 64 Mi, 70 min at 16 kHz."""


def read_json_object(path: str | os.PathLike, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in the file ``path`` (a model's ``config.json``, ``tokenizer.json``, ...).

    Malformed JSON, invalid UTF-8, JSON nested deeper than Python's parser recurses (``[[[[...``:
    a ``RecursionError`` otherwise) and JSON that is not an object raise ``error`` (a
    ``ValueError``) naming the file; ``OSError`` passes through."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    except RecursionError:
        raise error(f"{os.fspath(path)}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # json.JSONDecodeError, or invalid UTF-8 above
        raise error(f"{os.fspath(path)}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{os.fspath(path)}: not a JSON object (got {type(data).__name__})")
    return data


def check_sizes(config: Any, source: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``source``'s config.json when a size field of ``config`` (a
    dataclass) is not an integer within :data:`LIMITS`, or a head count does not divide its width."""
    where = f"{source}/config.json"
    for name, (lo, hi) in LIMITS.items():
        if not hasattr(config, name):
            continue
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{where}: {name}={value!r} is not an integer in [{lo}, {hi}]; "
                             f"refused before anything is allocated (a corrupt or hostile config?)")
    for width, heads in (("d_model", "encoder_attention_heads"), ("d_model", "decoder_attention_heads"),
                         ("d_model", "encoder_heads"), ("decoder_dim", "decoder_heads")):
        if hasattr(config, width) and hasattr(config, heads) and getattr(config, width) % getattr(config, heads):
            raise ValueError(f"{where}: {width}={getattr(config, width)} is not divisible by "
                             f"{heads}={getattr(config, heads)}")
    if hasattr(config, "chunk_seconds") and config.sample_rate * config.chunk_seconds > MAX_CHUNK_SAMPLES:
        raise ValueError(f"{where}: a window of {config.chunk_seconds} s at {config.sample_rate} Hz is over "
                         f"{MAX_CHUNK_SAMPLES} samples")
    if hasattr(config, "hop_length") and hasattr(config, "n_fft") and config.hop_length > config.n_fft:
        raise ValueError(f"{where}: hop_length={config.hop_length} is longer than n_fft={config.n_fft}")


def check_weights_fit(expected: dict[str, Any], found: dict[str, Any], source: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``source`` when the tensors ``found`` in its weights (name ->
    shape) are not the ones its config describes (``expected``): missing, unexpected or of
    another shape. One short line, not a list of every parameter."""
    def shape(s: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in s)

    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & found.keys() if shape(expected[k]) != shape(found[k]))
    problems = [f"{len(missing)} missing (e.g. {missing[0]!r})"] if missing else []
    problems += [f"{len(unexpected)} unexpected (e.g. {unexpected[0]!r})"] if unexpected else []
    problems += [f"{len(wrong)} of another shape (e.g. {wrong[0]!r}: {list(shape(found[wrong[0]]))}, "
                 f"config.json says {list(shape(expected[wrong[0]]))})"] if wrong else []
    if problems:
        raise ValueError(f"{source}: the weights do not fit config.json: tensors {', '.join(problems)}")
