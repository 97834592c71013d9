"""Expert weight gradients with the accumulation fused in: ``out[g] += dy_g.T @ x_g``.

With gradient accumulation, every micro-batch after the first adds its expert weight
gradients into ``.grad``: unfused, the grouped GEMM writes a new [E, N, K] tensor and
``AccumulateGrad`` then reads it and ``.grad`` and writes ``.grad`` again (three passes over
~1 GB per expert weight and layer). Here one Triton kernel loops over each expert's token rows
with an fp32 accumulator and finishes by loading the ``.grad`` tile, adding, and storing it:
one read and one write of ``.grad``.

Programs are ordered expert-major, so the tiles of one expert run together and its token
rows (a few hundred) are read from L2, not from memory, by all of them. The first
micro-batch writes without reading (``accumulate=False``).
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

CONFIGS = [  # (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
]
"""Tile shapes tried by the autotuner (keyed on N and K)."""


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_wgrad(DY, X, OFFS, OUT, N, K, stride_dy, stride_x,
                      ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        tile = tl.program_id(0)
        g = tl.program_id(1)
        tiles_k = tl.cdiv(K, BLOCK_K)
        rn = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
        end = tl.load(OFFS + g)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            rt = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            in_rows = rt < end
            a = tl.load(DY + rt[None, :] * stride_dy + rn[:, None],
                        mask=in_rows[None, :] & (rn[:, None] < N), other=0.0)  # [BLOCK_N, BLOCK_T]
            b = tl.load(X + rt[:, None] * stride_x + rk[None, :],
                        mask=in_rows[:, None] & (rk[None, :] < K), other=0.0)  # [BLOCK_T, BLOCK_K]
            acc = tl.dot(a, b, acc)
        at = OUT + g.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :]
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        if ACCUMULATE:
            acc += tl.load(at, mask=mask, other=0.0).to(tl.float32)
        tl.store(at, acc.to(OUT.dtype.element_ty), mask=mask)

    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": bt}, num_warps=w, num_stages=s)
                 for bn, bk, bt, w, s in CONFIGS],
        key=["N", "K", "ACCUMULATE"],
        restore_value=["OUT"],  # trial runs accumulate into OUT: put it back after each
    )(grouped_wgrad)
    return grouped_wgrad, tuned


def grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``grouped_mm_wgrad`` on CUDA (bf16/fp16 inputs, contiguous ``out``); other
    inputs take core's reference."""
    if (not use_triton(dy) or dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype
            or (out is not None and not out.is_contiguous())):
        from polyaccel.core.ops import grouped_mm_wgrad as core_op

        return core_op.reference(dy, x, offsets, out)
    G, N, K = offsets.numel(), dy.shape[1], x.shape[1]
    accumulate = out is not None
    if out is None:
        out = dy.new_empty(G, N, K)
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    plain, tuned = _kernel()

    def grid(meta):
        return cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"]), G

    args = (dy, x, offsets, out, N, K, dy.stride(0), x.stride(0))
    if dy.is_cuda:
        tuned[grid](*args, ACCUMULATE=accumulate)
    else:  # Triton's CPU interpreter (tests): no timing, the first tile shape
        bn, bk, bt, _, _ = CONFIGS[0]
        plain[grid({"BLOCK_N": bn, "BLOCK_K": bk})](*args, ACCUMULATE=accumulate, BLOCK_N=bn, BLOCK_K=bk,
                                                      BLOCK_T=bt)
    return out
