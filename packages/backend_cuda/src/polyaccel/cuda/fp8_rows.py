"""``rows_to_fp8`` as one Triton pass: each row (after an optional LayerNorm or GELU) is read
once, its absolute maximum taken in registers, and written as e4m3 with its fp32 scale.
The GELU is its tanh form (within 4.8e-4 of the erf GELU; the values that moves by more than
an e4m3 step are the tail's near-zero ones, and the rows stand for values as close to the erf
GELU as the reference's do): the erf polynomial made the pass compute-bound.

Core's reference makes five or six passes over the activations in fp32 (norm or GELU, abs,
amax, scale, clamp, cast); that memory traffic cost more than the FP8 GEMM after it saves.
As the reference, the kernel multiplies by the fp32 reciprocals of 448 and of the scale (a
division per value cost it twice the time of the whole pass on an H200), so without a
prologue the bits equal the reference's; a LayerNorm's or GELU's fp32 math may differ from
torch's in the last place, which can move a value to the neighbouring e4m3 step.
"""

from __future__ import annotations

import os

import torch

from polyaccel.core.ops import E4M3_MAX
from polyaccel.cuda._triton import cdiv, triton_kernels

_PROLOGUES = {"none": 0, "layer_norm": 1, "gelu": 2}


def _tile(k: int) -> tuple[int, int, int]:
    """(BLOCK_A, BLOCK_B, ROWS): a row in two pieces, the largest power of two <= ``k`` and the
    rest rounded up to one (at least 16); about 4K elements a program."""
    block_a = 1 << (k.bit_length() - 1)
    block_b = max(16, 1 << max(0, (k - block_a - 1).bit_length()))
    return block_a, block_b, max(1, min(16, 4096 // block_a))


@triton_kernels
def _kernel():
    from polyaccel.cuda import _fp8_rows_triton  # imports Triton

    return _fp8_rows_triton.rows_fp8


def rows_to_fp8(x: torch.Tensor, prologue: str = "none", ln_weight: torch.Tensor | None = None,
                ln_bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Core's ``rows_to_fp8`` in one Triton kernel (see the module docstring)."""
    if prologue not in _PROLOGUES:
        raise ValueError(f"unknown prologue {prologue!r}; known: {', '.join(_PROLOGUES)}")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty(M, K, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M == 0:
        return q, scale
    block_a, block_b, rows = _tile(K)
    w = ln_weight.contiguous() if ln_weight is not None else x2
    b = ln_bias.contiguous() if ln_bias is not None else x2
    _kernel()[(cdiv(M, rows),)](
        x2, w, b, q, scale, M, K, x2.stride(0), eps, 1 / E4M3_MAX, E4M3_MAX,
        PROLOGUE=_PROLOGUES[prologue], HAS_W=ln_weight is not None, HAS_B=ln_bias is not None,
        BLOCK_A=block_a, BLOCK_B=block_b, ROWS=rows, ROUND=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=4 if block_a <= 1024 else 2)  # wide rows: more rows resident per SM (2.0 -> 0.73 ms, GELU 5,120)
    return q, scale
