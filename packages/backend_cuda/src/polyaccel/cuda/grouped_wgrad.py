"""Expert weight gradients with the accumulation fused in: ``out[g] += dy_g.T @ x_g``.

With gradient accumulation, every micro-batch after the first adds its expert weight
gradients into ``.grad``: unfused, the grouped GEMM writes a new [E, N, K] tensor and
``AccumulateGrad`` then reads it and ``.grad`` and writes ``.grad`` again (three passes over
~1 GB per expert weight and layer). Here one Triton kernel loops over each expert's token rows
with an fp32 accumulator and finishes by loading the ``.grad`` tile, adding, and storing it:
one read and one write of ``.grad``.

Programs are ordered expert-major, so the tiles of one expert run together and its token
rows (a few hundred) are read from L2, not from memory, by all of them. The first
micro-batch writes without reading (``accumulate=False``). The last one can also run the
AdamW step in the epilogue (:func:`grouped_mm_wgrad_adamw_`): the finished gradient tile is in
registers, so the parameter and moments are updated there and the gradient is never stored.
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
    def grouped_wgrad(DY, X, OFFS, OUT, P, M, V, S, N, K, stride_dy, stride_x,
                      ACCUMULATE: tl.constexpr, ADAMW: tl.constexpr, STORE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
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
        off = g.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :]
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        if ACCUMULATE:
            acc += tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
        if ADAMW:  # the optimizer step on this tile (adamw.py's math), then the grad zeroed
            p = tl.load(P + off, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(M + off, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(V + off, mask=mask, other=0.0).to(tl.float32)
            p = p * tl.load(S)
            m = m + tl.load(S + 1) * (acc - m)
            v = v * tl.load(S + 2) + tl.load(S + 3) * acc * acc
            denom = tl.math.div_rn(tl.math.sqrt_rn(v), tl.load(S + 5)) + tl.load(S + 6)
            p = p - tl.load(S + 4) * tl.math.div_rn(m, denom)
            tl.store(P + off, p.to(P.dtype.element_ty), mask=mask)
            tl.store(M + off, m.to(M.dtype.element_ty), mask=mask)
            tl.store(V + off, v.to(V.dtype.element_ty), mask=mask)
            acc = tl.zeros_like(acc)
        if STORE:  # (the gradient after an epilogue step: zeros, or left for the next write)
            tl.store(OUT + off, acc.to(OUT.dtype.element_ty), mask=mask)

    def tuned(restore: list[str]):
        return triton.autotune(
            configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCK_T": bt}, num_warps=w, num_stages=s)
                     for bn, bk, bt, w, s in CONFIGS],
            key=["N", "K", "ACCUMULATE", "ADAMW", "STORE"],
            restore_value=restore,  # trial runs write these in place: put them back after each
        )(grouped_wgrad)

    return grouped_wgrad, tuned(["OUT"]), tuned(["OUT", "P", "M", "V"])


def grouped_mm_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor,
                     out: torch.Tensor | None = None, accumulate: bool = True) -> torch.Tensor:
    """Core ``grouped_mm_wgrad`` on CUDA (bf16/fp16 inputs, contiguous ``out``); other
    inputs take core's reference."""
    if (not use_triton(dy) or dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype
            or (out is not None and not out.is_contiguous())):
        from polyaccel.core.ops import grouped_mm_wgrad as core_op

        return core_op.reference(dy, x, offsets, out, accumulate)
    accumulate = accumulate and out is not None
    if out is None:
        out = dy.new_empty(offsets.numel(), dy.shape[1], x.shape[1])
    _launch(dy, x, offsets, out, (out, out, out, out), accumulate=accumulate, adamw=False, store=True)
    return out


def grouped_mm_wgrad_adamw_(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
                            param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                            scalars: torch.Tensor, accumulate: bool = True, zero_grad: bool = True) -> None:
    """Core ``grouped_mm_wgrad_adamw_`` on CUDA: the weight-gradient kernel with the AdamW
    step in its epilogue (bf16/fp16 inputs, contiguous same-shape state); else core's reference."""
    state = (grad, param, exp_avg, exp_avg_sq)
    if (not use_triton(dy) or dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype
            or scalars.dtype != torch.float32
            or not all(t.is_contiguous() and t.shape == grad.shape for t in state)):
        from polyaccel.core.ops import grouped_mm_wgrad_adamw_ as core_op

        return core_op.reference(dy, x, offsets, grad, param, exp_avg, exp_avg_sq, scalars, accumulate, zero_grad)
    _launch(dy, x, offsets, grad, (param, exp_avg, exp_avg_sq, scalars), accumulate=accumulate, adamw=True,
            store=zero_grad)


def _launch(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
            adam: tuple[torch.Tensor, ...], *, accumulate: bool, adamw: bool, store: bool) -> None:
    G, N, K = offsets.numel(), dy.shape[1], x.shape[1]
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    if x.stride(1) != 1:
        x = x.contiguous()
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    plain, tuned, tuned_adamw = _kernel()

    def grid(meta):
        return cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"]), G

    args = (dy, x, offsets, out, *adam, N, K, dy.stride(0), x.stride(0))
    if dy.is_cuda:
        (tuned_adamw if adamw else tuned)[grid](*args, ACCUMULATE=accumulate, ADAMW=adamw, STORE=store)
    else:  # Triton's CPU interpreter (tests): no timing, the first tile shape
        bn, bk, bt, _, _ = CONFIGS[0]
        plain[grid({"BLOCK_N": bn, "BLOCK_K": bk})](*args, ACCUMULATE=accumulate, ADAMW=adamw, STORE=store,
                                                      BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt)
