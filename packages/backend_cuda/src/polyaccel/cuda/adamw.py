"""AdamW over one flat buffer as one Triton pass: core's ``adamw_step_`` on CUDA.

torch's fused AdamW walks a list of tensors (one launch per chunk of tensors) and leaves
``zero_grad`` to a separate memset. Here the optimizer keeps params, grads and both moments
in one flat buffer each (:class:`polyaccel.moe.optim.FlatAdamW`), so a step is one
elementwise kernel over ``n`` elements: read p, g, m, v; write p, m, v and, with
``zero_grad``, zeros into g. Math in fp32, stored in each tensor's dtype; in bf16 that is
16 bytes per element, so the step runs at memory bandwidth.

Tune with the module constants :data:`BLOCK` (elements per program) and :data:`NUM_WARPS`;
they are read at each call. Tensors off CUDA, or not contiguous, take core's reference.
"""

from __future__ import annotations

import torch

from polyaccel.core.ops import adamw_scalars
from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

BLOCK = 2048
"""Elements per program (a power of two)."""
NUM_WARPS = 8
"""Warps per program: BLOCK / (32 * NUM_WARPS) elements per thread (8 with the defaults: one
16-byte load per bf16 tensor). Measured on an H200, 1.26 B bf16 elements, grads zeroed: BLOCK
1024-2048 with 4-16 warps all ran at 4.13-4.18 TB/s (a device copy: 4.25); 4096 x 8 at 3.93;
8192 and up fell off unless given 16 warps."""


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(P, G, M, V, S, n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                     ZERO_GRAD: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n
        # Streamed once: ask the cache to evict these lines first.
        p = tl.load(P + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        g = tl.load(G + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        m = tl.load(M + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        v = tl.load(V + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if SCALE:
            g = g * tl.load(S).to(tl.float32)
        p = p * decay
        m = m + one_minus_beta1 * (g - m)  # torch's lerp(m, g, 1 - beta1)
        v = v * beta2 + one_minus_beta2 * g * g
        # A zero second moment (a param no gradient has reached yet: unseen embedding rows,
        # experts no token was routed to) sends IEEE sqrt and division down their slow paths:
        # 40% slower on all-zero moments. Its denominator is exactly eps, so take that instead.
        zero_v = v == 0.0
        denom = tl.where(zero_v, eps, tl.math.div_rn(tl.math.sqrt_rn(tl.where(zero_v, 1.0, v)), bc2_sqrt) + eps)
        p = p - step_size * tl.math.div_rn(m, denom)
        tl.store(P + idx, p.to(P.dtype.element_ty), mask=mask)
        tl.store(M + idx, m.to(M.dtype.element_ty), mask=mask)
        tl.store(V + idx, v.to(V.dtype.element_ty), mask=mask)
        if ZERO_GRAD:
            tl.store(G + idx, tl.zeros_like(g).to(G.dtype.element_ty), mask=mask)

    return adamw_kernel


@torch.library.custom_op("polyaccel_cuda::adamw_step_",
                         mutates_args=("param", "grad", "exp_avg", "exp_avg_sq"))
def adamw_step_op(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  zero_grad: bool, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step over contiguous tensors of equal length, in place (see core's op)."""
    if not use_triton(param):
        from polyaccel.core.ops import adamw_step_ as core_op

        core_op.reference(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=weight_decay, step=step, zero_grad=zero_grad, grad_scale=grad_scale)
        return
    n = param.numel()
    if n == 0:
        return
    # Scalars formed in double here, as torch does, then passed as fp32 (1 - beta1 in fp32
    # would be 0.100000024, not 0.1f, and shift every element by an ulp or two).
    scale = grad_scale.reshape(1) if grad_scale is not None else param  # S unread without SCALE
    _kernels()[(cdiv(n, BLOCK),)](param, grad, exp_avg, exp_avg_sq, scale, n,
                                  *adamw_scalars(lr, beta1, beta2, eps, weight_decay, step),
                                  ZERO_GRAD=zero_grad, SCALE=grad_scale is not None, BLOCK=BLOCK,
                                  num_warps=NUM_WARPS)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                zero_grad: bool = False, grad_scale: torch.Tensor | None = None) -> None:
    """Core ``adamw_step_`` on CUDA: one Triton pass over contiguous flat tensors; anything
    else (not contiguous, unequal lengths, a bad step) goes to core's reference, which checks it."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    n = param.numel()
    if (step < 1 or not all(t.is_contiguous() and t.numel() == n and t.device == param.device for t in tensors)
            or (grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.device != param.device))):
        from polyaccel.core.ops import adamw_step_ as core_op

        return core_op.reference(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, step=step, zero_grad=zero_grad, grad_scale=grad_scale)
    torch.ops.polyaccel_cuda.adamw_step_(param, grad, exp_avg, exp_avg_sq, float(lr), float(beta1),
                                         float(beta2), float(eps), float(weight_decay), int(step),
                                         bool(zero_grad), grad_scale)
