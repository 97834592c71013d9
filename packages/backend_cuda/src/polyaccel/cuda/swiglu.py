"""SwiGLU, ``silu(gate) * up``, as one Triton pass forward and one backward.

``gate_up`` [..., 2I] holds gate in ``[..., :I]`` and up in ``[..., I:]`` (how Transformers
v5 concatenates ``gate_up_proj``). Unfused, torch reads and writes the [T*k, 2I] expert
activations several times (chunk, silu, mul, and their backward); here the forward reads
``gate_up`` once and writes the output once, the backward reads ``gate_up`` and ``dout`` and
writes ``dgate_up``, math in fp32. Tensors off CUDA take the same op through torch math.
With ``num_valid`` (a device-held row count) rows from there on are neither read nor written,
forward or backward: the dropped copies of a fixed-size expert-parallel dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

_BLOCK = 2048


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_fwd(GU, OUT, END, n, inter, HAS_END: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        row = idx // inter
        col = idx - row * inter
        if HAS_END:
            mask = mask & (row < tl.load(END))
        g = tl.load(GU + row * 2 * inter + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * 2 * inter + inter + col, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(OUT + idx, out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(DOUT, GU, DGU, END, n, inter, HAS_END: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        row = idx // inter
        col = idx - row * inter
        if HAS_END:
            mask = mask & (row < tl.load(END))
        g_at = row * 2 * inter + col
        g = tl.load(GU + g_at, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + g_at + inter, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + idx, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = dout * u * s * (1.0 + g * (1.0 - s))
        du = dout * g * s
        tl.store(DGU + g_at, dg.to(DGU.dtype.element_ty), mask=mask)
        tl.store(DGU + g_at + inter, du.to(DGU.dtype.element_ty), mask=mask)

    return swiglu_fwd, swiglu_bwd


@torch.library.custom_op("polyaccel_cuda::swiglu", mutates_args=())
def swiglu_op(gate_up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [..., 2I] -> [..., I] (rows from ``num_valid`` on
    left unwritten)."""
    inter = gate_up.shape[-1] // 2
    if not use_triton(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)
    gu = gate_up.contiguous()
    out = gu.new_empty(*gu.shape[:-1], inter)
    n = out.numel()
    if n:
        fwd, _ = _kernels()
        end = num_valid.reshape(1) if num_valid is not None else gu  # unused without HAS_END
        fwd[(cdiv(n, _BLOCK),)](gu, out, end, n, inter, HAS_END=num_valid is not None, BLOCK=_BLOCK, num_warps=8)
    return out


@swiglu_op.register_fake
def _(gate_up, num_valid=None):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@torch.library.custom_op("polyaccel_cuda::swiglu_bwd", mutates_args=())
def swiglu_bwd(dout: torch.Tensor, gate_up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of :func:`swiglu_op` with respect to ``gate_up`` (rows from ``num_valid`` on
    left unwritten)."""
    if not use_triton(gate_up):
        gate, up = gate_up.float().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        d = dout.float()
        return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], -1).to(gate_up.dtype)
    gu = gate_up.contiguous()
    dout = dout.contiguous()
    dgu = torch.empty_like(gu)
    n = dout.numel()
    if n:
        _, bwd = _kernels()
        end = num_valid.reshape(1) if num_valid is not None else gu  # unused without HAS_END
        bwd[(cdiv(n, _BLOCK),)](dout, gu, dgu, end, n, gu.shape[-1] // 2, HAS_END=num_valid is not None,
                                BLOCK=_BLOCK, num_warps=8)
    return dgu


@swiglu_bwd.register_fake
def _(dout, gate_up, num_valid=None):
    return torch.empty_like(gate_up)


def _setup(ctx, inputs, output):
    gate_up, num_valid = inputs
    ctx.save_for_backward(gate_up, *([num_valid] if num_valid is not None else []))


def _backward(ctx, dout):
    gate_up, *valid = ctx.saved_tensors
    return torch.ops.polyaccel_cuda.swiglu_bwd(dout, gate_up, valid[0] if valid else None), None


swiglu_op.register_autograd(_backward, setup_context=_setup)


def swiglu(gate_up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``swiglu`` on CUDA: ``silu(gate_up[..., :I]) * gate_up[..., I:]``."""
    return torch.ops.polyaccel_cuda.swiglu(gate_up, num_valid)
