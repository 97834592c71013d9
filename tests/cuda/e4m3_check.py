"""How close a ``rows_to_fp8`` kernel's output must be to core's reference (shared by the
interpreter check and the GPU test)."""

from __future__ import annotations

import torch

from polyaccel.core import ops


def e4m3_step(q: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at each of ``q``'s values (3 mantissa bits; subnormals 2^-9)."""
    exponent = torch.floor(torch.log2(q.float().abs().clamp(min=2.0 ** -6)))
    return torch.exp2(exponent - 3)


def check_rows_to_fp8(kernel, x: torch.Tensor, prologue: str, *, exact: bool, max_moved: float,
                      scale_rtol: float = 1e-6, abs_tol: float = 0.0, **ln) -> str:
    """Run ``kernel`` and core's reference on ``x``; scales within ``scale_rtol``, values equal
    where ``exact``, else each at most one e4m3 step from the reference's (or what it stands
    for within ``abs_tol`` of the reference's: an approximate prologue's own error) and at most
    ``max_moved`` of them moved; what the rows stand for (values x scales) no further from the
    reference's prologue in fp32 than the reference's own rows are, give or take 2%. Returns a
    line for the log; raises AssertionError on a mismatch."""
    q, scale = kernel(x, prologue, **ln)
    q_ref, scale_ref = ops.rows_to_fp8.reference(x, prologue, **ln)
    assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and scale.shape == scale_ref.shape
    q, scale, q_ref, scale_ref = q.cpu(), scale.cpu(), q_ref.cpu(), scale_ref.cpu()
    assert torch.allclose(scale, scale_ref, rtol=scale_rtol, atol=0), ((scale - scale_ref) / scale_ref).abs().max()
    exact_rows = _prologue_fp32(x.cpu().float().reshape(q.shape), prologue, **ln)
    err, err_ref = (float((v.float() * s - exact_rows).norm() / exact_rows.norm().clamp(min=1e-30))
                    for v, s in ((q, scale), (q_ref, scale_ref)))
    assert err <= 1.02 * err_ref + 1e-7, f"rows stand for values {err:.4f} off, the reference's {err_ref:.4f}"
    # bits, except that a tiny value may round to +0 on one side and -0 on the other: one value
    zero = (q.float() == 0) & (q_ref.float() == 0)
    moved = (q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~zero
    if exact:
        assert not moved.any(), f"{int(moved.sum())} values differ from the reference"
    gap = (q.float() - q_ref.float()).abs()
    step = e4m3_step(q_ref)
    # past one step, what the value stands for may differ by abs_tol plus that step's rounding
    far = (gap > step * 1.0001) & ((q.float() * scale - q_ref.float() * scale_ref).abs() > abs_tol + step * scale_ref)
    assert not far.any(), f"a value moved {float((gap / step)[far].max()):.1f} steps"
    frac = moved.float().mean().item()
    assert frac <= max_moved, f"{frac:.2%} of the values moved one step"
    return f"rows_to_fp8 {tuple(x.shape)} {x.dtype} {prologue}: {frac:.3%} of the values one e4m3 step off"


def _prologue_fp32(x: torch.Tensor, prologue: str, ln_weight=None, ln_bias=None, eps: float = 1e-5) -> torch.Tensor:
    if prologue == "gelu":
        return torch.nn.functional.gelu(x)
    if prologue == "layer_norm":
        w, b = (None if t is None else t.cpu().float() for t in (ln_weight, ln_bias))
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)
    return x
