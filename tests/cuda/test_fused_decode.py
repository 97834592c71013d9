"""The cuda backend's fused decoder-step ops (:mod:`polyaccel.cuda.fused_decode`) against
core's references. On the CPU: Triton's interpreter runs the kernels and a tiny Whisper's
fused step through them (``interpreted_fused_decode.py``), and CPU tensors without it take
the references. ``gpu`` tests (``pytest -m gpu tests/cuda/test_fused_decode.py``) run the
kernels in bf16 at Whisper large-v3-turbo widths: close to the references, and every row the
same bits alone, in a batch's first rows or anywhere in a batch of up to 16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyaccel.core import ops
from polyaccel.cuda import fused_decode

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_kernels_match_references_in_the_interpreter():
    pytest.importorskip("triton")
    script = Path(__file__).with_name("interpreted_fused_decode.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]


def test_cpu_inputs_take_the_references(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 1, 12, generator=g), torch.randn(6, 12, generator=g), torch.randn(6, generator=g)
    ln_w, ln_b = torch.randn(12, generator=g), torch.randn(12, generator=g)
    assert torch.equal(fused_decode.ln_linear(x, ln_w, ln_b, 1e-5, w, b, "gelu"),
                       ops.ln_linear.reference(x, ln_w, ln_b, 1e-5, w, b, "gelu"))
    res = torch.randn(2, 1, 6, generator=g)
    assert torch.equal(fused_decode.linear_residual(x, w, b, res), ops.linear_residual.reference(x, w, b, res))
    q, k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    position = torch.tensor([0, 3])
    assert torch.equal(fused_decode.cached_decode_attention(q, k, v, position),
                       ops.cached_decode_attention.reference(q, k, v, position))


TURBO = dict(D=1280, H=20, FFN=5120, V=51866, C=448)


def _rows_alone_and_in_batches(fn, full: torch.Tensor, rows: int) -> None:
    """``fn(sl)`` equals ``full[sl]`` bit for bit for every prefix and every single row."""
    for b in range(1, rows):
        assert torch.equal(fn(slice(0, b)), full[:b]), f"the first {b} rows differ from among {rows}"
    for r in range(rows):
        assert torch.equal(fn(slice(r, r + 1)), full[r:r + 1]), f"row {r} alone differs from among {rows}"


@gpu
@needs_cuda
@torch.inference_mode()
@pytest.mark.parametrize("split_k", [None, 2, 5])
def test_bf16_gemm_ops_match_and_rows_are_the_same_at_every_batch_size(monkeypatch, split_k):
    """The shipped launch shapes (None) and forced K splits (the last of a tile's programs sums
    the parts): close to the references, the same bits run to run and at every batch size."""
    if split_k is not None:
        monkeypatch.setattr(fused_decode, "_config",
                            lambda N, K, dtype, parts=1: fused_decode.GemmConfig(16, 128, split_k))
    D, FFN, V = TURBO["D"], TURBO["FFN"], TURBO["V"]
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).bfloat16()

    ln_w, ln_b = 1 + rand(D, scale=0.1), rand(D, scale=0.1)
    x = rand(16, 1, D)
    w1, b1 = rand(FFN, D, scale=D**-0.5), rand(FFN)
    w2, b2, res = rand(D, FFN, scale=FFN**-0.5), rand(D), rand(16, 1, D)
    wv = rand(V, D, scale=D**-0.5)
    h1 = fused_decode.ln_linear(x, ln_w, ln_b, 1e-5, w1, b1, "gelu")
    checks = [
        ("ln + fc1 + gelu", lambda sl: fused_decode.ln_linear(x[sl], ln_w, ln_b, 1e-5, w1, b1, "gelu"),
         ops.ln_linear.reference(x.float(), ln_w.float(), ln_b.float(), 1e-5, w1.float(), b1.float(), "gelu")),
        ("fc2 + residual", lambda sl: fused_decode.linear_residual(h1[sl], w2, b2, res[sl]),
         ops.linear_residual.reference(h1.float(), w2.float(), b2.float(), res.float())),
        ("ln + vocab, fp32 out", lambda sl: fused_decode.ln_linear(x[sl], ln_w, ln_b, 1e-5, wv, None,
                                                                     out_dtype=torch.float32),
         ops.ln_linear.reference(x.float(), ln_w.float(), ln_b.float(), 1e-5, wv.float())),
    ]
    for name, fn, want in checks:
        full = fn(slice(0, 16))
        err = ((full.float() - want).norm() / want.norm()).item()
        print(f"{name}: rel err {err:.2e}")
        assert err < 1e-2, (name, err)
        assert torch.equal(fn(slice(0, 16)), full), f"{name}: run to run"
        _rows_alone_and_in_batches(fn, full, 16)


@gpu
@needs_cuda
@torch.inference_mode()
def test_bf16_qkv_into_cache_and_cached_attention_match_and_rows_are_the_same_at_every_batch_size():
    D, H, C = TURBO["D"], TURBO["H"], TURBO["C"]
    Dh = D // H
    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, device="cuda", generator=g)).bfloat16()

    ln_w, ln_b = 1 + rand(D, scale=0.1), rand(D, scale=0.1)
    weights = [rand(D, D, scale=D**-0.5) for _ in range(3)]
    biases = [rand(D), None, rand(D)]
    x = rand(16, 1, D)
    cache_k, cache_v = rand(16, H, C, Dh), rand(16, H, C, Dh)
    position = torch.randint(0, C, (16,), device="cuda", generator=g)
    position[0] = 0

    def step(sl):
        k, v = cache_k[sl].clone(), cache_v[sl].clone()
        q = fused_decode.ln_qkv_into_cache_(x[sl], ln_w, ln_b, 1e-5, weights, biases, k, v, position[sl])
        o = fused_decode.cached_decode_attention(q, k, v, position[sl])
        return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1), o.flatten(1)], 1)

    want_k, want_v = cache_k.float(), cache_v.float()
    want_q = ops.ln_qkv_into_cache_.reference(x.float(), ln_w.float(), ln_b.float(), 1e-5,
                                              [w.float() for w in weights], [biases[0].float(), None,
                                                                             biases[2].float()],
                                              want_k, want_v, position)
    want_o = ops.cached_decode_attention.reference(want_q, want_k, want_v, position)
    want = torch.cat([want_q.flatten(1), want_k.flatten(1), want_v.flatten(1), want_o.flatten(1)], 1)
    full = step(slice(0, 16))
    err = ((full.float() - want).norm() / want.norm()).item()
    print(f"ln_qkv_into_cache_ + cached_decode_attention: rel err {err:.2e}")
    assert err < 1e-2, err
    _rows_alone_and_in_batches(step, full, 16)


@gpu
@needs_cuda
@torch.inference_mode()
def test_greedy_pick_matches_torch_and_rows_are_the_same_at_every_batch_size():
    V = TURBO["V"]
    g = torch.Generator(device="cuda").manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (4 * torch.randn(16, V, device="cuda", generator=g)).to(dtype)
        bias = torch.zeros(V, device="cuda")
        bias[torch.randperm(V, device="cuda", generator=g)[:2000]] = float("-inf")
        bias[[3, 30000, 50000]] = 0.0
        logits[0, 3] = logits[0, 50000] = 90  # a tie across parts: the first wins
        logits[1, 30000] = 90
        bias[30000] = float("-inf")  # suppressed: never chosen
        best, logprob = fused_decode.greedy_pick(logits, bias)
        want_best, want_logprob = ops.greedy_pick.reference(logits, bias)
        assert torch.equal(best, want_best) and best[0].item() == 3 and best[1].item() != 30000
        torch.testing.assert_close(logprob, want_logprob, atol=1e-5, rtol=1e-5)
        full = torch.stack([best.double(), logprob.double()], 1)

        def pick(sl, logits=logits, bias=bias):
            return torch.stack([t.double() for t in fused_decode.greedy_pick(logits[sl], bias)], 1)

        _rows_alone_and_in_batches(pick, full, 16)


def test_launch_shapes_depend_on_the_weights_alone():
    """The rule behind every launch (never the row count): wide-enough column blocks, and a K
    split only where K is long against N (Whisper's fc2)."""
    D, FFN, V = TURBO["D"], TURBO["FFN"], TURBO["V"]
    bf16 = torch.bfloat16
    assert fused_decode._config(D, D, bf16) == fused_decode.GemmConfig(16, 256)  # o_proj: 80 blocks
    assert fused_decode._config(D, D, bf16, parts=3) == fused_decode.GemmConfig(32, 256)  # q|k|v
    assert fused_decode._config(FFN, D, bf16) == fused_decode.GemmConfig(32, 256)  # fc1
    assert fused_decode._config(D, FFN, bf16) == fused_decode.GemmConfig(32, 128, 8)  # fc2: K in 8 parts
    assert fused_decode._config(V, D, bf16) == fused_decode.GemmConfig(64, 256, num_stages=3)  # the vocabulary
    assert fused_decode._config(D, FFN, torch.float32).block_k == 64
