"""The pre-flight memory check of a training run counts weights + gradients + AdamW's two
moments (not the weights alone), refuses with exit 2 before anything is built when they exceed
the free memory, and never refuses a run that fits (the H200 reference workload)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyaccel.moe import train
from polyaccel.moe.cli import main
from polyaccel.moe.train_config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "packages/moe/examples"
GIB = 2**30


def _weights(cfg, dtype: torch.dtype) -> int:
    """The model's weight bytes, counted on the meta device."""
    model_config = train.resolve_model_config(cfg.model)
    cls, _ = train.auto_model_class(cfg.model.implementation)
    with torch.device("meta"):
        model = cls.from_config(model_config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _nothing_built(monkeypatch) -> list:
    """Refuse to build a model anywhere but on the meta device (where the check counts it): a
    run the check lets through stops there, instead of allocating (a 10 GiB model here)."""
    built: list = []
    cls, _ = train.auto_model_class("polyaccel")
    original = cls.from_config

    def on_meta_only(*args, **kwargs):
        if torch.get_default_device().type != "meta":
            built.append(args)
            raise AssertionError("the model was built")
        return original(*args, **kwargs)
    monkeypatch.setattr(cls, "from_config", on_meta_only)
    return built


def test_a_run_whose_weights_fit_but_whose_training_state_does_not_is_refused_before_building(
        capsys, tmp_path, monkeypatch):
    """Twice the weights free: the weights alone fit, weights + grads + two moments (4x) do not."""
    weights = _weights(load_config(EXAMPLES / "tiny_synthetic_cpu.yaml"), torch.float32)
    monkeypatch.setattr(train, "available_memory", lambda device: 2 * weights)
    built = _nothing_built(monkeypatch)
    code = main(["finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"), "--set", f"checkpoint.dir={tmp_path}/ck",
                 "--set", f"output_dir={tmp_path}/out"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert f"training this model needs at least 0.0 GiB on cpu before any activations ({4 * weights:,} bytes)" in err
    assert "their gradients" in err and "AdamW's two moments" in err and "(float32, the param dtype)" in err
    assert f"cpu has 0.0 GiB free ({2 * weights:,} bytes)" in err and "--preset qwen3-moe-tiny on a CPU" in err
    assert not built and list(tmp_path.iterdir()) == []


def test_bench_of_the_reference_preset_on_a_23_gib_cpu_is_refused_at_once(capsys, monkeypatch):
    """The reported case: qwen3-30b-a3b-L8 (10.4 GiB of bf16 weights) on a 23 GiB CPU machine
    was OOM-killed minutes later; now exit 2 before the model is built."""
    monkeypatch.setattr(train, "available_memory", lambda device: 23 * GIB)
    built = _nothing_built(monkeypatch)
    code = main(["bench", "--preset", "qwen3-30b-a3b-L8", "--set", "train.device=cpu", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and not built, err
    assert "training this model needs at least 41.8 GiB on cpu" in err and "the model's weights alone take 10.4 GiB" in err
    assert "cpu has 23.0 GiB free" in err and "--preset qwen3-moe-tiny" in err


def _check(cfg, free: int, monkeypatch, *, dtype=torch.bfloat16, world_size: int = 1) -> None:
    monkeypatch.setattr(train, "available_memory", lambda device: free)
    model_config = train.resolve_model_config(cfg.model)
    cls, _ = train.auto_model_class(cfg.model.implementation)
    train._check_weights_fit(cls, model_config, {"dtype": dtype}, torch.device("cpu"), train=cfg.train, lora=cfg.lora,
                             world_size=world_size)


def test_the_h200_reference_run_still_passes(monkeypatch):
    """qwen3-30b-a3b-L8, bf16 params, FlatAdamW: measured at ~54 GiB peak on an H200 (141 GB,
    about 139 GiB free). What the check counts is a lower bound of that peak, so it passes with
    54 GiB free, let alone an H200's free memory; fp32 master weights (16 bytes a param) too."""
    cfg = load_config(values={"model": {"preset": "qwen3-30b-a3b-L8"}})
    weights = _weights(cfg, torch.bfloat16)
    need = train.training_state_bytes(weights)["total"]
    assert need == 4 * weights and need < 42 * GIB
    _check(cfg, 54 * GIB, monkeypatch)
    _check(cfg, 139 * GIB, monkeypatch, dtype=torch.float32)
    with pytest.raises(ConfigError, match="needs at least 41.8 GiB"):
        _check(cfg, 41 * GIB, monkeypatch)
    # Under FSDP2 (2 ranks) each rank holds the whole model while loading it and half the state.
    _check(cfg, 21 * GIB, monkeypatch, world_size=2)


def test_lora_counts_gradients_and_moments_of_the_adapters_only(monkeypatch):
    cfg = load_config(EXAMPLES / "lora_tiny_cpu.yaml")
    weights = _weights(cfg, torch.float32)
    parts = train.training_state_bytes(weights, model_config=train.resolve_model_config(cfg.model), lora=cfg.lora)
    adapters = parts["grads"]
    assert 0 < adapters < weights and parts["moments"] == 2 * adapters
    assert parts["total"] == weights + 4 * adapters
    _check(cfg, parts["total"], monkeypatch, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"\(frozen: no gradients\), the LoRA adapters' gradients"):
        _check(cfg, parts["total"] - 1, monkeypatch, dtype=torch.float32)
