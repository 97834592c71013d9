"""How close a ``rows_to_fp8`` kernel's output must be to core's reference (shared by the
interpreter check and the GPU test)."""

from __future__ import annotations

import torch

from polyaccel.core import ops


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at each of ``q``'s values (3 mantissa bits; subnormals 2^-9)."""
    exponent = torch.floor(torch.log2(q.float().abs().clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3)


def check_rows_to_fp8(kernel, x: torch.Tensor, prologue: str, *, exact: bool, max_moved: float, **ln) -> str:
    """Run ``kernel`` and core's reference on ``x``; scales within 1e-6, values equal where
    ``exact``, else each at most one e4m3 step from the reference's and at most ``max_moved``
    of them moved. Returns a line for the log; raises AssertionError on a mismatch."""
    q, scale = kernel(x, prologue, **ln)
    q_ref, scale_ref = ops.rows_to_fp8.reference(x, prologue, **ln)
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    q, scale, q_ref, scale_ref = q.cpu(), scale.cpu(), q_ref.cpu(), scale_ref.cpu()
    assert torch.allclose(scale, scale_ref, rtol=1e-6, atol=0), (scale - scale_ref).abs().max()
    moved = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if exact:
        assert not moved.any(), f"{int(moved.sum())} values differ from the reference"
    gap = (q.float() - q_ref.float()).abs()
    assert (gap <= e4m3_step(q_ref) * 1.0001).all(), f"a value moved {float((gap / e4m3_step(q_ref)).max()):.1f} steps"
    frac = moved.float().mean().item()
    assert frac <= max_moved, f"{frac:.2%} of the values moved one step"
    return f"rows_to_fp8 {tuple(x.shape)} {x.dtype} {prologue}: {frac:.3%} of the values one e4m3 step off"
