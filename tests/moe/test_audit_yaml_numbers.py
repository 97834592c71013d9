"""``model.config`` numbers written with an exponent and no dot (``rms_norm_eps: 1e-6``, as every
config.json has them), which YAML 1.1 reads as text, are numbers: Transformers refused them,
"expected float, got str (value: '1e-6')", in the file and in ``--set`` alike."""

from __future__ import annotations

from pathlib import Path

from polyaccel.moe.train import resolve_model_config
from polyaccel.moe.train_config import load_config

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def test_exponent_numbers_in_model_config_are_numbers(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  preset: qwen3-moe-tiny\n  config:\n    rms_norm_eps: 1e-6\n    rope_theta: 1E6\n"
                      "data:\n  synthetic: {}\n")
    mc = resolve_model_config(load_config(config, ["model.config.initializer_range=2e-2",
                                                   "model.config.router_aux_loss_coef=-1e-3"]).model)
    assert (mc.rms_norm_eps, mc.initializer_range, mc.router_aux_loss_coef) == (1e-6, 2e-2, -1e-3)
    assert mc.rope_parameters["rope_theta"] == 1e6


def test_text_that_is_no_number_stays_text():
    mc = resolve_model_config(load_config(TINY, ["model.config.hidden_act=silu", "model.config.rms_norm_eps=1e-6"]).model)
    assert mc.hidden_act == "silu" and mc.rms_norm_eps == 1e-6


def test_exponent_numbers_in_model_backend_are_numbers():
    from polyaccel.moe.train import backend_config

    sets = ["model.backend.gate=balanced", "model.backend.gate_noise=1e-2"]
    assert backend_config(load_config(TINY, sets).model).gate_noise == 1e-2
