"""Core's ``conv2d_subsample`` on CUDA, channels-last throughout.

The conformer front end's first layer writes [B, 256, T/2, M/2]: at canary-1b-flash's shape
and batch 128, 3.1 G values (6.3 GB in bf16). Run as core's reference does it on an H200,
each layer's input went through a separate mask multiply and a layout change to channels-last
for cuDNN, and each output through a separate ReLU: 13 passes of ~2 ms over those tensors and
~8 ms of layout changes, more than the convolutions themselves. Here the activations stay
channels-last (cuDNN reads and writes them as they are), and one Triton pass per layer does
the ReLU and clears the frames past each row's length for the next layer, writing zeros
there without reading them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyaccel.core.ops import conv2d_subsample as core_op
from polyaccel.core.ops import zero_frames_past
from polyaccel.cuda._triton import triton_kernels, use_triton

BLOCK = 2048


@triton_kernels
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def relu_frames_(X, LENGTHS, T, ROW, BLOCK: tl.constexpr):
        # X channels-last [B, T, F, C]: one program per (row, frame), F * C contiguous values
        pid = tl.program_id(0)
        b = pid // T
        t = pid % T
        keep = t < tl.load(LENGTHS + b)
        base = X + pid.to(tl.int64) * ROW
        for start in range(0, ROW, BLOCK):
            i = start + tl.arange(0, BLOCK)
            inside = i < ROW
            if keep:
                x = tl.load(base + i, mask=inside, other=0.0)
                tl.store(base + i, tl.maximum(x, 0.0), mask=inside)
            else:
                tl.store(base + i, tl.zeros((BLOCK,), X.dtype.element_ty), mask=inside)

    return relu_frames_


def relu_frames_(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """In place on a channels-last [B, C, T, F] tensor: ReLU, and zeros at frames ``t >=
    lengths[b]``. Returns ``x``."""
    B, C, T, Fr = x.shape
    lengths = lengths.to(device=x.device, dtype=torch.int64).contiguous()
    _kernel()[(B * T,)](x, lengths, T, C * Fr, BLOCK=BLOCK)
    return x


def conv2d_subsample(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                     stride: int = 2, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``conv2d_subsample`` on CUDA: the same layers, channels-last (the result is a
    channels-last [B, Cout, T', F'] tensor), ReLU and the next layer's length mask in one
    pass. Without ``lengths`` each ReLU runs in place."""
    if not use_triton(x) or x.dim() != 4:
        return core_op.reference(x, weights, biases, stride, lengths)
    if lengths is not None:
        lengths = lengths.to(device=x.device, dtype=torch.int64)
        x = zero_frames_past(x, lengths)
    x = x.contiguous(memory_format=torch.channels_last)
    last = len(weights) - 1
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        x = F.conv2d(x, w.contiguous(memory_format=torch.channels_last), b, stride=stride,
                     padding=w.shape[-1] // 2).contiguous(memory_format=torch.channels_last)
        if lengths is not None and i < last:
            lengths = (lengths + stride - 1) // stride
            relu_frames_(x, lengths)
        else:
            x = x.relu_()
    return x
