"""Training with polyaccel MoE models: optimizer steps, activation checkpointing, gates."""

from __future__ import annotations

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny


def _model(model_type: str = "qwen3_moe", seed: int = 0, **backend):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny(model_type), backend=BackendConfig(backend="cpu", **backend))
    return model.train()


def _grads(model, ids, **kw) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids, output_router_logits=True, **kw).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type,backend", [
    ("qwen3_moe", {}),
    ("mixtral", {"loss": "standard", "experts": "eager"}),
    ("olmoe", {"gate": "balanced", "gate_noise": 0.3}),
    ("deepseek_v3", {"experts": "eager"}),
])
def test_adamw_steps_reduce_the_loss(model_type, backend):
    model = _model(model_type, **backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("model_type,backend", [
    ("qwen3_moe", {}),
    ("mixtral", {}),
    ("olmoe", {"gate": "balanced", "gate_noise": 0.5}),
    ("deepseek_v3", {}),
])
def test_gradient_checkpointing_gives_the_same_gradients(model_type, backend):
    model = _model(model_type, **backend)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain = _grads(model, ids)
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    torch.manual_seed(5)
    ckpt = _grads(model, ids)
    model.gradient_checkpointing_disable()
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_mixtral_jitter_noise_recomputes_identically():
    torch.manual_seed(0)
    cfg = tiny("mixtral", router_jitter_noise=0.1)
    model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(backend="cpu")).train()
    ids = torch.randint(3, 97, (2, 12))
    torch.manual_seed(5)
    plain = _grads(model, ids)
    model.gradient_checkpointing_enable()
    torch.manual_seed(5)
    ckpt = _grads(model, ids)
    for name, g in plain.items():
        torch.testing.assert_close(ckpt[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_balanced_gate_trains_experts_not_router():
    model = _model("qwen3_moe", gate="balanced")
    ids = torch.randint(3, 97, (2, 8))
    grads = _grads(model, ids)
    assert "model.layers.0.mlp.gate.weight" not in grads
    assert grads["model.layers.0.mlp.experts.gate_up_proj"].abs().sum() > 0
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert out.aux_loss is None and out.router_logits == ()


def test_fused_rms_norm_matches_torch_rms_norm():
    model = _model("olmoe")
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        model.apply_backend(BackendConfig(backend="cpu", rms_norm="fused"))
        assert model.model.norm.impl == "fused"
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_peft_style_input_grads_and_frozen_base():
    """Only some parameters trainable (as with adapters): backward still works."""
    model = _model("qwen3_moe")
    for name, p in model.named_parameters():
        p.requires_grad_("experts" in name)
    model.enable_input_require_grads()
    model.gradient_checkpointing_enable()
    ids = torch.randint(3, 97, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("experts" in n for n in trained)


@pytest.mark.slow
def test_compile_each_decoder_layer(monkeypatch):
    """compile=True wraps every decoder layer in torch.compile (traced by dynamo with the
    cheap "eager" backend here; Inductor on CPU would take minutes)."""
    import functools

    monkeypatch.setattr(torch.nn.Module, "compile",
                        functools.partialmethod(torch.nn.Module.compile, backend="eager"))
    model = _model("qwen3_moe")
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids).loss
        model.apply_backend(BackendConfig(backend="cpu", compile=True))
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
        out = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_peft_lora_on_attention_and_fused_experts(tmp_path):
    peft = pytest.importorskip("peft")
    model = _model("qwen3_moe").eval()
    ids = torch.randint(3, 97, (2, 8))
    with torch.no_grad():
        base = model(input_ids=ids).logits
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                          target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    lora = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # LoRA B starts at zero: same function
        torch.testing.assert_close(lora(input_ids=ids).logits, base)
    lora.train()
    lora(input_ids=ids, labels=ids).loss.backward()
    trained = {n for n, p in lora.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in n for n in trained)
    assert any("mlp.experts.lora_A" in n for n in trained)
    lora.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()
