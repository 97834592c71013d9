"""CUDA implementations of core's named ops, registered when the cuda backend is activated.

| op | implementation |
|---|---|
| ``rms_norm`` | Triton forward/backward, fp32 statistics (:mod:`.triton_rmsnorm`) |
| ``swiglu`` | Triton forward/backward (:mod:`.swiglu`) |
| ``grouped_mm`` | ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper), bf16 |
| ``grouped_mm_wgrad`` | Triton K-grouped GEMM over one or several micro-batches, accumulating into ``.grad`` (:mod:`.grouped_wgrad`) |
| ``moe_permute`` / ``moe_unpermute`` | device sort + Triton gather-combine that skips dropped copies, no host sync (:mod:`.moe_permute`) |
| ``linear_cross_entropy`` / ``linear_cross_entropy_grads`` | chunked LM head + CE with in-forward gradients (:mod:`.cross_entropy`) |
| ``add_scaled_`` | one Triton pass, the scale read from device memory (:mod:`.add_scaled`) |
| ``attention`` | ``F.scaled_dot_product_attention`` (flash / cuDNN / mem-efficient) (:mod:`.attention`) |
| ``decode_attention`` | Triton, one query token, a fixed key split: the same bits at every batch size (:mod:`.decode_attention`) |
| ``adamw_step_`` | one Triton pass over a flat buffer, fp32 math, optional grad zeroing (:mod:`.adamw`) |

The kernel modules import Triton only when a kernel first runs.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import has_triton
from polyaccel.cuda.adamw import adamw_step_
from polyaccel.cuda.add_scaled import add_scaled_
from polyaccel.cuda.attention import attention
from polyaccel.cuda.cross_entropy import linear_cross_entropy, linear_cross_entropy_grads
from polyaccel.cuda.decode_attention import decode_attention
from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad
from polyaccel.cuda.moe_permute import moe_permute, moe_unpermute
from polyaccel.cuda.swiglu import swiglu
from polyaccel.cuda.triton_rmsnorm import rms_norm

BACKEND = "cuda"


def register_all(registry) -> None:
    """Register this backend's CUDA implementations (called when the backend is activated)."""
    if has_triton():
        registry.register("rms_norm", "cuda", rms_norm, impl="triton", backend=BACKEND)
        registry.register("swiglu", "cuda", swiglu, impl="triton", backend=BACKEND)
        registry.register("linear_cross_entropy", "cuda", linear_cross_entropy,
                          impl="chunked+triton", backend=BACKEND)
        registry.register("linear_cross_entropy_grads", "cuda", linear_cross_entropy_grads,
                          impl="chunked+triton", backend=BACKEND)
        registry.register("add_scaled_", "cuda", add_scaled_, impl="triton", backend=BACKEND)
        registry.register("moe_unpermute", "cuda", moe_unpermute, impl="triton", backend=BACKEND)
        registry.register("adamw_step_", "cuda", adamw_step_, impl="triton", backend=BACKEND)
        registry.register("grouped_mm_wgrad", "cuda", grouped_mm_wgrad, impl="triton", backend=BACKEND)
        registry.register("decode_attention", "cuda", decode_attention, impl="triton-fixed-split", backend=BACKEND)
    registry.register("moe_permute", "cuda", moe_permute, impl="device-sort", backend=BACKEND)
    registry.register("attention", "cuda", attention, impl="sdpa", backend=BACKEND)
    if hasattr(torch, "_grouped_mm"):
        registry.register("grouped_mm", "cuda", grouped_mm, impl="torch._grouped_mm", backend=BACKEND)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Core ``grouped_mm`` through ``torch._grouped_mm``: x [T, K] @ w[g].T per group -> [T, N].

    ``w`` is stored [E, N, K] (``F.linear`` layout); its transposed view [E, K, N] is the
    column-major B operand the CUTLASS kernel wants, so nothing is copied. ``offsets`` are the
    int32 cumulative row ends, left on the device (no host sync). Autograd comes with the aten
    op. Non-bf16 inputs take core's reference.
    """
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        from polyaccel.core.ops import grouped_mm as core_op

        return core_op.reference(x, w, offsets)
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
