"""CUDA implementations of core's named ops, registered when the cuda backend is activated.

| op | implementation |
|---|---|
| ``rms_norm`` | Triton forward/backward, fp32 statistics (:mod:`.triton_rmsnorm`) |
| ``swiglu`` | Triton forward/backward (:mod:`.swiglu`) |
| ``grouped_mm`` | ``torch._grouped_mm`` (CUTLASS grouped GEMM on Hopper), bf16; or, timed against it per shape where no autograd graph is recorded, a persistent Triton kernel whose tiles start at each expert's first row (:mod:`.grouped_gemm`) |
| ``grouped_lowrank_add_`` | Triton: a LoRA adapter's rank-r product added into the grouped GEMM output in one pass (:mod:`.grouped_lowrank`) |
| ``grouped_mm_wgrad`` | Triton K-grouped GEMM over one or several micro-batches, accumulating into ``.grad`` (:mod:`.grouped_wgrad`) |
| ``moe_permute`` / ``moe_unpermute`` | device sort + Triton gather-combine that skips dropped copies, no host sync (:mod:`.moe_permute`) |
| ``linear_cross_entropy`` / ``linear_cross_entropy_grads`` | chunked LM head + CE with in-forward gradients (:mod:`.cross_entropy`) |
| ``router_topk`` | softmax and top-k in one Triton pass, off until timed (:mod:`.router`) |
| ``linear_cross_entropy_logit_grads`` | the same in one chunk, the logits' gradient returned (:mod:`.cross_entropy`) |
| ``add_scaled_`` | one Triton pass, the scale read from device memory (:mod:`.add_scaled`) |
| ``attention`` | ``F.scaled_dot_product_attention`` (flash / cuDNN / mem-efficient) (:mod:`.attention`) |
| ``causal_attention`` | FlashAttention-4's CuTe kernels on Hopper/Blackwell, registered only where ``flash-attn-4`` is installed (:mod:`.flash_attention`) |
| ``decode_attention`` | Triton, one query token, a fixed key split: the same bits at every batch size (:mod:`.decode_attention`) |
| ``cached_decode_attention`` | Triton, one kernel: each (row, head) reads its self-attention cache up to its position, read on the device (:mod:`.fused_decode`) |
| ``ln_linear`` / ``linear_residual`` | Triton GEMM for up to 16 rows: LayerNorm in the prologue; bias, exact GELU, residual add in the epilogue; cuBLAS (core's reference) above 16 rows (:mod:`.fused_decode`) |
| ``ln_qkv_into_cache_`` | Triton, one kernel for LayerNorm + q, k, v projections of up to 16 rows, k and v stored into the cache at each row's position; core's reference above 16 rows (:mod:`.fused_decode`) |
| ``greedy_pick`` / ``greedy_advance_`` | Triton, one kernel: argmax and its log-probability of ``logits + bias``, each row's vocabulary in fixed parts combined in a fixed order; ``greedy_advance_`` also does the step's bookkeeping (:mod:`.fused_decode`) |
| ``depthwise_conv1d`` | Triton, a [T, C] tile per program, K taps in fp32; the output keeps the input's layout (channels-last in, channels-last out) (:mod:`.depthwise_conv`) |
| ``conv2d_subsample`` | cuDNN channels-last convolutions; ReLU and the next layer's length mask in one Triton pass (:mod:`.conv_subsample`) |
| ``rows_to_fp8`` | Triton, one pass: a row's LayerNorm or GELU, absolute maximum, e4m3 values and scale (:mod:`.fp8_rows`) |
| ``adamw_step_`` | one Triton pass over a flat buffer, fp32 math, optional grad zeroing (:mod:`.adamw`) |

The kernel modules import Triton only when a kernel first runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyaccel.cuda._triton import has_triton
from polyaccel.cuda.adamw import adamw_step_
from polyaccel.cuda.add_scaled import add_scaled_
from polyaccel.cuda.attention import attention
from polyaccel.cuda.conv_subsample import conv2d_subsample
from polyaccel.cuda.cross_entropy import (
    linear_cross_entropy,
    linear_cross_entropy_grads,
    linear_cross_entropy_logit_grads,
)
from polyaccel.cuda.decode_attention import decode_attention
from polyaccel.cuda.depthwise_conv import depthwise_conv1d
from polyaccel.cuda.flash_attention import causal_attention, fa4_installed
from polyaccel.cuda.fp8_rows import rows_to_fp8
from polyaccel.cuda.fused_decode import (
    cached_decode_attention,
    greedy_advance_,
    greedy_pick,
    linear_residual,
    ln_linear,
    ln_qkv_into_cache_,
)
from polyaccel.cuda.grouped_lowrank import grouped_lowrank_add_
from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad
from polyaccel.cuda.moe_permute import moe_permute, moe_unpermute
from polyaccel.cuda.router import router_topk
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
        registry.register("linear_cross_entropy_logit_grads", "cuda", linear_cross_entropy_logit_grads,
                          impl="triton", backend=BACKEND)
        registry.register("add_scaled_", "cuda", add_scaled_, impl="triton", backend=BACKEND)
        registry.register("moe_unpermute", "cuda", moe_unpermute, impl="triton", backend=BACKEND)
        registry.register("router_topk", "cuda", router_topk, impl="triton (POLYACCEL_FUSED_ROUTER=1)",
                          backend=BACKEND)
        registry.register("adamw_step_", "cuda", adamw_step_, impl="triton", backend=BACKEND)
        registry.register("grouped_mm_wgrad", "cuda", grouped_mm_wgrad, impl="triton", backend=BACKEND)
        registry.register("grouped_lowrank_add_", "cuda", grouped_lowrank_add_, impl="triton", backend=BACKEND)
        registry.register("decode_attention", "cuda", decode_attention, impl="triton-fixed-split", backend=BACKEND)
        registry.register("cached_decode_attention", "cuda", cached_decode_attention, impl="triton", backend=BACKEND)
        registry.register("ln_linear", "cuda", ln_linear, impl="triton<=16 rows", backend=BACKEND)
        registry.register("linear_residual", "cuda", linear_residual, impl="triton<=16 rows", backend=BACKEND)
        registry.register("ln_qkv_into_cache_", "cuda", ln_qkv_into_cache_, impl="triton<=16 rows", backend=BACKEND)
        registry.register("greedy_pick", "cuda", greedy_pick, impl="triton", backend=BACKEND)
        registry.register("greedy_advance_", "cuda", greedy_advance_, impl="triton", backend=BACKEND)
        registry.register("rows_to_fp8", "cuda", rows_to_fp8, impl="triton", backend=BACKEND)
        registry.register("depthwise_conv1d", "cuda", depthwise_conv1d, impl="triton", backend=BACKEND)
        registry.register("conv2d_subsample", "cuda", conv2d_subsample, impl="cudnn-nhwc+triton", backend=BACKEND)
    registry.register("moe_permute", "cuda", moe_permute, impl="device-sort", backend=BACKEND)
    registry.register("attention", "cuda", attention, impl="sdpa", backend=BACKEND)
    if fa4_installed():
        registry.register("causal_attention", "cuda", causal_attention, impl="flash-attn-4", backend=BACKEND)
    if hasattr(torch, "_grouped_mm"):
        registry.register("grouped_mm", "cuda", grouped_mm, impl="torch._grouped_mm", backend=BACKEND)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Core ``grouped_mm`` through ``torch._grouped_mm``: x [T, K] @ w[g].T per group -> [T, N].

    ``w`` is stored [E, N, K] (``F.linear`` layout); its transposed view [E, K, N] is the
    column-major B operand the CUTLASS kernel wants, so nothing is copied. ``offsets`` are the
    int32 cumulative row ends, left on the device (no host sync). Autograd comes with the aten
    op. Non-bf16 inputs take core's reference; shapes the kernel refuses are first made
    acceptable (:func:`_gemm_operands`).
    """
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        from polyaccel.core.ops import grouped_mm as core_op

        return core_op.reference(x, w, offsets)
    if offsets.dtype != torch.int32:
        offsets = offsets.to(torch.int32)
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and not torch.compiler.is_compiling():
        # (no autograd graph to record: the expert layers' own backward calls this with grad off)
        from polyaccel.cuda import grouped_gemm

        if grouped_gemm.choose(x, w, offsets, lambda: _cutlass_grouped_mm(x, w, offsets)) == "triton":
            return grouped_gemm.grouped_mm(x, w, offsets)
    return _cutlass_grouped_mm(x, w, offsets)


