"""The cuda backend's ``decode_attention`` (one query token, a fixed key split) against SDPA, and
its promise: a row's output is the same bits at every batch size. ``gpu`` tests run the Triton
kernel (``pytest -m gpu tests/cuda``); the interpreter checks it on the CPU
(``interpreted_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core import ops
from polyaccel.cuda.decode_attention import SplitConfig, decode_attention

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def test_cpu_inputs_take_the_reference():
    q, k, v = torch.randn(2, 3, 1, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    torch.testing.assert_close(decode_attention(q, k, v), ops.decode_attention.reference(q, k, v))


@gpu
@needs_cuda
@pytest.mark.parametrize("S,heads,dim", [(1500, 8, 64), (1500, 20, 64), (448, 6, 64), (77, 4, 128)])
@torch.inference_mode()
def test_matches_sdpa_and_rows_are_the_same_at_every_batch_size(S, heads, dim):
    g = torch.Generator(device="cuda").manual_seed(S + heads)
    B = 128
    q = torch.randn(B, heads, 1, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, heads, S, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, heads, S, dim, device="cuda", generator=g).bfloat16()
    position = torch.randint(0, S, (B,), device="cuda", generator=g)
    for mask in (None, (torch.arange(S, device="cuda") <= position[:, None])[:, None, None, :]):
        full = decode_attention(q, k, v, mask)
        want = ops.decode_attention.reference(q.float(), k.float(), v.float(), mask)
        assert (full.float() - want).abs().max() < 2e-2
        assert torch.equal(decode_attention(q, k, v, mask), full)  # run to run
        for b in (1, 2, 3, 8, 31, 64):
            part = decode_attention(q[:b], k[:b], v[:b], None if mask is None else mask[:b])
            assert torch.equal(part, full[:b]), b


@gpu
@needs_cuda
@pytest.mark.parametrize("config", [SplitConfig(16, 64), SplitConfig(24, 32), SplitConfig(8, 64)])
@torch.inference_mode()
def test_other_key_splits_are_exact_across_batches(config):
    """Launches the benchmark's kernel sweep tries: still close to the reference, the same bits
    run after run and at every batch size."""
    g = torch.Generator(device="cuda").manual_seed(config.splits)
    B, H, S, D = 64, 20, 1500, 64
    q, k, v = (torch.randn(B, H, n, D, device="cuda", generator=g).bfloat16() for n in (1, S, S))
    full = decode_attention(q, k, v, config=config)
    want = ops.decode_attention.reference(q.float(), k.float(), v.float())
    assert (full.float() - want).abs().max() < 2e-2
    for _ in range(3):
        assert torch.equal(decode_attention(q, k, v, config=config), full)
    for b in (1, 3, 17):
        assert torch.equal(decode_attention(q[:b], k[:b], v[:b], config=config), full[:b]), b


@gpu
@needs_cuda
@torch.inference_mode()
def test_e4m3_keys_and_values_with_scales_match_the_reference_at_every_batch_size():
    """The FP8 cross-attention path: e4m3 k/v rows with a scale per key (core's ``rows_to_fp8``)
    read by the same fixed-split kernel: close to the reference over what they stand for, and
    the same bits at every batch size. A 1% error in the value scales is caught."""
    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, S, D = 64, 20, 1500, 64
    q = torch.randn(B, H, 1, D, device="cuda", generator=g).bfloat16()
    loud = torch.linspace(0.01, 20, S, device="cuda")[:, None]
    (k8, ks), (v8, vs) = ((x.view(B, H, S, D), s.view(B, H, S)) for x, s in
                          (ops.rows_to_fp8(torch.randn(B, H, S, D, device="cuda", generator=g) * loud) for _ in "kv"))
    full = decode_attention(q, k8, v8, None, ks, vs)
    want = ops.decode_attention.reference(q, k8, v8, None, ks, vs)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:  # outputs reach ~50 here: bf16 steps of 0.25
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert full.dtype == torch.bfloat16 and rel(full, want) < 4e-3
    assert rel(full, ops.decode_attention.reference(q, k8, v8, None, ks, vs * 1.01)) > 8e-3
    for b in (1, 3, 17):
        assert torch.equal(decode_attention(q[:b], k8[:b], v8[:b], None, ks[:b], vs[:b]), full[:b]), b
