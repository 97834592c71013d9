"""Checkpoint compatibility: per-expert HF checkpoints in, per-expert HF checkpoints out,
and the drop-in's fallback for architectures we do not implement."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from safetensors import safe_open

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny

ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]


def _keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _train_a_little(model) -> None:
    """Change every weight so a round trip cannot pass by reloading the original file."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (i + 1))


@pytest.mark.parametrize("model_type", ARCHS)
def test_save_writes_per_expert_keys_that_plain_transformers_loads(tmp_path, model_type):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(model_type))
    hf.save_pretrained(tmp_path / "hf")
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", backend=BackendConfig(backend="cpu"))
    _train_a_little(ours)
    ours.save_pretrained(tmp_path / "ours")

    assert _keys(tmp_path / "ours") == _keys(tmp_path / "hf")  # per-expert keys, HF naming
    assert not any(k.endswith("gate_up_proj") for k in _keys(tmp_path / "ours"))
    arch = json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"]
    assert arch == [type(hf).__name__]

    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert type(back) is type(hf)
    sd_back, sd_ours = back.state_dict(), ours.state_dict()
    assert sd_back.keys() == sd_ours.keys()
    for k, v in sd_ours.items():
        assert torch.equal(sd_back[k], v), k


def test_from_config_model_round_trips_through_plain_transformers(tmp_path):
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"))
    assert type(ours).__module__ == "polyaccel.moe.models.qwen3_moe"
    experts = ours.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 32, 32) and experts.down_proj.shape == (8, 32, 16)
    assert ours.model.layers[0].mlp.gate.weight.shape == (8, 32)
    assert experts.gate_up_proj.std() > 0  # initialised, not left empty
    ours.save_pretrained(tmp_path)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in _keys(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # and ours reads it back again, the forward unchanged
    again = AutoModelForCausalLM.from_pretrained(tmp_path, backend=BackendConfig(backend="cpu"))
    ids = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, ours(input_ids=ids).logits)
        torch.testing.assert_close(back(input_ids=ids).logits, ours(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_tied_embeddings_stay_tied(tmp_path):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny("qwen3_moe", tie_word_embeddings=True))
    hf.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, backend=BackendConfig(backend="cpu"))
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight)


def test_config_kwargs_and_dtype_pass_through(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny("olmoe")).save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, output_router_logits=True,
                                                backend=BackendConfig(backend="cpu"))
    assert ours.config.output_router_logits is True
    assert ours.dtype == torch.bfloat16
    out = ours(input_ids=torch.randint(3, 97, (1, 5)))
    assert out.aux_loss is not None


def test_unsupported_architecture_falls_back_to_transformers(tmp_path, caplog):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path, backend=BackendConfig(backend="cpu"))
    assert type(model) is transformers.LlamaForCausalLM
    assert "model_type='llama'" in caplog.text and "no polyaccel implementation" in caplog.text
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(backend="cpu", gate="balanced"))
    assert type(model) is transformers.LlamaForCausalLM
    assert "not applicable: gate=balanced" in caplog.text


def test_unsupported_rope_falls_back_with_reason(caplog):
    cfg = tiny("qwen3_moe", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(backend="cpu"))
    assert type(model) is transformers.Qwen3MoeForCausalLM
    assert "rope_type='dynamic'" in caplog.text


def test_expert_parallel_without_a_process_group_is_refused_clearly():
    from polyaccel.core.parallel import ParallelPlan

    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        AutoModelForCausalLM.from_config(tiny("qwen3_moe"), parallel=ParallelPlan(dp=2, ep=2))
    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), parallel=ParallelPlan(dp=2),
                                             backend=BackendConfig(backend="cpu"))
    assert model.parallel_plan.ep == 1


def test_backend_must_be_a_backend_config():
    with pytest.raises(TypeError, match="BackendConfig"):
        AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend={"experts": "eager"})


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("model_type", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sharded_tied_saves_interchange_both_ways(tmp_path, model_type, dtype):
    """Tied embeddings, a small ``max_shard_size`` (several files and an index) and the dtype:
    ours -> plain Transformers and plain -> ours keep every tensor, the tie, the dtype and (fp32)
    the logits; the saved config.json is Transformers' own."""
    torch.manual_seed(0)
    config = tiny(model_type, tie_word_embeddings=True)
    ours = AutoModelForCausalLM.from_config(config, backend=BackendConfig(backend="cpu"), dtype=dtype)
    _train_a_little(ours)
    ours.save_pretrained(tmp_path / "ours", max_shard_size="20KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "ours").glob("*.safetensors"))) > 1
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "ours" / "config.json").read_text()).keys() == \
        json.loads((tmp_path / "hf" / "config.json").read_text()).keys()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    plain.save_pretrained(tmp_path / "plain", max_shard_size="20KB")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype="auto", backend=BackendConfig(backend="cpu"))
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    for model in (plain, back):
        assert model.dtype == dtype
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        for k, v in ours.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
        if dtype == torch.float32:
            with torch.no_grad():
                torch.testing.assert_close(model.eval()(input_ids=ids).logits, ours.eval()(input_ids=ids).logits,
                                           rtol=1e-5, atol=1e-5)
    assert _tensors(tmp_path / "plain").keys() == _tensors(tmp_path / "ours").keys()
