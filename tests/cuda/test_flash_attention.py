"""Core ``causal_attention`` and the cuda backend's FlashAttention-4 implementation.

Unmarked tests run on CPU: the reference against core's math attention, the registration rule
(only where ``flash-attn-4`` is installed) and the fallback for inputs FlashAttention-4 does not
take. ``gpu`` tests run FlashAttention-4 itself (skipped where it is not installed) against
fp32 math on fresh random inputs, forward and backward, eager, compiled and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from polyaccel.core import ops
from polyaccel.cuda import flash_attention, kernels

gpu = pytest.mark.gpu
needs_fa4 = pytest.mark.skipif(not (torch.cuda.is_available() and flash_attention.fa4_installed()
                                    and torch.cuda.get_device_capability()[0] in (9, 10)),
                               reason="needs FlashAttention-4 (flash-attn-4) on a Hopper or Blackwell GPU")


def math_attention(q, k, v, scale=None):  # noqa: ANN001, ANN201
    """fp32 causal attention on [B, S, H, D] through core's ``attention`` reference."""
    out = ops.attention.reference(*(t.float().transpose(1, 2) for t in (q, k, v)), causal=True, scale=scale)
    return out.transpose(1, 2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("heads, kv_heads, d, dv", [(4, 2, 16, 16), (3, 3, 8, 12)])
def test_reference_is_causal_gqa_attention_in_bshd(heads, kv_heads, d, dv):
    torch.manual_seed(0)
    q = torch.randn(2, 9, heads, d, dtype=torch.float64)
    k, v = torch.randn(2, 9, kv_heads, d, dtype=torch.float64), torch.randn(2, 9, kv_heads, dv, dtype=torch.float64)
    out = ops.causal_attention(q, k, v, scale=0.3)
    assert out.shape == (2, 9, heads, dv)
    torch.testing.assert_close(out, math_attention(q, k, v, 0.3).double(), atol=1e-5, rtol=1e-5)
    # causal: the first query sees only the first key
    torch.testing.assert_close(out[:, 0], v[:, 0].repeat_interleave(heads // kv_heads, dim=1))


def test_registered_only_where_flash_attn_4_is_installed(monkeypatch):
    seen = {}

    class Recorder:
        def register(self, op, device_type, fn, *, impl, backend=""):
            seen[op] = impl

    for installed in (False, True):
        seen.clear()
        monkeypatch.setattr(kernels, "fa4_installed", lambda installed=installed: installed)
        kernels.register_all(Recorder())
        assert ("causal_attention" in seen) is installed
    assert seen["causal_attention"] == "flash-attn-4"


def test_inputs_flash_attention_does_not_take_fall_back_to_the_reference(monkeypatch):
    called = []
    monkeypatch.setattr(flash_attention, "fa4_causal_fwd", lambda *a: called.append(a))
    q = torch.randn(1, 5, 2, 8)
    out = flash_attention.causal_attention(q, q, q)  # CPU, fp32: never FlashAttention-4
    torch.testing.assert_close(out, ops.causal_attention.reference(q, q, q))
    assert not called


def test_supports_refuses_what_the_kernels_do_not_build(monkeypatch):
    monkeypatch.setattr(flash_attention, "fa4_installed", lambda: True)
    monkeypatch.setattr(flash_attention, "_arch_ok", lambda index: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bf = dict(dtype=torch.bfloat16)
    q, kv = torch.empty(1, 8, 4, 64, **bf), torch.empty(1, 8, 2, 64, **bf)
    assert flash_attention.supports(q, kv, kv)
    assert not flash_attention.supports(q.float(), kv.float(), kv.float())  # fp32
    assert not flash_attention.supports(torch.empty(1, 8, 4, 60, **bf), torch.empty(1, 8, 2, 60, **bf),
                                        torch.empty(1, 8, 2, 60, **bf))  # head dim not a multiple of 8
    assert not flash_attention.supports(torch.empty(1, 8, 3, 64, **bf), kv, kv)  # 3 heads over 2 kv heads
    assert not flash_attention.supports(torch.empty(1, 8, 4, 512, **bf), torch.empty(1, 8, 2, 512, **bf),
                                        torch.empty(1, 8, 2, 512, **bf))  # head dim over 256


@gpu
@needs_fa4
@pytest.mark.parametrize("batch, seq, heads, kv_heads, d, dv", [
    (1, 1024, 32, 4, 128, 128),   # Qwen3-MoE's GQA
    (2, 333, 16, 16, 64, 64),     # MHA, a sequence not a multiple of any tile
    (1, 256, 8, 8, 192, 128),     # DeepSeek-V3's latent attention expanded: dv != d
])
def test_fa4_matches_math_forward_and_backward(batch, seq, heads, kv_heads, d, dv):
    torch.manual_seed(seq)
    mk = lambda h, dim: torch.randn(batch, seq, h, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(heads, d), mk(kv_heads, d), mk(kv_heads, dv)
    dout = torch.randn(batch, seq, heads, dv, device="cuda", dtype=torch.bfloat16)
    out = ops.causal_attention(q, k, v, scale=d ** -0.5)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = math_attention(q, k, v, d ** -0.5)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    assert rel_err(out, ref) < 1e-2
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 2e-2
    # negative control: the same kernel without the causal mask is far off
    full = flash_attention._interface()._flash_attn_fwd(q.detach(), k.detach(), v.detach(), softmax_scale=d ** -0.5,
                                                         causal=False)[0]
    assert rel_err(full, ref) > 0.1


@gpu
@needs_fa4
def test_fa4_under_compile_and_in_a_cuda_graph():
    torch.manual_seed(1)
    q = torch.randn(1, 512, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():  # noqa: ANN202
        out = ops.causal_attention(q * 1.0, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    def forward(q, k, v):  # noqa: ANN001, ANN202
        return ops.causal_attention(q * 1.0, k, v).float().square().sum()

    eager = step()
    compiled = torch.autograd.grad(torch.compile(forward, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(compiled, eager, strict=True):
        assert rel_err(a, b) < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        q.mul_(0.5)
    graph.replay()
    again = step()
    for a, b in zip(captured, again, strict=True):
        assert rel_err(a, b) < 1e-2
