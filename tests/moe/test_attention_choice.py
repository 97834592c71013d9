"""``BackendConfig(attn="auto")``: the per-shape choice between a backend's flash kernel for
core's ``causal_attention`` and SDPA, and the model wiring that uses the choice.

On CPU no backend registers ``causal_attention``; these tests register a stand-in for the
``cpu`` device type (core's reference, counting its calls), so the timing, the caching and the
model's path are exercised without a GPU.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from polyaccel.core import ops
from polyaccel.core.kernels import registry
from polyaccel.moe import AutoModelForCausalLM, BackendConfig, attention_choice
from polyaccel.moe.presets import tiny

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(attention_choice, "_CHOSEN", {})
    monkeypatch.setattr(attention_choice, "TIMED_CALLS", 2)


@pytest.fixture
def flash_on_cpu():
    """A registered ``causal_attention`` for CPU tensors (the reference), with its call count."""
    calls = []

    def fake_flash(q, k, v, scale=None):  # noqa: ANN001, ANN202
        calls.append(q.shape)
        return ops.causal_attention.reference(q, k, v, scale)

    registry.register("causal_attention", "cpu", fake_flash, impl="test-flash", backend="test")
    yield calls
    registry.unregister("causal_attention", "cpu")


def slow(fn, seconds: float):  # noqa: ANN001, ANN201
    def wrapped(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        time.sleep(seconds)
        return fn(*a, **kw)
    return wrapped


def test_nothing_registered_means_sdpa_without_timing(monkeypatch):
    monkeypatch.setattr(attention_choice, "_measure", lambda key: pytest.fail("timed with no kernel to compare"))
    assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "sdpa"


def test_the_faster_kernel_wins_and_the_choice_is_kept_per_shape(monkeypatch, flash_on_cpu):
    monkeypatch.setattr(attention_choice, "sdpa_attention", slow(attention_choice.sdpa_attention, 0.05))
    assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "fa4"
    timed = len(flash_on_cpu)
    assert timed >= 2
    assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "fa4"
    assert len(flash_on_cpu) == timed  # remembered: not timed again
    assert attention_choice.chosen() == {(1, 16, 4, 2, 8, 8, torch.float32, CPU): "fa4"}
    assert attention_choice.choose(1, 13, 4, 2, 8, 8, torch.float32, CPU) == "fa4"  # same power-of-two bucket
    assert len(flash_on_cpu) == timed
    attention_choice.choose(1, 17, 4, 2, 8, 8, torch.float32, CPU)  # the next bucket: timed
    assert len(flash_on_cpu) > timed


def test_timed_under_inference_mode_too(monkeypatch, flash_on_cpu):
    monkeypatch.setattr(attention_choice, "sdpa_attention", slow(attention_choice.sdpa_attention, 0.05))
    with torch.inference_mode():
        assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "fa4"


def test_a_slower_flash_kernel_is_not_chosen(monkeypatch, flash_on_cpu):
    registry.register("causal_attention", "cpu", slow(ops.causal_attention.reference, 0.05), impl="slow",
                      backend="test")
    assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "sdpa"


def test_a_flash_kernel_that_fails_is_not_chosen(caplog):
    def broken(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no kernel for this head dim")

    registry.register("causal_attention", "cpu", broken, impl="broken", backend="test")
    try:
        with caplog.at_level(logging.WARNING):
            assert attention_choice.choose(1, 16, 4, 2, 8, 8, torch.float32, CPU) == "sdpa"
    finally:
        registry.unregister("causal_attention", "cpu")
    assert "no kernel for this head dim" in caplog.text


def _model(attn: str, model_type: str = "qwen3_moe"):  # noqa: ANN202
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(model_type))
    return model.apply_backend(BackendConfig(backend="cpu", attn=attn, compile=False))


def flash_measures_faster(monkeypatch) -> None:
    """Timing that always finds the flash kernel faster (the model tests are about the wiring,
    not about which kernel a loaded machine times as faster)."""
    monkeypatch.setattr(attention_choice, "_time_ms", lambda fn, *a: 1.0 if fn is ops.causal_attention else 2.0)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_auto_runs_the_chosen_kernel_in_every_layer_with_the_same_loss(monkeypatch, flash_on_cpu, model_type):
    flash_measures_faster(monkeypatch)
    auto = _model("auto", model_type)
    ids = torch.randint(0, auto.config.vocab_size, (2, 12))
    loss = auto(input_ids=ids, labels=ids).loss
    loss.backward()
    layers = auto.config.num_hidden_layers
    assert len(flash_on_cpu) == layers  # one call per layer
    calls_after_first = len(flash_on_cpu)
    auto(input_ids=ids, labels=ids).loss.backward()
    assert len(flash_on_cpu) - calls_after_first == layers  # one call per layer, nothing re-timed
    reference = _model("sdpa", model_type)(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, reference)


def test_padding_masks_and_caches_keep_sdpa(monkeypatch, flash_on_cpu):
    flash_measures_faster(monkeypatch)
    model = _model("auto")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    model(input_ids=ids, attention_mask=mask)
    model.eval()
    model(input_ids=ids, use_cache=True)
    assert flash_on_cpu == []


def test_sdpa_when_forced(flash_on_cpu):
    model = _model("sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert flash_on_cpu == []


def test_fa4_names_what_to_install_when_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("flash_attn") else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install 'polyaccel-backend-cuda\[fa4\]'"):
        BackendConfig(attn="fa4")

