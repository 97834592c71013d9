"""RMSNorm forward and backward as Triton kernels, fp32 statistics, one op for autograd.

``rms_norm(x, weight, eps)`` normalises the last dim of ``x`` [..., N]. The forward kernel
writes ``y`` and the per-row ``rstd`` (fp32) that the backward reuses, so the backward reads
``x`` and ``dy`` once each. The weight gradient is reduced in two stages: every program sums
its rows into one fp32 partial row, then torch sums the partials (no atomics, deterministic).

Tensors off CUDA take the same op through plain torch math, so the op's autograd and fake
registrations are testable on any machine.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, num_sms, triton_kernels, use_triton

_LIB = "polyaccel_cuda"


def _tile(n: int) -> tuple[int, int]:
    """(BLOCK_N, ROWS): the row tile that holds a whole row and about 8K elements."""
    block_n = 1 << max(4, (n - 1).bit_length())
    return block_n, max(1, min(64, 8192 // block_n))


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_fwd(X, W, Y, RSTD, M, N, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < M)

    @triton.jit
    def rms_bwd(DY, X, W, RSTD, DX, DW_PARTIAL, M, N, tiles_per_prog,
                BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in tl.range(0, tiles_per_prog):
            rows = (pid * tiles_per_prog + i) * ROWS + tl.arange(0, ROWS)
            mask = (rows[:, None] < M) & cmask[None, :]
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
            xhat = x * rstd[:, None]
            dyw = dy * w[None, :]
            c = tl.sum(dyw * xhat, axis=1) / N
            dx = (dyw - xhat * c[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=cmask)

    return rms_fwd, rms_bwd


# ---------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm forward: (y like ``x``, rstd fp32 [rows])."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, N = x2.shape
    if not use_triton(x):
        xf = x2.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
        y = (xf * rstd[:, None] * weight.float()).to(x.dtype)
        return y.view(x.shape), rstd
    y = torch.empty_like(x2)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    if M == 0:
        return y.view(x.shape), rstd
    fwd, _ = _kernels()
    block_n, rows = _tile(N)
    fwd[(cdiv(M, rows),)](x2, weight.contiguous(), y, rstd, M, N, eps,
                                 BLOCK_N=block_n, ROWS=rows, num_warps=4 if block_n <= 2048 else 8)
    return y.view(x.shape), rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1]
    return torch.empty_like(x), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm backward: (dx like ``x``, dweight like ``weight``)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dy2 = dy.reshape(-1, x.shape[-1]).contiguous()
    M, N = x2.shape
    if not use_triton(x):
        xhat = x2.float() * rstd[:, None]
        dyw = dy2.float() * weight.float()
        dx = (dyw - xhat * (dyw * xhat).mean(-1, keepdim=True)) * rstd[:, None]
        dw = (dy2.float() * xhat).sum(0)
        return dx.to(x.dtype).view(x.shape), dw.to(weight.dtype)
    dx = torch.empty_like(x2)
    if M == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    _, bwd = _kernels()
    block_n, rows = _tile(N)
    tiles = cdiv(M, rows)
    programs = min(tiles, 4 * num_sms(x.device))
    tiles_per_prog = cdiv(tiles, programs)
    programs = cdiv(tiles, tiles_per_prog)
    partial = torch.empty(programs, N, device=x.device, dtype=torch.float32)
    bwd[(programs,)](dy2, x2, weight.contiguous(), rstd, dx, partial, M, N, tiles_per_prog,
                     BLOCK_N=block_n, ROWS=rows, num_warps=4 if block_n <= 2048 else 8)
    return dx.view(x.shape), partial.sum(0).to(weight.dtype)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.polyaccel_cuda.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim with fp32 statistics (core ``rms_norm`` on CUDA)."""
    return torch.ops.polyaccel_cuda.rms_norm_fwd(x, weight, float(eps))[0]
