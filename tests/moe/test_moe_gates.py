"""Routers, the balanced gate, the losses and BackendConfig validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter, load_balancing_loss_func

from polyaccel.moe import BackendConfig
from polyaccel.moe.layers import (
    SigmoidGroupRouter,
    TopKRouter,
    balanced_routing,
    causal_lm_loss,
    linear_cross_entropy_sum,
    load_balancing_loss,
)
from polyaccel.moe.presets import tiny


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_learned_router_matches_qwen3(norm_topk_prob):
    cfg = tiny("qwen3_moe", norm_topk_prob=norm_topk_prob)
    ref = Qwen3MoeTopKRouter(cfg)
    ours = TopKRouter(cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok, norm_topk_prob)
    torch.nn.init.normal_(ref.weight)
    ours.weight.data.copy_(ref.weight)
    x = torch.randn(50, cfg.hidden_size)
    logits_r, w_r, idx_r = ref(x)
    logits, w, idx = ours(x)
    torch.testing.assert_close(logits, logits_r)
    assert torch.equal(idx, idx_r)
    torch.testing.assert_close(w, w_r.float())
    if norm_topk_prob:
        torch.testing.assert_close(w.sum(-1), torch.ones(50))


def test_learned_router_matches_mixtral():
    cfg = tiny("mixtral")
    ref = MixtralTopKRouter(cfg)
    torch.nn.init.normal_(ref.weight)
    ours = TopKRouter(cfg.num_local_experts, cfg.hidden_size, cfg.num_experts_per_tok, True)
    ours.weight.data.copy_(ref.weight)
    x = torch.randn(40, cfg.hidden_size)
    _, w_r, idx_r = ref(x)
    _, w, idx = ours(x)
    assert torch.equal(idx, idx_r)
    torch.testing.assert_close(w, w_r)


def test_sigmoid_group_router_matches_deepseek_v3():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = tiny("deepseek_v3")
    ref = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(ref.weight)
    ref.e_score_correction_bias.normal_(0.0, 0.5)
    ours = SigmoidGroupRouter(cfg.n_routed_experts, cfg.hidden_size, cfg.num_experts_per_tok, True,
                              cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(60, cfg.hidden_size)
    _, w_r, idx_r = ref(x)
    _, w, idx = ours(x)
    order_r, order = idx_r.sort(-1), idx.sort(-1)  # top-k order is unspecified (sorted=False)
    assert torch.equal(order.values, order_r.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_r.gather(1, order_r.indices))
    groups = idx // (cfg.n_routed_experts // cfg.n_group)
    assert all(len(set(row.tolist())) <= cfg.topk_group for row in groups)
    ours.mode = "balanced"
    _, w, idx = ours(x)
    assert torch.equal(torch.bincount(idx.reshape(-1), minlength=8), torch.full((8,), 15))


@pytest.mark.parametrize("T,k,E", [(64, 2, 8), (96, 8, 128), (30, 4, 6)])
def test_balanced_gate_gives_exactly_equal_loads(T, k, E):
    x = torch.randn(T, 16)
    w, idx = balanced_routing(x, k, E)
    loads = torch.bincount(idx.reshape(-1), minlength=E)
    assert loads.min() == loads.max() == T * k // E
    assert torch.equal(w, torch.full((T, k), 1.0 / k))
    assert all(len(set(row.tolist())) == k for row in idx)  # k distinct experts per token


def test_balanced_gate_noise_is_deterministic_in_the_input():
    x = torch.randn(256, 16)
    w1, idx1 = balanced_routing(x, 2, 8, noise=0.5)
    _, idx2 = balanced_routing(x.clone(), 2, 8, noise=0.5)
    _, idx3 = balanced_routing(torch.randn(256, 16), 2, 8, noise=0.5)
    assert torch.equal(idx1, idx2)
    assert not torch.equal(idx1, idx3)
    loads = torch.bincount(idx1.reshape(-1), minlength=8)
    assert loads.sum() == 512 and loads.min() < loads.max()  # uneven, like a real router
    assert all(len(set(row.tolist())) == 2 for row in idx1)
    torch.testing.assert_close(w1.sum(-1), torch.ones(256))


def test_balanced_gate_in_router_module():
    router = TopKRouter(8, 16, 2, False)
    router.mode = "balanced"
    logits, w, idx = router(torch.randn(32, 16))
    assert logits is None
    assert torch.equal(torch.bincount(idx.reshape(-1), minlength=8), torch.full((8,), 8))


@pytest.mark.parametrize("with_mask", [False, True])
def test_load_balancing_loss_matches_transformers(with_mask):
    torch.manual_seed(0)
    B, S, E, k = 2, 7, 8, 2
    logits = tuple(torch.randn(B * S, E) for _ in range(3))
    mask = None
    if with_mask:
        mask = torch.ones(B, S, dtype=torch.long)
        mask[0, :3] = 0
    ref = load_balancing_loss_func(logits, E, k, mask)
    ours = load_balancing_loss(logits, E, k, mask)
    torch.testing.assert_close(ours, ref)
    assert load_balancing_loss([None, None], E, k) is None


@pytest.mark.parametrize("dtype,chunk,tol", [(torch.float32, 5, 1e-5), (torch.float32, 1000, 1e-5),
                                             (torch.bfloat16, 6, 2e-2)])
def test_chunked_linear_cross_entropy_matches_full_logits(dtype, chunk, tol):
    torch.manual_seed(0)
    N, H, V = 23, 16, 50
    h = torch.randn(N, H, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(V, H, dtype=dtype)).requires_grad_()
    y = torch.randint(0, V, (N,))
    y[[2, 7, 19]] = -100
    ref = F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="sum")
    ref.backward(torch.tensor(0.5))
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    out = linear_cross_entropy_sum(h, w, y, chunk=chunk)
    out.backward(torch.tensor(0.5))
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(h.grad.float(), gh.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.float(), gw.float(), rtol=tol, atol=tol)


def test_causal_lm_loss_matches_transformers_loss_with_num_items():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.manual_seed(0)
    B, S, H, V = 2, 9, 8, 30
    hidden, weight = torch.randn(B, S, H), torch.randn(V, H)
    labels = torch.randint(0, V, (B, S))
    labels[1, :4] = -100
    logits = F.linear(hidden, weight)
    for n in (None, torch.tensor(11)):
        ref = ForCausalLMLoss(logits, labels, V, num_items_in_batch=n)
        torch.testing.assert_close(causal_lm_loss(hidden, weight, labels, num_items_in_batch=n, chunk=4), ref)
        torch.testing.assert_close(causal_lm_loss(hidden, weight, labels, logits=logits, num_items_in_batch=n), ref)


@pytest.mark.parametrize("kwargs,match", [
    (dict(experts="triton"), "experts='triton'"),
    (dict(attn="xformers"), "attn='xformers'"),
    (dict(gate="random"), "gate='random'"),
    (dict(loss="liger"), "loss='liger'"),
    (dict(rms_norm="apex"), "rms_norm='apex'"),
    (dict(linear="fp8"), "linear='fp8'"),
    (dict(gate="balanced", gate_noise=1.5), r"gate_noise=1.5 must be a number in \[0, 1\]"),
    (dict(gate_noise=0.1), "only applies to gate='balanced'"),
    (dict(loss_chunk_size=0), "loss_chunk_size"),
    (dict(compile="yes"), "compile"),
    (dict(backend=""), "backend"),
])
def test_backend_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BackendConfig(**kwargs)


def test_backend_config_te_needs_transformer_engine():
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here")
    with pytest.raises(ImportError, match="pip install 'transformer-engine"):
        BackendConfig(attn="te")
    with pytest.raises(ImportError, match="TransformerEngine"):
        BackendConfig(linear="te")


def test_backend_config_is_keyword_only_with_slots():
    with pytest.raises(TypeError):
        BackendConfig("sdpa")  # type: ignore[misc]
    cfg = BackendConfig(gate="balanced", gate_noise=0.2)
    with pytest.raises(AttributeError):
        cfg.typo = 1  # type: ignore[attr-defined]
    assert cfg.experts == "grouped_mm" and cfg.loss == "fused" and cfg.attn == "auto"


def test_unknown_polyaccel_backend_is_an_error():
    from polyaccel.moe import AutoModelForCausalLM

    with pytest.raises(KeyError, match="unknown backend 'nosuch'"):
        AutoModelForCausalLM.from_config(tiny("olmoe"), backend=BackendConfig(backend="nosuch"))



def test_fused_weight_gradient_is_added_into_grad(monkeypatch):
    """``fuse_weight_grad``: the LM-head weight's gradient, scaled by the upstream gradient, is
    added into its existing ``.grad`` by ``ops.add_scaled_`` (the first one, with no ``.grad``
    yet, goes through autograd); the hidden gradient still flows."""
    from polyaccel.core import ops

    calls = []
    add = ops.add_scaled_
    monkeypatch.setattr(ops, "add_scaled_", lambda *a: calls.append(1) or add(*a))
    torch.manual_seed(1)
    N, H, V = 19, 8, 30
    y = torch.randint(0, V, (N,))
    y[4] = -100
    w = torch.nn.Parameter(0.3 * torch.randn(V, H))
    w_ref = torch.nn.Parameter(w.detach().clone())
    for step in range(3):
        h = torch.randn(N, H, requires_grad=True)
        h_ref = h.detach().clone().requires_grad_()
        linear_cross_entropy_sum(h, w, y, chunk=7, fuse_weight_grad=True).backward(torch.tensor(0.5))
        F.cross_entropy(F.linear(h_ref, w_ref), y, ignore_index=-100, reduction="sum").backward(torch.tensor(0.5))
        torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_weight_gradient_formed_in_the_backward_by_one_gemm_into_grad(monkeypatch, dtype):
    """``POLYACCEL_LM_HEAD_WGRAD=backward``: the forward keeps the logits' gradient, the backward
    adds ``grad_logits.T @ (hidden * upstream)`` into the existing ``.grad`` (no ``add_scaled_``
    pass; the first one, with no ``.grad`` yet, returns it to autograd): gradients equal
    autograd's through the plain loss, with upstream gradients other than 1."""
    from polyaccel.core import ops
    from polyaccel.moe import layers

    monkeypatch.setattr(layers, "LM_HEAD_WGRAD", "backward")
    monkeypatch.setattr(ops, "add_scaled_", lambda *a: pytest.fail("add_scaled_ ran"))
    calls = []
    logit_grads = ops.linear_cross_entropy_logit_grads
    monkeypatch.setattr(ops, "linear_cross_entropy_logit_grads", lambda *a: calls.append(1) or logit_grads(*a))
    torch.manual_seed(1)
    N, H, V = 19, 8, 30
    y = torch.randint(0, V, (N,))
    y[4] = -100
    w = torch.nn.Parameter((0.3 * torch.randn(V, H)).to(dtype))
    w_ref = torch.nn.Parameter(w.detach().double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # of the norm: bf16 rounds the logits' gradient

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return ((got.double() - want).norm() / want.norm()).item() < tol

    for step, upstream in enumerate((0.5, 0.125, 3.0)):
        h = torch.randn(N, H, dtype=dtype, requires_grad=True)
        h_ref = h.detach().double().requires_grad_()
        linear_cross_entropy_sum(h, w, y, chunk=7, fuse_weight_grad=True).backward(torch.tensor(upstream))
        F.cross_entropy(F.linear(h_ref, w_ref), y, ignore_index=-100, reduction="sum").backward(
            torch.tensor(upstream, dtype=torch.float64))
        assert close(h.grad, h_ref.grad) and close(w.grad, w_ref.grad), f"step {step}"
    assert len(calls) == 3


def test_lm_head_weight_gradient_over_the_size_limit_stays_in_the_forward(monkeypatch):
    """A logits' gradient larger than ``LM_HEAD_DEFER_BYTES`` is not kept: the chunked forward
    path and ``add_scaled_`` run as by default; an unknown setting is refused by name."""
    from polyaccel.core import ops
    from polyaccel.moe import layers

    monkeypatch.setattr(layers, "LM_HEAD_WGRAD", "backward")
    monkeypatch.setattr(layers, "LM_HEAD_DEFER_BYTES", 19 * 30 * 4 - 1)
    monkeypatch.setattr(ops, "linear_cross_entropy_logit_grads", lambda *a: pytest.fail("kept the logits"))
    calls = []
    add = ops.add_scaled_
    monkeypatch.setattr(ops, "add_scaled_", lambda *a: calls.append(1) or add(*a))
    w = torch.nn.Parameter(torch.randn(30, 8))
    w.grad = torch.zeros_like(w)
    linear_cross_entropy_sum(torch.randn(19, 8), w, torch.randint(0, 30, (19,)), fuse_weight_grad=True).backward()
    assert calls == [1]
    monkeypatch.setattr(layers, "LM_HEAD_WGRAD", "sideways")
    with pytest.raises(ValueError, match="POLYACCEL_LM_HEAD_WGRAD='sideways'"):
        linear_cross_entropy_sum(torch.randn(19, 8), w, torch.randint(0, 30, (19,)), fuse_weight_grad=True)


def test_router_jitter_multiplies_the_input_by_uniform_noise_in_training_only():
    """Mixtral's ``router_jitter_noise`` j: in training the block sees ``x * U(1-j, 1+j)``
    drawn from the torch RNG (as Transformers does), in eval ``x`` unchanged."""
    from polyaccel.moe.layers import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(4, 8, 6, 2, True, "silu", jitter_noise=0.2)
    torch.nn.init.normal_(block.gate.weight)
    torch.nn.init.normal_(block.experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(block.experts.down_proj, std=0.3)
    x = torch.randn(2, 5, 8)
    torch.manual_seed(7)
    u = torch.empty_like(x).uniform_(0.8, 1.2)
    assert u.min() < 0.9 and u.max() > 1.1  # the draw spans the interval
    block.eval()
    y_eval, _ = block(x)
    y_ref, logits_ref = block(x * u)
    block.train()
    torch.manual_seed(7)
    y_train, logits = block(x)
    torch.testing.assert_close(y_train, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y_train, y_eval, atol=1e-3)


def test_padding_mask_leaves_no_query_row_fully_masked():
    """Left padding: real queries attend causally to real keys only; a padding query (which
    would have no key at all and give NaN in SDPA's fused kernels) attends everywhere instead,
    and the attention's output for it is zeros (Transformers' value), its gradients too."""
    from polyaccel.moe.layers import AttentionContext, attention_mask_for, causal_sdpa, mask_and_dead_rows

    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    mask = attention_mask_for(AttentionContext(pad), 2, 5, 5, 0, torch.device("cpu"))
    assert mask.shape == (2, 1, 5, 5) and bool(mask.any(-1).all())
    causal = torch.ones(5, 5).tril().bool()
    assert torch.equal(mask[1, 0], causal)
    assert torch.equal(mask[0, 0, 2:], causal[2:] & pad[0].bool())  # real queries: real keys only
    assert bool(mask[0, 0, :2].all())  # padding queries attend everywhere
    _, dead = mask_and_dead_rows(AttentionContext(pad), 2, 5, 5, 0, torch.device("cpu"))
    assert dead.shape == (2, 1, 5, 1) and dead[:, 0, :, 0].tolist() == [[True, True] + [False] * 3, [False] * 5]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g, requires_grad=True) for _ in range(3))
    out = causal_sdpa(q, k, v, AttentionContext(pad), 0, 0.5)
    assert bool((out[0, :, :2] == 0).all()) and bool((out[0, :, 2:] != 0).any())
    out[0, :, :2].sum().backward()  # the padding queries' outputs reach nothing
    assert all(bool((t.grad == 0).all()) for t in (q, k, v))
