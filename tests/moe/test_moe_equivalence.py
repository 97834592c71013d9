"""polyaccel MoE models against Transformers' own on the same per-expert checkpoint.

Tiny random Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3 models are built and saved by plain Transformers;
ours load them with ``polyaccel.moe.AutoModelForCausalLM.from_pretrained`` and must give the
same logits, loss (with the router aux loss), gradients and greedy generations.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny

ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]


def _pair(tmp_path_factory, model_type: str, dtype=torch.float32, **overrides):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(model_type, **overrides)).to(dtype)
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek: zero at init; make it matter
            buf.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp(model_type)
    hf.save_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, backend=BackendConfig(backend="cpu"))
    return hf.eval(), ours.eval()


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    return _pair(tmp_path_factory, request.param)


def _batch(seed: int = 1, B: int = 2, S: int = 13):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (B, S), generator=g)


def test_ours_is_a_pretrained_model_of_the_same_class_name(pair):
    hf, ours = pair
    assert type(ours).__module__.startswith("polyaccel.moe.models.")
    assert type(ours).__name__ == type(hf).__name__
    assert isinstance(ours, transformers.PreTrainedModel)
    assert isinstance(ours.config, type(hf.config))


def test_same_parameters_names_and_shapes(pair):
    hf, ours = pair
    sd_hf, sd_ours = hf.state_dict(), ours.state_dict()
    assert sd_hf.keys() == sd_ours.keys()
    for k, v in sd_hf.items():
        assert torch.equal(v, sd_ours[k]), k


@pytest.mark.parametrize("loss", ["standard", "fused"])
def test_logits_loss_aux_equal_fp32(pair, loss):
    hf, ours = pair
    ours.apply_backend(BackendConfig(backend="cpu", loss=loss))
    ids = _batch()
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids, output_router_logits=True)
        out = ours(input_ids=ids, labels=ids, output_router_logits=True)
        logits = ours(input_ids=ids).logits
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert (out.logits is None) == (loss == "fused")
    if hasattr(ref, "aux_loss"):  # DeepSeek-V3 has no router aux loss in Transformers either
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, atol=1e-6, rtol=1e-5)
        assert len(out.router_logits) == len(ref.router_logits)
    else:
        assert out.aux_loss is None
    ours.apply_backend(BackendConfig(backend="cpu"))


@pytest.mark.parametrize(("loss", "grad_accumulation"),
                         [("standard", "autograd"), ("fused", "autograd"), ("fused", "fused")])
def test_gradients_equal_fp32(pair, loss, grad_accumulation):
    """Gradients accumulated over two micro-batches equal Transformers' (with
    ``grad_accumulation="fused"`` the expert weight gradients bypass autograd's accumulation)."""
    hf, ours = pair
    ours.apply_backend(BackendConfig(backend="cpu", loss=loss, grad_accumulation=grad_accumulation))
    hf.zero_grad(), ours.zero_grad()
    for seed in (2, 3):
        ids = _batch(seed=seed)
        hf(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
        ours(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
    g_ours = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        q = g_ours[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=2e-6, rtol=1e-4, msg=name)
    hf.zero_grad(), ours.zero_grad()
    ours.apply_backend(BackendConfig(backend="cpu"))


def test_eager_experts_equal_grouped_mm(pair):
    _, ours = pair
    ids = _batch(seed=3)
    with torch.no_grad():
        grouped = ours(input_ids=ids).logits
        ours.apply_backend(BackendConfig(backend="cpu", experts="eager"))
        eager = ours(input_ids=ids).logits
        ours.apply_backend(BackendConfig(backend="cpu"))
    torch.testing.assert_close(eager, grouped, atol=1e-5, rtol=1e-5)


def test_left_padding_matches_on_real_tokens(pair):
    hf, ours = pair
    ids = _batch(seed=4, S=10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask).logits
        out = ours(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss", ["standard", "fused"])
def test_left_padding_loss_and_gradients_match(pair, loss):
    """Labels of a left-padded row: the last padding position predicts the first real token, so
    its output is in the loss. Its query sees no key: its attention output is zeros, as in
    Transformers; it once attended everywhere, seeing the token it predicts: another loss,
    other gradients."""
    hf, ours = pair
    ids = _batch(seed=7, S=9)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    ours.apply_backend(BackendConfig(backend="cpu", loss=loss))
    hf.zero_grad(), ours.zero_grad()
    try:
        ref = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        out = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        ref.backward(), out.backward()
        grads = dict(ours.named_parameters())
        for name, p in hf.named_parameters():
            torch.testing.assert_close(grads[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        hf.zero_grad(set_to_none=True), ours.zero_grad(set_to_none=True)
        ours.apply_backend(BackendConfig(backend="cpu"))


def test_greedy_generate_matches(pair):
    hf, ours = pair
    ids = _batch(seed=5, B=2, S=7)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    out = ours.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(out, ref)


def test_generate_with_left_padding_matches(pair):
    hf, ours = pair
    ids = _batch(seed=6, B=2, S=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(ours.generate(ids, **kw), hf.generate(ids, **kw))


@pytest.mark.parametrize("model_type", ARCHS)
def test_bf16_close_to_transformers(tmp_path_factory, model_type):
    hf, ours = _pair(tmp_path_factory, model_type, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ours.apply_backend(BackendConfig(backend="cpu", loss="standard"))
    ids = _batch(seed=7)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
        out = ours(input_ids=ids, labels=ids)
        fused = ours.apply_backend(BackendConfig(backend="cpu"))(input_ids=ids, labels=ids).loss
    assert out.logits.dtype == torch.bfloat16
    scale = ref.logits.float().abs().max()
    assert (out.logits.float() - ref.logits.float()).abs().max() <= 0.03 * scale
    torch.testing.assert_close(out.loss, ref.loss, atol=0.0, rtol=1e-2)
    torch.testing.assert_close(fused, ref.loss, atol=0.0, rtol=1e-2)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_yarn_rope_matches(tmp_path_factory, model_type):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf, ours = _pair(tmp_path_factory, model_type, rope_parameters=rope)
    ids = _batch(seed=8, S=48)  # past original_max_position_embeddings
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_deepseek_router_bias_stays_fp32_in_bf16(tmp_path_factory):
    _, ours = _pair(tmp_path_factory, "deepseek_v3", dtype=torch.bfloat16)
    gate = ours.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(("model_type", "overrides"), [
    ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2)),
    ("olmoe", dict(clip_qkv=0.02)),  # small enough that the clamp of q, k and v acts
])
def test_config_switches_match_transformers(tmp_path_factory, model_type, overrides):
    """Config fields the default tiny configs leave inactive: Qwen3-MoE's
    ``decoder_sparse_step`` (which layers are MoE) and OLMoE's ``clip_qkv`` clamping."""
    hf, ours = _pair(tmp_path_factory, model_type, **overrides)
    with torch.no_grad():
        for p in hf.parameters():  # weights large enough for the clamp to bind
            p.mul_(8.0)
        for p in ours.parameters():
            p.mul_(8.0)
    ids = _batch()
    torch.testing.assert_close(ours(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_incremental_decoding_without_position_ids_matches_one_forward(pair):
    """A hand-written decoding loop (``past_key_values``, no ``position_ids``): each new token
    is placed after the cached ones, so its logits equal those of one full forward (decoding
    past Mixtral's 6-token sliding window, so one-token steps must apply it too)."""
    _, ours = pair
    ids = _batch(S=15)
    with torch.no_grad():
        full = ours(input_ids=ids).logits
        out = ours(input_ids=ids[:, :6], use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(6, 15):
            out = ours(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:], rtol=1e-4, atol=1e-5)