def _cutlass_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    n = w.shape[-2]
    x, w = _gemm_operands(x, w)
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return y if y.shape[-1] == n else y[:, :n]


def _gemm_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, K] and ``w`` [E, N, K] as ``torch._grouped_mm`` takes them, forward and
    backward: 16-byte aligned pointers and strides. K and N that are not multiples of 16 bytes
    (a LoRA rank of 4, a hidden size of 1000) are zero-padded (zeros add nothing to the products;
    the caller drops the padded output columns); an operand at an unaligned address or with
    unaligned strides is copied."""
    per16 = 16 // x.element_size()
    pad_k, pad_n = -x.shape[-1] % per16, -w.shape[-2] % per16
    if pad_k or pad_n:
        return (F.pad(x, (0, pad_k)) if pad_k else x), F.pad(w, (0, pad_k, 0, pad_n))
    if not _aligned(x):
        x = x.clone(memory_format=torch.contiguous_format)
    if not _aligned(w):
        w = w.clone(memory_format=torch.contiguous_format)
    return x, w


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``t`` (either layout of its last two dims) meets the grouped GEMM's alignment."""
    per16 = 16 // t.element_size()
    rows, cols = t.stride()[-2:]
    unit_and_aligned = (cols == 1 and rows % per16 == 0) or (rows == 1 and cols % per16 == 0)
    if torch.compiler.is_compiling():  # traced: the compiler allocates aligned buffers (and has no pointers)
        return unit_and_aligned
    return unit_and_aligned and t.data_ptr() % 16 == 0
