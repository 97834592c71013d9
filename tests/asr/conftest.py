"""Fixtures shared by the ASR tests: real speech and Transformers' Whisper, loaded once per session."""

from __future__ import annotations

import numpy as np
import pytest

from polyaccel.asr import samples


@pytest.fixture(scope="session")
def librivox_clips() -> list[np.ndarray]:
    """The five LibriVox clips (16 kHz mono float32), in file-name order; skips without them."""
    import soundfile as sf

    folder = samples.librivox_dir()
    if folder is None:
        pytest.skip(f"LibriVox clips missing: {samples.INSTALL_HINT}")
    return [sf.read(f, dtype="float32")[0] for f in sorted(folder.glob("*.wav"))]


@pytest.fixture(scope="session")
def hf_whisper():
    """``hf_whisper(path)``: (``WhisperProcessor``, fp32 ``WhisperForConditionalGeneration``) of
    a converted folder, loaded once per session (tests must not change them)."""
    import torch
    import transformers

    loaded = {}

    def get(path):
        key = str(path)
        if key not in loaded:
            loaded[key] = (transformers.WhisperProcessor.from_pretrained(path),
                           transformers.WhisperForConditionalGeneration.from_pretrained(
                               path, dtype=torch.float32).eval())
        return loaded[key]

    return get
