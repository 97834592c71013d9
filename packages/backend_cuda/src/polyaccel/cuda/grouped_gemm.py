"""Grouped GEMM ``out[rows of g] = x[rows of g] @ B_g`` in Triton, with 64-row tiles.

``torch._grouped_mm`` (CUTLASS) tiles each group's rows by 128. A learned router gives
group sizes around ``T*k/E`` (256 here) with a spread of a few dozen, so about half the
groups need a third, mostly empty, 128-row tile: ~25% of the expert GEMM work is padding.
64-row tiles halve that waste. Which wins on a given GPU is measured by
``tools/bench_moe.py --kernels``; the cuda backend uses this kernel for ``grouped_mm`` when
``POLYACCEL_CUDA_GROUPED_MM=triton`` (default: ``cutlass``).

Tiles are scheduled without a host sync: per group ``cdiv(rows, BLOCK_M)`` tiles; the grid
has the worst case ``cdiv(T, BLOCK_M) + G`` tile slots, a device ``searchsorted`` over the
cumulative tile counts maps each slot to its group, and programs past the last tile return.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

BLOCK_M = 64
CONFIGS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages)
    (128, 64, 4, 4),
    (256, 64, 8, 3),
    (128, 128, 8, 3),
]


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_gemm(X, B, OUT, TILE_GROUP, TILE_ROW, GROUP_END, N_TILES, N, K,
                     stride_x, stride_bg, stride_bk, stride_bn, stride_out,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        slot = tl.program_id(0)
        pid_n = tl.program_id(1)
        if slot >= tl.load(N_TILES):
            return
        g = tl.load(TILE_GROUP + slot).to(tl.int64)
        row0 = tl.load(TILE_ROW + slot).to(tl.int64)
        end = tl.load(GROUP_END + g).to(tl.int64)
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_ptr = X + rm[:, None] * stride_x + rk[None, :]
        b_ptr = B + g * stride_bg + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptr, mask=(rm[:, None] < end) & (rk[None, :] + k0 < K), other=0.0)
            b = tl.load(b_ptr, mask=(rk[:, None] + k0 < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K
            b_ptr += BLOCK_K * stride_bk
        tl.store(OUT + rm[:, None] * stride_out + rn[None, :], acc.to(OUT.dtype.element_ty),
                 mask=(rm[:, None] < end) & (rn[None, :] < N))

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                 for bn, bk, w, s in CONFIGS],
        key=["N", "K"])(grouped_gemm)
    return grouped_gemm, tuned


def schedule(offsets: torch.Tensor, total_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side tile schedule for ``offsets`` (int32 cumulative row ends): per tile slot its
    group and first row, and the number of real tiles (a 1-element tensor). No host sync."""
    G = offsets.numel()
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    slots = cdiv(total_rows, BLOCK_M) + G
    cum = torch.cumsum(tiles, 0)
    slot = torch.arange(slots, device=offsets.device)
    tile_group = torch.searchsorted(cum, slot, right=True).clamp_(max=G - 1)  # slots past the end: skipped
    tile_row = starts[tile_group] + (slot - (cum - tiles)[tile_group]) * BLOCK_M
    return tile_group, tile_row, cum[-1:].clone()


def grouped_gemm(x: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, transpose_b: bool) -> torch.Tensor:
    """``x`` [T, K] rows sorted by group times ``b[g]`` per group -> [T, N]; rows past
    ``offsets[-1]`` are zero. ``b`` [G, N, K] used as ``b[g].T`` (``transpose_b``, the
    ``F.linear`` layout: the forward) or [G, K, N] as is (the data gradient)."""
    T, K = x.shape
    N = b.shape[1] if transpose_b else b.shape[2]
    if x.stride(1) != 1:
        x = x.contiguous()
    stride_bk, stride_bn = (b.stride(2), b.stride(1)) if transpose_b else (b.stride(1), b.stride(2))
    out = x.new_zeros(T, N)
    if T == 0 or N == 0:
        return out
    tile_group, tile_row, n_tiles = schedule(offsets, T)
    plain, tuned = _kernel()
    args = (x, b, out, tile_group, tile_row, offsets, n_tiles, N, K,
            x.stride(0), b.stride(0), stride_bk, stride_bn, out.stride(0))
    slots = tile_group.numel()
    if x.is_cuda:
        tuned[lambda meta: (slots, cdiv(N, meta["BLOCK_N"]))](*args, BLOCK_M=BLOCK_M)
    else:  # Triton's CPU interpreter (tests)
        bn, bk, _, _ = CONFIGS[0]
        plain[(slots, cdiv(N, bn))](*args, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk)
    return out


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w, offsets)
        return grouped_gemm(x, w, offsets, transpose_b=True)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

        x, w, offsets = ctx.saved_tensors
        dx = grouped_gemm(dy, w, offsets, transpose_b=False) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(dy, x, offsets) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm_triton(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Core ``grouped_mm`` through this module's kernel (bf16/fp16); other inputs take core's
    reference. Autograd: data gradient by the same kernel, weight gradient by
    :mod:`.grouped_wgrad`."""
    if not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        from polyaccel.core.ops import grouped_mm as core_op

        return core_op.reference(x, w, offsets)
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    return _GroupedMM.apply(x, w, offsets)
