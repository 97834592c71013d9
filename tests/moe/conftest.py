"""Fixtures shared by the MoE tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE saved by ``save_pretrained`` (the example config's shape, 4 experts)."""
    from polyaccel.moe import AutoModelForCausalLM
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import preset

    path = tmp_path_factory.mktemp("saved") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(resolve_model_config(preset("qwen3-moe-tiny").model)).save_pretrained(path)
    return path


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(disk)``: every safetensors file written under ``disk`` fails from then on, as
    on a full disk (Transformers' ``save_pretrained`` path)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    real = transformers.modeling_utils.safe_save_file
    disks: list[Path] = []

    def save(tensors, filename, *args, **kwargs):
        if any(Path(filename).resolve().is_relative_to(d.resolve()) for d in disks):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save)
    return disks.append
