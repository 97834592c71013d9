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
    def adamw_kernel(P, G, M, V, S, H, n, decay, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                     ZERO_GRAD: tl.constexpr, SCALE: tl.constexpr, FROM_H: tl.constexpr, BLOCK: tl.constexpr):
        if FROM_H:  # the seven scalars read from device memory (a replayed graph's current step)
            decay, one_minus_beta1, beta2 = tl.load(H), tl.load(H + 1), tl.load(H + 2)
            one_minus_beta2, step_size, bc2_sqrt, eps = tl.load(H + 3), tl.load(H + 4), tl.load(H + 5), tl.load(H + 6)
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
    _launch(param, grad, exp_avg, exp_avg_sq, adamw_scalars(lr, beta1, beta2, eps, weight_decay, step), None,
            zero_grad, grad_scale)


def _launch(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
            scalars: list[float], from_tensor: torch.Tensor | None, zero_grad: bool,
            grad_scale: torch.Tensor | None) -> None:
    n = param.numel()
    if n == 0:
        return
    scale = grad_scale.reshape(1) if grad_scale is not None else param  # S unread without SCALE
    hyper = from_tensor if from_tensor is not None else param  # H unread without FROM_H
    _kernels()[(cdiv(n, BLOCK),)](param, grad, exp_avg, exp_avg_sq, scale, hyper, n, *scalars,
                                  ZERO_GRAD=zero_grad, SCALE=grad_scale is not None,
                                  FROM_H=from_tensor is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


_UNUSED_SCALARS = [1.0, 0.1, 0.999, 0.001, 1.0, 1.0, 1e-8]
"""Placeholders for the scalar arguments when the kernel reads them from ``H``."""


@torch.library.custom_op("polyaccel_cuda::adamw_step_from_",
                         mutates_args=("param", "grad", "exp_avg", "exp_avg_sq"))
def adamw_step_from_op(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       scalars: torch.Tensor, zero_grad: bool, grad_scale: torch.Tensor | None = None) -> None:
    """:func:`adamw_step_op` reading its seven scalars from ``scalars`` on the device."""
    if not use_triton(param):
        from polyaccel.core.ops import adamw_step_from_ as core_op

        core_op.reference(param, grad, exp_avg, exp_avg_sq, scalars, zero_grad=zero_grad, grad_scale=grad_scale)
        return
    _launch(param, grad, exp_avg, exp_avg_sq, _UNUSED_SCALARS, scalars, zero_grad, grad_scale)


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


def adamw_step_from_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     scalars: torch.Tensor, *, zero_grad: bool = False, grad_scale: torch.Tensor | None = None) -> None:
    """Core ``adamw_step_from_`` on CUDA: :func:`adamw_step_`'s pass with its scalars read from
    the fp32 device tensor ``scalars`` (7 numbers); anything else goes to core's reference."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    n = param.numel()
    if (not all(t.is_contiguous() and t.numel() == n and t.device == param.device for t in tensors)
            or scalars.numel() != 7 or scalars.dtype != torch.float32 or scalars.device != param.device
            or not scalars.is_contiguous()
            or (grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.device != param.device))):
        from polyaccel.core.ops import adamw_step_from_ as core_op

        return core_op.reference(param, grad, exp_avg, exp_avg_sq, scalars, zero_grad=zero_grad,
                                 grad_scale=grad_scale)
    torch.ops.polyaccel_cuda.adamw_step_from_(param, grad, exp_avg, exp_avg_sq, scalars, bool(zero_grad),
                                              grad_scale)
