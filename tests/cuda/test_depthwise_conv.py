"""The cuda backend's ``depthwise_conv1d`` (Triton) against core's reference on fresh random
inputs: the conformer's channels-last layout at canary shapes and contiguous [B, C, T]; the
output keeps a channels-last input's layout, so the linear layer after it reads a contiguous
tensor. The interpreter runs the same comparison in CI (``interpreted_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core import ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,C,T,K", [(8, 1024, 375, 9), (3, 512, 1501, 9), (2, 40, 17, 31)])
@pytest.mark.parametrize("channels_last", [True, False])
def test_depthwise_conv1d_matches_the_reference(B, C, T, K, channels_last):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from polyaccel.cuda.depthwise_conv import depthwise_conv1d

    g = torch.Generator(device="cuda").manual_seed(B * C + T)
    shape = (B, T, C) if channels_last else (B, C, T)
    x = torch.randn(shape, device="cuda", generator=g).bfloat16()
    x = x.transpose(1, 2) if channels_last else x
    w = (0.3 * torch.randn(C, 1, K, device="cuda", generator=g)).bfloat16()
    b = torch.randn(C, device="cuda", generator=g).bfloat16()
    got = depthwise_conv1d(x, w, b)
    want = ops.depthwise_conv1d.reference(x.float(), w.float(), b.float())
    assert got.dtype == torch.bfloat16 and (got.stride(1) == 1) == channels_last
    assert float((got.float() - want).norm() / want.norm()) < 4e-3  # bf16 output rounding
    assert got.transpose(1, 2).is_contiguous() == channels_last
