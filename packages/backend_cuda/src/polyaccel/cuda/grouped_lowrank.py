"""``out[rows of g] += u[rows of g] @ factor[g]``: core's ``grouped_lowrank_add_`` on CUDA.

A LoRA adapter on grouped expert weights adds ``(x·A_e)·B_e`` to the base GEMM's output.
Formed as a grouped GEMM and then added, that writes a [T, N] delta and reads it back with
the output (four passes over [T, N]); this kernel reads the output tile once, adds the rank-r
product of the tile's rows (one ``tl.dot`` of K = r per group the tile touches) and writes it
once. The same kernel adds the adapter's data gradient ``(dy·B_e)·A_e`` into the base data
gradient in the backward.

A program takes BLOCK_M sorted rows and BLOCK_N columns; it finds its first group by counting
the offsets at or below its first row (one vector load) and loops over the groups its rows
span (usually one), masking the rows of the others. No host sync: the offsets stay on the
device.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

MAX_RANK = 64
"""Rank columns one launch adds (larger ranks take several launches)."""

CONFIGS = [(64, 128, 4), (128, 128, 8), (64, 256, 8), (128, 64, 4), (32, 256, 4), (128, 256, 8)]
"""(BLOCK_M, BLOCK_N, num_warps) tried by the autotuner, keyed on the output width and rank;
Triton's CPU interpreter (tests) takes the first. (Programs that loop over several column
tiles, reusing the group lookup, measured slower on an H200: 102 against 73 us a call.)"""


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def lowrank_add(OUT, U, F, OFFS, T, N, G, stride_out, stride_u, stride_fg, stride_fr, stride_fn,
                    R: tl.constexpr, R_PAD: tl.constexpr, G_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        row0 = tl.program_id(0) * BLOCK_M
        offs = tl.load(OFFS + tl.arange(0, G_PAD), mask=tl.arange(0, G_PAD) < G, other=2147483647)
        total = tl.minimum(tl.load(OFFS + G - 1), T)  # rows past T are not this output's, whatever the offsets say
        if row0 < total:
            g = tl.sum((offs <= row0).to(tl.int32), axis=0)  # the first group ending past row0
            start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
            row_end = tl.minimum(row0 + BLOCK_M, total)
            rm = row0 + tl.arange(0, BLOCK_M)
            rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            rr = tl.arange(0, R_PAD)
            in_rows = rm < row_end
            u = tl.load(U + rm[:, None].to(tl.int64) * stride_u + rr[None, :],
                        mask=in_rows[:, None] & (rr[None, :] < R), other=0.0)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            while start < row_end:
                end = tl.load(OFFS + g)
                f = tl.load(F + g.to(tl.int64) * stride_fg + rr[:, None] * stride_fr + rn[None, :] * stride_fn,
                            mask=(rr[:, None] < R) & (rn[None, :] < N), other=0.0)
                sel = (rm >= start) & (rm < end)
                acc = tl.dot(tl.where(sel[:, None], u, tl.zeros_like(u)), f, acc)
                start = end
                g += 1
            ptr = OUT + rm[:, None].to(tl.int64) * stride_out + rn[None, :]
            mask = in_rows[:, None] & (rn[None, :] < N)
            out = tl.load(ptr, mask=mask, other=0.0).to(tl.float32) + acc
            tl.store(ptr, out.to(OUT.dtype.element_ty), mask=mask)

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w) for bm, bn, w in CONFIGS],
        key=["N", "R_PAD"],
        restore_value=["OUT"],  # trial runs add into OUT: put it back after each
    )(lowrank_add)
    return lowrank_add, tuned


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def grouped_lowrank_add_(out: torch.Tensor, u: torch.Tensor, factor: torch.Tensor, offsets: torch.Tensor
                         ) -> torch.Tensor:
    """Core ``grouped_lowrank_add_`` on CUDA (bf16/fp16, unit-stride rows of ``out`` and
    ``u``); other inputs take core's reference, which also checks them. Ranks above
    :data:`MAX_RANK` are added in chunks of it (one pass and one rounding per chunk), so the
    tiles stay within a program's registers and shared memory."""
    ok = (use_triton(out) and out.dim() == 2 and u.dim() == 2 and factor.dim() == 3
          and out.dtype in (torch.bfloat16, torch.float16) and u.dtype == out.dtype and factor.dtype == out.dtype
          and out.stride(1) == 1 and u.stride(1) == 1 and u.shape[0] == out.shape[0]
          and factor.shape[1] == u.shape[1] and factor.shape[2] == out.shape[1]
          and offsets.dim() == 1 and offsets.numel() == factor.shape[0] and offsets.device == out.device)
    if not ok:
        from polyaccel.core.ops import grouped_lowrank_add_ as core_op

        return core_op.reference(out, u, factor, offsets)
    T, N = out.shape
    G, R, _ = factor.shape
    if T == 0 or N == 0 or G == 0 or R == 0:
        return out
    offsets = offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)
    for j in range(0, R, MAX_RANK):
        _launch(out, u[:, j:j + MAX_RANK], factor[:, j:j + MAX_RANK], offsets)
    return out


def _launch(out: torch.Tensor, u: torch.Tensor, factor: torch.Tensor, offsets: torch.Tensor) -> None:
    T, N = out.shape
    G, R, _ = factor.shape
    plain, tuned = _kernel()
    args = (out, u, factor, offsets, T, N, G, out.stride(0), u.stride(0), *factor.stride())
    sizes = dict(R=R, R_PAD=_pow2_at_least(R, 16), G_PAD=_pow2_at_least(G, 2))
    if out.is_cuda:
        tuned[lambda meta: (cdiv(T, meta["BLOCK_M"]), cdiv(N, meta["BLOCK_N"]))](*args, **sizes)
    else:  # Triton's CPU interpreter
        bm, bn, w = CONFIGS[0]
        plain[(cdiv(T, bm), cdiv(N, bn))](*args, **sizes, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
