"""A decoder step in few kernels: core's ``ln_linear``, ``linear_residual``,
``ln_qkv_into_cache_``, ``cached_decode_attention``, ``greedy_pick`` and ``greedy_advance_``
on CUDA.

At batch 1 a decoder step is bound by kernel launches, not by reading the weights: Whisper
large-v3-turbo's plain step launches ~113 kernels per token, each reading a few MB at most.
These kernels fold the small ops into the GEMMs around them: the LayerNorm into the GEMM's
prologue (each program recomputes its rows' statistics, which costs a read of a few KB of
activations), the bias, exact GELU and residual add into its epilogue, and the self-attention
cache write into the q|k|v projection's epilogue (at each row's position, read on the device).
The greedy choice (argmax and its log-probability) and the step's bookkeeping are one more
kernel.

Each GEMM program computes a tile of :data:`BLOCK_M` rows by a block of output columns,
reducing K in one fixed order with ``tl.dot`` (split into parts for a long K: the tile's last
program to finish sums the parts' fp32 partials in part order); the launch depends only on the
weight's shape (:func:`_config`), so a row's result is the same bits whatever other rows run
with it (padded rows are masked). Up to :data:`TRITON_MAX_ROWS` rows run here; more take
core's references (cuBLAS), whose GEMMs are efficient there. Results are rounded to the input
dtype where the unfused ops round theirs, so the fused step follows the plain one closely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from polyaccel.cuda._triton import cdiv, dependent_launch, triton_kernels, use_triton

TRITON_MAX_ROWS = 16
"""Rows (tokens) up to which the Triton GEMMs run; more take cuBLAS through core's references."""
BLOCK_M = 16
"""Rows per GEMM tile, at every row count (the smallest ``tl.dot`` tile)."""
BLOCK_S = 64
"""Cache positions per step of the self-attention loop."""
SPLIT_ROWS = 640
"""K per part when a weight's K is split (see :func:`_config`)."""
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@triton_kernels
def _kernels():
    from polyaccel.cuda import _fused_decode_triton  # imports Triton

    return _fused_decode_triton


class GemmConfig(NamedTuple):
    """One GEMM launch's shape: columns and K per step of a program, K parts (programs per
    column block whose fp32 partial sums the last of them adds in part order), warps, stages."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def _config(N: int, K: int, dtype: torch.dtype, parts: int = 1) -> GemmConfig:
    """The launch for a weight of N x K (``parts`` such weights in one launch): a function of
    the weights alone, never of the row count, so a row's bits do not depend on the batch.

    Few rows read each weight once, so a launch wants enough programs to keep the memory
    system busy: column blocks as wide as still give about 100 of them (16 to 64; a weight
    that would have 100 of 128 columns, a vocabulary, takes 64 with a 3-stage pipeline); a K
    more than twice N is split into parts of about :data:`SPLIT_ROWS` (at most 8), as 1,280
    output columns alone give too few programs. Measured on one H200 for Whisper
    large-v3-turbo's decoder, each call reading its weights from memory as a decoder step does
    (``tools/bench_asr.py --sections kernels``, docs/benchmarks.md)."""
    step = 64 if dtype == torch.float32 else 256
    if K > 2 * N and K >= 2 * SPLIT_ROWS:
        return GemmConfig(32, min(step, 128), min(8, K // SPLIT_ROWS))
    if cdiv(N * parts, 128) >= 100:  # a vocabulary projection
        return GemmConfig(64, step, num_stages=3)
    block_n = 16
    for width in (32, 64):
        if cdiv(N * parts, width) >= 100:
            block_n = width
    return GemmConfig(block_n, step)


def _launch_options(config: GemmConfig, device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, **dependent_launch(device)}


def _rows(x: torch.Tensor, K: int) -> torch.Tensor | None:
    """``x`` [..., K] as [M, K] rows with unit column stride, or None (not a view)."""
    if x.shape[-1] != K or x.stride(-1) != 1:
        return None
    x_MK = x.reshape(-1, K)
    return x_MK if x_MK.data_ptr() == x.data_ptr() and x_MK.stride(1) == 1 else None


def _vector(t: torch.Tensor | None, n: int) -> bool:
    return t is None or (t.dim() == 1 and t.shape[0] == n and t.is_contiguous())


def _gemm_ok(x: torch.Tensor, x_MK: torch.Tensor | None, weights: Sequence[torch.Tensor]) -> bool:
    """Whether the Triton GEMMs take these operands: few rows, one float dtype, row-major weights."""
    return (use_triton(x) and x_MK is not None and 0 < x_MK.shape[0] <= TRITON_MAX_ROWS and x.dtype in _FLOATS
            and all(w.dtype == x.dtype and w.dim() == 2 and w.is_contiguous() for w in weights))


def ln_linear(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Core ``ln_linear`` on CUDA: one kernel (LayerNorm in the prologue; bias and exact GELU
    in the epilogue) for up to :data:`TRITON_MAX_ROWS` rows; otherwise core's reference."""
    N, K = weight.shape
    x_MK = _rows(x, K)
    if not (_gemm_ok(x, x_MK, [weight]) and ln_weight is not None and ln_bias is not None
            and _vector(ln_weight, K) and _vector(ln_bias, K) and _vector(bias, N)
            and activation in (None, "gelu") and (out_dtype is None or out_dtype in _FLOATS)):
        from polyaccel.core.ops import ln_linear as core_op

        return core_op.reference(x, ln_weight, ln_bias, eps, weight, bias, activation, out_dtype)
    out = _linear(x_MK, weight, bias, ln=(ln_weight, ln_bias, eps), gelu=activation == "gelu",
                  out_dtype=out_dtype or x.dtype)
    return out.view(*x.shape[:-1], N)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
    """Core ``linear_residual`` on CUDA: one kernel (bias and residual add in the epilogue)
    for up to :data:`TRITON_MAX_ROWS` rows; otherwise core's reference."""
    N, K = weight.shape
    x_MK = _rows(x, K)
    res_MN = _rows(residual, N)
    if not (_gemm_ok(x, x_MK, [weight]) and _vector(bias, N) and res_MN is not None
            and residual.dtype == x.dtype and res_MN.shape[0] == x_MK.shape[0]
            and residual.shape[:-1] == x.shape[:-1]):
        from polyaccel.core.ops import linear_residual as core_op

        return core_op.reference(x, weight, bias, residual)
    return _linear(x_MK, weight, bias, residual=res_MN, out_dtype=x.dtype).view(*x.shape[:-1], N)


