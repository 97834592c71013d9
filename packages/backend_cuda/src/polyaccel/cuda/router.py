"""A learned MoE router's softmax and top-k in one Triton pass: core's ``router_topk`` on CUDA.

Under ``torch.compile`` the router is a fused softmax kernel, then aten's top-k (a radix
select with a block per row, then a sort of each row's k results): ~41 us per layer and
micro-batch at Qwen3-30B-A3B's 4,096 tokens x 128 experts on an H200, 1.3 ms of a
qwen3-30b-a3b-L8 step (docs/benchmarks.md, session 31's profile). Here a program takes a
block of whole rows (up to :data:`MAX_EXPERTS` experts a row), forms the fp32 softmax, picks
the k largest by k passes of a row maximum (among equal probabilities the lowest expert id
first: the set aten's top-k keeps), renormalises in registers and writes the weights, the ids
and the probabilities, which the backward reads: torch math, the softmax backward of the
weights' gradient scattered to their experts.

Off by default until timed on a GPU (:data:`ENABLED`, ``POLYACCEL_FUSED_ROUTER=1``; read at
import, or set the attribute); wider rows take core's reference.
"""

from __future__ import annotations

import os

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

ENABLED = os.environ.get("POLYACCEL_FUSED_ROUTER", "0").strip().lower() in ("1", "true", "yes", "on")
"""Whether core's ``router_topk`` runs the Triton kernel on CUDA (else core's reference)."""

MAX_EXPERTS = 256
"""The widest router row the kernel takes whole."""

_LIB = "polyaccel_cuda"


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def router_topk_fwd(LOGITS, W, IDX, PROBS, T, E, stride, K: tl.constexpr, KP2: tl.constexpr,
                        RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        in_rows = rows < T
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, BLOCK_E)
        mask = in_rows[:, None] & (cols < E)[None, :]
        x = tl.load(LOGITS + rows64[:, None] * stride + cols[None, :], mask=mask, other=float("-inf"))
        x = tl.where(in_rows[:, None], x.to(tl.float32), 0.0)  # (rows past T: finite, never stored)
        e = tl.exp(x - tl.max(x, 1)[:, None])
        p = e / tl.sum(e, 1)[:, None]
        tl.store(PROBS + rows64[:, None] * E + cols[None, :], p, mask=mask)
        left = tl.where(mask, p, -1.0)  # probabilities are >= 0: -1 is never picked again
        slots = tl.arange(0, KP2)
        w = tl.zeros((BLOCK_T, KP2), dtype=tl.float32)
        idx = tl.zeros((BLOCK_T, KP2), dtype=tl.int32)
        total = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(left, 1)
            pick = tl.min(tl.where(left == best[:, None], cols[None, :], BLOCK_E), 1)
            w = tl.where(slots[None, :] == j, best[:, None], w)
            idx = tl.where(slots[None, :] == j, pick[:, None], idx)
            left = tl.where(cols[None, :] == pick[:, None], -1.0, left)
            total += best
        if RENORM:
            w = w / total[:, None]
        out = rows64[:, None] * K + slots[None, :]
        keep = in_rows[:, None] & (slots < K)[None, :]
        tl.store(W + out, w, mask=keep)
        tl.store(IDX + out, idx.to(tl.int64), mask=keep)

    return router_topk_fwd


def _reference_forward(logits: torch.Tensor, top_k: int, renormalize: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Core's reference, with the probabilities the backward reads (off CUDA: tests)."""
    from polyaccel.core.ops import router_topk as core_op

    w, idx = core_op.reference(logits, top_k, renormalize)
    return w, idx, torch.softmax(logits.float(), dim=-1)


@torch.library.custom_op(f"{_LIB}::router_topk", mutates_args=())
def router_topk_op(logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int64 [T, k], softmax fp32 [T, E]) for logits [T, E]."""
    if not use_triton(logits):
        return _reference_forward(logits, top_k, renormalize)
    T, E = logits.shape
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    w = torch.empty(T, top_k, device=x.device, dtype=torch.float32)
    idx = torch.empty(T, top_k, device=x.device, dtype=torch.int64)
    probs = torch.empty(T, E, device=x.device, dtype=torch.float32)
    if T:
        block_e = max(16, _next_pow2(E))
        block_t = max(1, 4096 // block_e)
        _kernel()[(cdiv(T, block_t),)](x, w, idx, probs, T, E, x.stride(0), K=top_k,
                                       KP2=max(2, _next_pow2(top_k)), RENORM=renormalize,
                                       BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    return w, idx, probs


def _next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << max(n - 1, 0).bit_length()


@router_topk_op.register_fake
def _(logits, top_k, renormalize):
    T, E = logits.shape
    return (logits.new_empty(T, top_k, dtype=torch.float32), logits.new_empty(T, top_k, dtype=torch.int64),
            logits.new_empty(T, E, dtype=torch.float32))


def _setup(ctx, inputs, output):
    ctx.renormalize, ctx.dtype = inputs[2], inputs[0].dtype
    w, idx, probs = output
    ctx.mark_non_differentiable(idx, probs)
    ctx.save_for_backward(w, idx, probs)


def _backward(ctx, grad_w, _grad_idx, _grad_probs):
    w, idx, probs = ctx.saved_tensors
    grad_w = grad_w.float()
    if ctx.renormalize:  # w = p_sel / S: dp_sel = (dw - <dw, w>) / S
        picked_sum = probs.gather(1, idx).sum(dim=-1, keepdim=True)
        grad_w = (grad_w - (grad_w * w).sum(dim=-1, keepdim=True)) / picked_sum
    grad_p = torch.zeros_like(probs).scatter_(1, idx, grad_w)
    grad_logits = probs * (grad_p - (grad_p * probs).sum(dim=-1, keepdim=True))
    return grad_logits.to(ctx.dtype), None, None


router_topk_op.register_autograd(_backward, setup_context=_setup)


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Core ``router_topk`` on CUDA: one Triton pass when :data:`ENABLED` (2-D logits up to
    :data:`MAX_EXPERTS` wide), else core's reference."""
    if not ENABLED or logits.dim() != 2 or not 1 <= top_k <= logits.shape[1] or logits.shape[1] > MAX_EXPERTS:
        from polyaccel.core.ops import router_topk as core_op

        return core_op.reference(logits, top_k, renormalize)
    w, idx, _ = torch.ops.polyaccel_cuda.router_topk(logits, top_k, renormalize)
    return w, idx
