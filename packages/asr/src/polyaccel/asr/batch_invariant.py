"""Kernels whose per-row results do not depend on how many rows run with them.

Greedy decoding promises the same tokens at every batch size. In fp32 that holds; in bf16 on
CUDA it does not by itself: cuBLAS picks GEMM kernels by the row count M (a split-K kernel at
M = 1 sums K in another order than the kernel picked at M = 128), cuDNN picks convolution
algorithms by batch, and flash attention splits the keys of a one-token query over more
blocks the fewer (batch x heads) it has (and sums those splits in no fixed order). Measured on
an H200 (bf16, Whisper shapes; ``tests/asr/test_batch_invariance.py``): the vocabulary projection at M <= 16, the cross-attention of a decoder step and the encoder's
convolutions gave other bits at other batch sizes; the other GEMMs, LayerNorm and masked
attention did not.

The remedies here hold on any device:

- :func:`fixed_rows_linear`: a GEMM always run on blocks of exactly :data:`ROWS` rows (the
  rows zero-padded up), so the kernel never changes with the batch. Decoder-step GEMMs are
  bound by reading the weights at these sizes, so a block of 128 rows costs about what one
  row does.
- attention: core's ``decode_attention`` op, which backends implement with the same key split
  at every batch size (the CUDA backend: a Triton kernel that cuts every row's keys into 8
  pieces and combines them in a fixed order).
- :func:`conv1d_as_gemm`: a 1-D convolution as one GEMM over every frame of the batch (an
  im2col view), the same kernel at every batch once the rows run into the thousands.

They act only on CUDA tensors (:func:`applies`): elsewhere they are the plain op, so CPU
numerics do not move. Whisper takes them where ``WhisperASR.batch_invariant`` is set
(``polyaccel-asr transcribe --batch-invariant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 128
"""Rows per GEMM block of :func:`fixed_rows_linear` (the largest default batch bucket)."""


def applies(t: torch.Tensor) -> bool:
    """Whether ``t``'s device needs the invariant forms (CUDA)."""
    return t.is_cuda


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed on blocks of exactly :data:`ROWS` rows of the
    flattened ``x`` [..., K] (CUDA; elsewhere a plain ``F.linear``)."""
    if not applies(x):
        return F.linear(x, weight, bias)
    lead, K = x.shape[:-1], x.shape[-1]
    x_MK = x.reshape(-1, K)
    M = x_MK.shape[0]
    if M % ROWS:
        x_MK = F.pad(x_MK, (0, 0, 0, ROWS - M % ROWS))
    blocks = [F.linear(b, weight, bias) for b in x_MK.split(ROWS)]
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return y[:M].reshape(*lead, -1)


def conv1d_as_gemm(x_BTC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   stride: int = 1) -> torch.Tensor:
    """A "same"-padded 1-D convolution over time: x [B, T, C], weight [D, C, k] -> [B, T', D]
    (T' = ceil(T / stride)), as one GEMM over all B x T' frames on CUDA; ``F.conv1d``
    elsewhere. Channels-last in and out, so the encoder needs no transpose after it."""
    D, C, k = weight.shape
    if not applies(x_BTC):
        return F.conv1d(x_BTC.transpose(1, 2), weight, bias, stride=stride, padding=k // 2).transpose(1, 2)
    B = x_BTC.shape[0]
    x = F.pad(x_BTC, (0, 0, k // 2, k // 2))
    patches_BTCk = x.unfold(1, k, stride)                       # [B, T', C, k], a view
    T = patches_BTCk.shape[1]
    y = F.linear(patches_BTCk.reshape(B * T, C * k), weight.reshape(D, C * k), bias)
    return y.view(B, T, D)
