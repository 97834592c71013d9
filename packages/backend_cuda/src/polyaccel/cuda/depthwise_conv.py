"""Core's ``depthwise_conv1d`` as one Triton kernel that reads its input in whatever layout
it comes and writes its output in the same one.

ConformerAED's conv module runs it on ``x.transpose(1, 2)`` of a [B, T, C] activation, and
then multiplies the result's transpose by a linear layer. torch's depthwise kernel takes
[B, C, T] and gave back [B, C, T], so that GEMM read a transposed input and cuBLAS chose an
sm75-era kernel: on an H200, canary-1b-flash's shape at batch 128 spent 0.64 ms per layer in
the conv and 0.97 ms in that GEMM (a contiguous input runs it at ~0.15 ms). Here a
channels-last input (C contiguous) gives a channels-last output, so the transpose after it is
contiguous again. Each program computes a [BLOCK_T, BLOCK_C] tile of one row, the K taps
accumulated in fp32 from overlapping loads that the caches serve.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

BLOCK_T, BLOCK_C = 32, 128


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def depthwise_conv1d(X, W, BIAS, OUT, C, T, T_OUT, PAD, sxb, sxc, sxt, swc, swk, sob, soc, sot,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        b = tl.program_id(2).to(tl.int64)
        cmask = c < C
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for k in tl.static_range(K):
            src = t + k - PAD
            inside = (src >= 0) & (src < T)
            x = tl.load(X + b * sxb + src[:, None] * sxt + c[None, :] * sxc,
                        mask=inside[:, None] & cmask[None, :], other=0.0)
            w = tl.load(W + c * swc + k * swk, mask=cmask, other=0.0)
            acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(BIAS + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + b * sob + t[:, None] * sot + c[None, :] * soc, acc.to(OUT.dtype.element_ty),
                 mask=(t < T_OUT)[:, None] & cmask[None, :])

    return depthwise_conv1d


def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     padding: int | None = None) -> torch.Tensor:
    """Core ``depthwise_conv1d`` on CUDA: x [B, C, T] (any strides), weight [C, 1, K] or
    [C, K] -> [B, C, T], laid out channels-last when ``x`` is (``x.stride(1) == 1``). Other
    inputs (a weight that does not match, negative padding, CPU tensors) take core's reference."""
    w = weight if weight.dim() == 2 else weight.reshape(weight.shape[0], weight.shape[-1])
    ok = (use_triton(x) and x.dim() == 3 and (weight.dim() == 2 or (weight.dim() == 3 and weight.shape[1] == 1))
          and w.shape[0] == x.shape[1] and (padding is None or padding >= 0)
          and (bias is None or bias.shape == (x.shape[1],)))
    if not ok:
        from polyaccel.core.ops import depthwise_conv1d as core_op

        return core_op.reference(x, weight, bias, padding)
    B, C, T = x.shape
    K = w.shape[1]
    pad = (K - 1) // 2 if padding is None else padding
    T_out = T + 2 * pad - K + 1
    if x.stride(1) == 1 and C > 1:
        out = torch.empty(B, T_out, C, device=x.device, dtype=x.dtype).transpose(1, 2)
    else:
        out = torch.empty(B, C, T_out, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    _kernel()[(cdiv(T_out, BLOCK_T), cdiv(C, BLOCK_C), B)](
        x, w, bias if bias is not None else w, out, C, T, T_out, pad,
        x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(1), out.stride(0), out.stride(1), out.stride(2),
        K=K, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    return out
