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
