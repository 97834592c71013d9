"""Token dispatch for grouped-GEMM experts with no host synchronisation.

``moe_permute`` sorts the T*k token copies by expert (a stable device sort of the ids as
the narrowest integer type, see :func:`sort_keys`; counts from a
``searchsorted`` over the sorted ids, not ``bincount``, which reads the maximum back to the
host on CUDA). ``moe_unpermute`` gathers each token's k expert outputs back and sums them
with the router weights in fp32, in one Triton pass that reads every expert output once.

Both backwards are gathers too (no atomics, deterministic): the gradient of the permute is a
weight-1 unpermute, and the unpermute's backward writes each expert row's gradient and the
k router-weight gradients of a token in one pass.

Dropped copies (expert id >= ``num_experts``: routed to another rank's experts) sort last.
The unpermute and both backwards skip rows past the valid count (``END``, read on the
device): under expert parallelism with a fixed-size dispatch about half of the sorted rows
are such copies; the permute still gathers them (their rows are unspecified by contract).

Shapes: T tokens, k experts per token, H hidden, E experts. ``order`` [T*k] int64 maps a row
of the sorted tensor to its flat (token * k + slot) index; ``inv`` is its inverse.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

_LIB = "polyaccel_cuda"


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_combine(Y, INV, W, END, OUT, H, K, HAS_W: tl.constexpr, HAS_END: tl.constexpr,
                       BLOCK_H: tl.constexpr):
        """OUT[t, h] = sum_j W[t, j] * Y[INV[t*K + j], h] (W = 1 without HAS_W; rows >= END
        count as zeros with HAS_END)."""
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.range(0, K):
            r = tl.load(INV + t * K + j)
            rmask = cmask
            if HAS_END:  # (r broadcast over the columns: a vector mask)
                rmask = rmask & ((cols * 0 + r) < tl.load(END))
            y = tl.load(Y + r * H + cols, mask=rmask, other=0.0).to(tl.float32)
            if HAS_W:
                y = y * tl.load(W + t * K + j).to(tl.float32)
            acc += y
        tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=cmask)

    @triton.jit
    def combine_bwd(G, Y, INV, W, END, DY, DW, H, K, HAS_END: tl.constexpr, BLOCK_H: tl.constexpr):
        """DY[INV[t*K+j]] = W[t, j] * G[t];  DW[t, j] = <G[t], Y[INV[t*K+j]]> (with HAS_END,
        rows >= END are neither read nor written, and their DW is 0)."""
        t = tl.program_id(0).to(tl.int64)
        for j in tl.range(0, K):
            r = tl.load(INV + t * K + j)
            w = tl.load(W + t * K + j).to(tl.float32)
            dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for h0 in tl.range(0, H, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                rmask = cols < H
                if HAS_END:
                    rmask = rmask & ((cols * 0 + r) < tl.load(END))
                g = tl.load(G + t * H + cols, mask=rmask, other=0.0).to(tl.float32)
                y = tl.load(Y + r * H + cols, mask=rmask, other=0.0).to(tl.float32)
                dot += g * y
                tl.store(DY + r * H + cols, (w * g).to(DY.dtype.element_ty), mask=rmask)
            tl.store(DW + t * K + j, tl.sum(dot, axis=0).to(DW.dtype.element_ty))

    return gather_combine, combine_bwd


def _inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inv


def _valid_rows(y: torch.Tensor, num_valid: torch.Tensor | None) -> torch.Tensor:
    """``y`` with rows from ``num_valid`` on zeroed (the torch path's view of dropped copies)."""
    if num_valid is None:
        return y
    rows = torch.arange(y.shape[0], device=y.device)
    return torch.where((rows < num_valid)[:, None], y, y.new_zeros(()))


def _combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor | None, T: int, k: int,
             num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * y[inv[t*k + j]] in fp32 over rows < ``num_valid``, returned in
    ``y.dtype``. [T, H]."""
    H = y.shape[-1]
    if not use_triton(y):
        g = _valid_rows(y, num_valid).index_select(0, inv).view(T, k, H).float()
        if weights is not None:
            g = g * weights.float().unsqueeze(-1)
        return g.sum(1).to(y.dtype)
    out = y.new_empty(T, H)
    if T:
        fwd, _ = _kernels()
        block_h = min(1024, 1 << max(4, (H - 1).bit_length()))
        w = weights.contiguous() if weights is not None else inv  # unused pointer without weights
        end = num_valid.reshape(1) if num_valid is not None else inv  # unused without HAS_END
        fwd[(T, cdiv(H, block_h))](y.contiguous(), inv, w, end, out, H, k, HAS_W=weights is not None,
                                   HAS_END=num_valid is not None, BLOCK_H=block_h, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------
# moe_permute
# ---------------------------------------------------------------------------------------


def sort_keys(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Expert ids as the narrowest integer type that holds ``0..num_experts``, every dropped
    copy's id (``>= num_experts``) made ``num_experts``: a radix sort takes one pass per byte
    of its keys, so 128 experts' ids sort in one pass as uint8 instead of eight as int64. A
    stable sort gives the same order of the counted copies (the dropped ones stay last, in
    their original order)."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if num_experts <= torch.iinfo(dtype).max:
            return flat.clamp(max=num_experts).to(dtype)
    return flat


@torch.library.custom_op(f"{_LIB}::moe_permute", mutates_args=())
def moe_permute_op(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert: (x_sorted [T*k, H], order [T*k] int64, counts [E] int64)."""
    k = topk_idx.shape[-1]
    expert_sorted, order = torch.sort(sort_keys(topk_idx.reshape(-1), num_experts), stable=True)
    ends = torch.searchsorted(expert_sorted, torch.arange(num_experts, device=topk_idx.device,
                                                          dtype=expert_sorted.dtype), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    # Dropped copies (past ends[-1]) are gathered too: their rows are unspecified by contract.
    return x.index_select(0, order // k), order, counts


@moe_permute_op.register_fake
def _(x, topk_idx, num_experts):
    n = topk_idx.numel()
    return (x.new_empty(n, x.shape[-1]), topk_idx.new_empty(n, dtype=torch.int64),
            topk_idx.new_empty(num_experts, dtype=torch.int64))


def _permute_setup(ctx, inputs, output):
    _, topk_idx, _ = inputs
    ctx.k = topk_idx.shape[-1]
    ctx.save_for_backward(output[1], output[2].sum().reshape(1))


def _permute_backward(ctx, grad_sorted, _grad_order, _grad_counts):
    order, num_valid = ctx.saved_tensors
    T = order.numel() // ctx.k
    return torch.ops.polyaccel_cuda.moe_combine(grad_sorted, order, None, T, num_valid), None, None


moe_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op(f"{_LIB}::moe_combine", mutates_args=())
def moe_combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor | None, T: int,
                num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Unweighted (``weights`` None) or weighted sum of each token's k sorted rows (rows from
    ``num_valid`` on count as zeros): [T, H]."""
    k = order.numel() // T if T else 1
    return _combine(y_sorted, _inverse(order), weights, T, k, num_valid)


@moe_combine.register_fake
def _(y_sorted, order, weights, T, num_valid=None):
    return y_sorted.new_empty(T, y_sorted.shape[-1])


# ---------------------------------------------------------------------------------------
# moe_unpermute
# ---------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::moe_unpermute", mutates_args=())
def moe_unpermute_op(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                     num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * y_sorted[row of (t, j)], fp32 sum, rows from
    ``num_valid`` on counting as zeros: [T, H]."""
    T, k = topk_weights.shape
    return _combine(y_sorted, _inverse(order), topk_weights, T, k, num_valid)


@moe_unpermute_op.register_fake
def _(y_sorted, order, topk_weights, num_valid=None):
    return y_sorted.new_empty(topk_weights.shape[0], y_sorted.shape[-1])


@torch.library.custom_op(f"{_LIB}::moe_unpermute_bwd", mutates_args=())
def moe_unpermute_bwd(grad_out: torch.Tensor, y_sorted: torch.Tensor, order: torch.Tensor,
                      topk_weights: torch.Tensor, num_valid: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of ``y_sorted`` [T*k, H] (unspecified in rows from ``num_valid`` on), grad of
    ``topk_weights`` [T, k] (0 for those rows' copies))."""
    T, k = topk_weights.shape
    H = y_sorted.shape[-1]
    inv = _inverse(order)
    if not use_triton(y_sorted):
        g = grad_out.float()
        y = _valid_rows(y_sorted, num_valid).index_select(0, inv).view(T, k, H).float()
        dw = (y * g.unsqueeze(1)).sum(-1).to(topk_weights.dtype)
        dy = (topk_weights.float().unsqueeze(-1) * g.unsqueeze(1)).view(T * k, H)
        return dy.index_select(0, order).to(y_sorted.dtype), dw
    dy = torch.empty_like(y_sorted)
    dw = torch.empty_like(topk_weights)
    if T:
        _, bwd = _kernels()
        block_h = min(1024, 1 << max(4, (H - 1).bit_length()))
        end = num_valid.reshape(1) if num_valid is not None else inv  # unused without HAS_END
        bwd[(T,)](grad_out.contiguous(), y_sorted.contiguous(), inv, topk_weights.contiguous(), end, dy, dw,
                  H, k, HAS_END=num_valid is not None, BLOCK_H=block_h, num_warps=4)
    return dy, dw


@moe_unpermute_bwd.register_fake
def _(grad_out, y_sorted, order, topk_weights, num_valid=None):
    return torch.empty_like(y_sorted), torch.empty_like(topk_weights)


def _unpermute_setup(ctx, inputs, output):
    y_sorted, order, topk_weights, num_valid = inputs
    ctx.has_valid = num_valid is not None
    ctx.save_for_backward(y_sorted, order, topk_weights, *([num_valid] if num_valid is not None else []))


def _unpermute_backward(ctx, grad_out):
    y_sorted, order, topk_weights, *valid = ctx.saved_tensors
    dy, dw = torch.ops.polyaccel_cuda.moe_unpermute_bwd(grad_out, y_sorted, order, topk_weights,
                                                        valid[0] if valid else None)
    return dy, None, dw, None


moe_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Core ``moe_permute`` on CUDA (same contract, no host sync)."""
    return torch.ops.polyaccel_cuda.moe_permute(x, topk_idx, num_experts)


def moe_unpermute(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                  num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``moe_unpermute`` on CUDA (same contract, one fused gather-and-sum)."""
    return torch.ops.polyaccel_cuda.moe_unpermute(y_sorted, order, topk_weights, num_valid)
