"""The cuda backend's ``conv2d_subsample`` (channels-last cuDNN convolutions, ReLU and the
next layer's length mask in one Triton pass) against core's reference on fresh random inputs,
at a conformer front end's shapes: bf16 within its rounding, and a row padded past its length
gives what that row alone gives. The interpreter runs the same comparison in CI
(``interpreted_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core import ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,T,M,C", [(4, 3000, 128, 256), (3, 1001, 80, 64)])
def test_conv2d_subsample_matches_the_reference(B, T, M, C):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from polyaccel.cuda.conv_subsample import conv2d_subsample

    g = torch.Generator(device="cuda").manual_seed(B * T + C)
    x = torch.randn(B, 1, T, M, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(C, c_in, 3, 3, device="cuda", generator=g) / (3 * c_in ** 0.5)).bfloat16() for c_in in (1, C, C)]
    bs = [(0.1 * torch.randn(C, device="cuda", generator=g)).bfloat16() for _ in ws]
    lengths = torch.tensor([T, T // 3, 1, T - 7][:B], device="cuda")
    got = conv2d_subsample(x, ws, bs, lengths=lengths)
    want = ops.conv2d_subsample.reference(x.float(), [w.float() for w in ws], [b.float() for b in bs], lengths=lengths)
    assert got.dtype == torch.bfloat16 and got.is_contiguous(memory_format=torch.channels_last)
    assert float((got.float() - want).norm() / want.norm()) < 1e-2  # bf16 rounding of three layers
    n = T // 3
    alone = conv2d_subsample(x[1:2, :, :n], ws, bs)
    close = float((got[1:2, :, :alone.shape[2]].float() - alone.float()).norm() / alone.float().norm())
    assert close < 1e-2, close
