"""Zero the rows of a fixed-size buffer past a count held on the device: core's ``zero_rows_from_``.

Expert parallelism with a fixed-size dispatch (:mod:`polyaccel.moe.dispatchers`) keeps the
rows of a grouped GEMM in a buffer sized for the worst case; rows past the valid count are
never computed and must be zeroed, forward and backward. ``torch.where`` with a broadcast row
mask does that through PyTorch's unvectorized path, reading and writing the whole buffer
(0.35 ms for 268 MB on an H200, three times per MoE layer and micro-batch); this kernel reads
nothing and writes zeros only into the rows past the count.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

BLOCK_ROWS, BLOCK_COLS = 16, 256


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def zero_rows_from(X, END, rows, cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        end = tl.load(END).to(tl.int64)
        mask = ((r >= end) & (r < rows))[:, None] & (c < cols)[None, :]
        zeros = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=X.dtype.element_ty)
        tl.store(X + r[:, None] * cols + c[None, :], zeros, mask=mask)

    return zero_rows_from


def zero_rows_from_(x: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Core ``zero_rows_from_`` on CUDA: one write-only Triton pass over a contiguous tensor;
    other inputs take core's reference."""
    if not use_triton(x) or not x.is_contiguous() or x.dim() == 0 or end.numel() != 1 or end.device != x.device:
        from polyaccel.core.ops import zero_rows_from_ as core_op

        return core_op.reference(x, end)
    rows = x.shape[0]
    cols = x.numel() // rows if rows else 0
    if rows and cols:
        grid = (cdiv(rows, BLOCK_ROWS), cdiv(cols, BLOCK_COLS))
        _kernel()[grid](x, end.reshape(1), rows, cols, BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS, num_warps=4)
    return x
