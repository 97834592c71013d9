"""A machine with a GPU but without polyaccel's cuda backend is told so, once per model."""

from __future__ import annotations

import logging

import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny


def test_a_gpu_without_the_cuda_backend_is_named(monkeypatch, caplog):
    """``backend="auto"`` resolving to the CPU backend on a machine with a GPU (the cuda backend
    not installed, or not found): one warning naming what to install, not silent reference
    kernels on the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"))
        model.apply_backend(BackendConfig(backend="cpu", compile=False))
    assert "pip install polyaccel-backend-cuda" not in caplog.text  # the CPU backend asked for by name
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        model.apply_backend(BackendConfig(compile=False))
    assert "pip install polyaccel-backend-cuda" in caplog.text