def _linear(x_MK: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
            ln: tuple | None = None, gelu: bool = False, residual: torch.Tensor | None = None,
            out_dtype: torch.dtype, config: GemmConfig | None = None) -> torch.Tensor:
    linear = _kernels().linear
    (M, K), N = x_MK.shape, weight.shape[0]
    out = torch.empty(M, N, device=x_MK.device, dtype=out_dtype)
    ln_w, ln_b, eps = ln if ln is not None else (x_MK, x_MK, 0.0)  # never read without HAS_LN
    config = config or _config(N, K, x_MK.dtype)
    grid = (cdiv(N, config.block_n), cdiv(M, BLOCK_M), config.split_k)
    parts = counts = out  # never read with one K part
    if config.split_k > 1:
        parts = torch.empty(config.split_k, grid[1] * BLOCK_M, N, device=x_MK.device, dtype=torch.float32)
        counts = torch.zeros(grid[0] * grid[1], device=x_MK.device, dtype=torch.int32)
    linear[grid](
        x_MK, ln_w, ln_b, weight, bias if bias is not None else weight, residual if residual is not None else out,
        out, parts, counts, M, N, K, float(eps), x_MK.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_LN=ln is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None, GELU=gelu,
        SPLIT_K=config.split_k, BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        LN_K=K if ln is not None else 0, **_launch_options(config, x_MK.device))
    return out


def ln_qkv_into_cache_(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float,
                       weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                       cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Core ``ln_qkv_into_cache_`` on CUDA: one kernel for q, k and v of up to
    :data:`TRITON_MAX_ROWS` rows (programs over (column block, q/k/v, row block)), k and v
    stored straight into the caches at ``position``; otherwise core's reference."""
    B, H, C, D = cache_k.shape
    wq, wk, wv = weights
    bq, bk, bv = biases
    N, K = wq.shape
    x_MK = _rows(x, K)
    if not (_gemm_ok(x, x_MK, [wq, wk, wv]) and x_MK.shape[0] == B and N == H * D
            and wk.shape == wv.shape == wq.shape and all(_vector(b, N) for b in biases)
            and ln_weight is not None and ln_bias is not None and _vector(ln_weight, K) and _vector(ln_bias, K)
            and cache_v.shape == cache_k.shape and cache_k.dtype == cache_v.dtype == x.dtype
            and cache_k.stride(-1) == cache_v.stride(-1) == 1
            and position.shape == (B,) and not position.is_floating_point()):
        from polyaccel.core.ops import ln_qkv_into_cache_ as core_op

        return core_op.reference(x, ln_weight, ln_bias, eps, weights, biases, cache_k, cache_v, position)
    qkv_into_cache = _kernels().qkv_into_cache
    q = torch.empty(B, N, device=x.device, dtype=x.dtype)
    config = _config(N, K, x.dtype, parts=3)
    qkv_into_cache[(cdiv(N, config.block_n), 3, cdiv(B, BLOCK_M))](
        x_MK, ln_weight, ln_bias, wq, wk, wv, *(b if b is not None else wq for b in biases), q, cache_k, cache_v,
        position, B, N, K, C, D, float(eps), x_MK.stride(0), q.stride(0),
        cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), cache_v.stride(0), cache_v.stride(1), cache_v.stride(2),
        HAS_BQ=bq is not None, HAS_BK=bk is not None, HAS_BV=bv is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, LN_K=K,
        **_launch_options(config, x.device))
    return q.view(B, H, 1, D)


def cached_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                            position: torch.Tensor) -> torch.Tensor:
    """Core ``cached_decode_attention`` on CUDA: one program per (row, head) reads cache
    positions ``0..position[b]`` only (online softmax in fp32, one kernel); a row's result
    never depends on the batch. Other inputs (D > 256, ...) take core's reference."""
    B, H, T, D = q.shape
    C = cache_k.shape[2]
    if not (use_triton(q) and T == 1 and cache_k.shape == cache_v.shape == (B, H, C, D) and D <= 256
            and q.stride(-1) == cache_k.stride(-1) == cache_v.stride(-1) == 1
            and position.shape == (B,) and not position.is_floating_point()):
        from polyaccel.core.ops import cached_decode_attention as core_op

        return core_op.reference(q, cache_k, cache_v, position)
    cached_attention = _kernels().cached_attention
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    cached_attention[(B * H,)](q, cache_k, cache_v, position, out, H, C, D ** -0.5,
                               q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
                               cache_v.stride(0), cache_v.stride(1), cache_v.stride(2), out.stride(0), out.stride(1),
                               D=D, BLOCK_D=max(16, 1 << (D - 1).bit_length()), BLOCK_S=BLOCK_S,
                               **dependent_launch(q.device))
    return out


PICK_PART = 1024
"""Columns of a row that one program of :func:`greedy_pick` scans (a vocabulary of 51,866 is
51 programs per row, which the row's last program combines in one load each). On an H200 at
Whisper's vocabulary: 4.5 / 6.1 µs at 1 / 16 rows, against 5.4 / 6.4 for 2,048 (docs/benchmarks.md)."""


def _pick_ok(logits: torch.Tensor, bias: torch.Tensor) -> bool:
    V = logits.shape[-1]
    return (use_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1 and logits.dtype in _FLOATS
            and bias.shape == (V,) and bias.dtype == torch.float32 and bias.is_contiguous() and 0 < V < 2**24)


def _pick(logits: torch.Tensor, bias: torch.Tensor, best: torch.Tensor, logprob: torch.Tensor,
          advance: tuple | None = None, eos_id: int = 0) -> None:
    pick = _kernels().greedy_pick
    (B, V), parts = logits.shape, cdiv(logits.shape[1], PICK_PART)
    partial = torch.empty(B, parts, 3, device=logits.device, dtype=torch.float32)
    counts = torch.zeros(B, device=logits.device, dtype=torch.int32)
    tokens, position, finished, logprob_sum, counted, out, step = advance or (best, best, best, logprob, logprob,
                                                                              best, best)
    pick[(B, parts)](logits, bias, partial, counts, best, logprob, tokens, position, finished, logprob_sum, counted,
                     out, step, V, logits.stride(0), out.stride(0), out.shape[-1], eos_id, ADVANCE=advance is not None,
                     PART_V=PICK_PART, BLOCK_V=min(PICK_PART, 1024), PARTS_P2=max(2, 1 << (parts - 1).bit_length()),
                     **dependent_launch(logits.device))


def greedy_pick(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Core ``greedy_pick`` on CUDA: one kernel instead of a cast, an add, an argmax, a
    log-softmax and a gather. Programs over (row, part of the vocabulary); each row's last
    program combines the parts in a fixed order, so a row's result never depends on the batch."""
    if not _pick_ok(logits, bias):
        from polyaccel.core.ops import greedy_pick as core_op

        return core_op.reference(logits, bias)
    B = logits.shape[0]
    best = torch.empty(B, device=logits.device, dtype=torch.int64)
    logprob = torch.empty(B, device=logits.device, dtype=torch.float32)
    _pick(logits, bias, best, logprob)
    return best, logprob


def greedy_advance_(logits: torch.Tensor, bias: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor,
                    finished: torch.Tensor, logprob_sum: torch.Tensor, counted: torch.Tensor, out: torch.Tensor,
                    step: torch.Tensor, eos_id: int) -> None:
    """Core ``greedy_advance_`` on CUDA: :func:`greedy_pick`'s kernel, whose last program per
    row also does the row's bookkeeping (about ten small kernels fewer per decoded token)."""
    B = logits.shape[0] if logits.dim() == 2 else -1
    i64 = (tokens, position, out, step)
    if not (_pick_ok(logits, bias) and all(t.dtype == torch.int64 and t.is_contiguous() for t in i64)
            and tokens.shape == position.shape == finished.shape == logprob_sum.shape == counted.shape == (B,)
            and out.dim() == 2 and out.shape[0] == B and out.shape[1] > 0 and step.shape == (1,)
            and finished.dtype == torch.bool and logprob_sum.dtype == counted.dtype == torch.float32
            and all(t.is_contiguous() for t in (finished, logprob_sum, counted))):
        from polyaccel.core.ops import greedy_advance_ as core_op

        return core_op.reference(logits, bias, tokens, position, finished, logprob_sum, counted, out, step, eos_id)
    _pick(logits, bias, tokens, logprob_sum, (tokens, position, finished, logprob_sum, counted, out, step), eos_id)
    return None
