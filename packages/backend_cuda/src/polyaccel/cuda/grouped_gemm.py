"""Expert GEMMs as one persistent Triton kernel: ``x[rows of g] @ w[g].T`` for every expert g.

The expert forward and input-gradient GEMMs are grouped GEMMs over a few hundred rows per
expert (fine-grained experts: Qwen3-MoE, OLMoE, DeepSeek-V3), and routing makes the experts
uneven: some get none, others several times the average. CUTLASS's grouped GEMM
(``torch._grouped_mm``) loses a fifth to a third of its rate there (``tools/bench_grouped_tiles.py``).
Here one program per SM walks 128 x 256 output tiles numbered expert by expert from each
expert's first row, reads rows and weights with Hopper's tensor-memory copies, and lets Triton
pipeline the loads across tiles (the next tile's first chunks load while one finishes, which
matters at a short reduction such as Qwen3's 768-wide down projection). Its autotuner (keyed on
the shape and the rows' order of magnitude) picks among :data:`CONFIGS`.

On an H200 (docs/benchmarks.md, session 31), uneven routing, it ran at 0.99-1.26x CUTLASS's
rate on Qwen3's and OLMoE's expert shapes; with every expert given the same rows, 0.80-1.17x.
Both sum in fp32 over the same chunks, and on those shapes their outputs were the same bits.
:func:`choose` picks between the two per shape (``POLYACCEL_GROUPED_MM``: ``auto``, the default,
times both on the first call's rows; ``triton`` or ``cutlass`` forces one).

Only for bf16 (and fp16, which the interpreter's tests use), Hopper or newer, 16-byte aligned
rows and a weight stored contiguous either way round (the forward's ``w``, the input
gradient's ``w.transpose(1, 2)``): :func:`takes_triton`; anything else takes CUTLASS.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

log = logging.getLogger(__name__)

CONFIGS = [  # (BLOCK_M, BLOCK_P, BLOCK_R, num_warps, num_stages, PER_SM, TMA_OUT, M_INNER, FLATTEN)
    # Pipelined across tiles, stores through pointers (no shared memory kept for the store, so a
    # fourth stage fits): the fastest on most of Qwen3's and OLMoE's expert GEMMs (session 31).
    (128, 256, 64, 8, 4, 1, False, False, True),
    (128, 256, 64, 8, 4, 1, False, True, True),
    (128, 256, 32, 8, 7, 1, False, False, True),
    (128, 256, 64, 8, 3, 1, False, False, True),
    (128, 256, 64, 8, 3, 1, True, False, True),
    # One tile's pipeline at a time, stores through the copy engine: the best on some uneven
    # input-gradient GEMMs.
    (128, 256, 64, 8, 3, 1, True, False, False),
    (128, 256, 64, 8, 3, 1, True, True, False),
]
"""Tiles (rows, columns, reduction chunk), warps, pipeline stages, programs per SM (0: one
tile per program), stores through the copy engine, the tile order within an expert (M_INNER:
down the rows first) and loads pipelined across tiles (FLATTEN) the autotuner tries."""


@triton_kernels
def _kernel():
    import triton

    from polyaccel.cuda import _grouped_mm_triton as k  # imports Triton

    configs = [triton.Config(_meta(c), num_warps=c[3], num_stages=c[4]) for c in CONFIGS]
    return k.grouped_mm_tma, triton.autotune(configs=configs, key=["P", "R", "G", "ROWS", "W_PR"],
                                             prune_configs_by={"early_config_prune": _prune})(k.grouped_mm_tma)


def _meta(c: tuple) -> dict:
    return dict(zip(("BLOCK_M", "BLOCK_P", "BLOCK_R"), c[:3], strict=True)) | dict(
        zip(("PER_SM", "TMA_OUT", "M_INNER", "FLATTEN"), c[5:], strict=True))


def _prune(configs, named_args, **kwargs):  # noqa: ANN001, ANN201
    """Reduction chunks that divide R where the weight's rows are the reduction (see :func:`_fits`)."""
    w_pr = kwargs.get("W_PR", named_args.get("W_PR"))
    return [c for c in configs if _fits(c.kwargs["BLOCK_R"], named_args["R"], w_pr)]


def _fits(block_r: int, r: int, w_pr: bool) -> bool:
    # Stored [G, R, P], a chunk past R would read the next expert's rows (against the
    # zero-filled columns of x: zero, unless those weights hold inf or NaN): chunks divide R.
    return w_pr or r % block_r == 0


def weight_layout(w: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``w`` [G, P, R] (``out = x @ w[g].T``) as the kernel reads it: (``w``, True) when
    contiguous, (``w.transpose(1, 2)``, False) when that is contiguous, else None."""
    if w.is_contiguous():
        return w, True
    wt = w.transpose(1, 2)
    return (wt, False) if wt.is_contiguous() else None


def takes_triton(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`grouped_mm` runs ``x @ w[g].T`` here: bf16 or fp16, aligned rows and pointers, a
    weight contiguous either way round, and a Hopper or newer GPU (or the interpreter)."""
    layout = weight_layout(w)
    if layout is None or x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype or not use_triton(x):
        return False
    stored, w_pr = layout
    P, R = w.shape[1], w.shape[2]
    if x.stride(1) != 1 or (x.stride(0) * 2) % 16 or x.data_ptr() % 16 or stored.data_ptr() % 16:
        return False
    if (P * 2) % 16 or (R * 2) % 16 or not any(_fits(c[2], R, w_pr) for c in CONFIGS):
        return False
    from polyaccel.cuda.grouped_wgrad import _tma_capable

    return _tma_capable(x.device.index if x.is_cuda else None)


def _rows_key(rows: int) -> int:
    return 1 << max(rows - 1, 1).bit_length()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, config: tuple | None = None
               ) -> torch.Tensor:
    """``x`` [T, R] rows sorted by group, ``w`` [G, P, R], int32 ``offsets`` [G] cumulative row
    ends -> [T, P] (rows past ``offsets[-1]`` zero). Autotuned on CUDA, or at ``config`` (a
    :data:`CONFIGS` entry; the interpreter takes the first that fits). Check
    :func:`takes_triton` first."""
    from polyaccel.cuda.grouped_wgrad import _ensure_scratch_allocator, _multiprocessors

    stored, w_pr = weight_layout(w)
    G, P, R = w.shape
    T = x.shape[0]
    out = x.new_empty(T, P)
    if T == 0:
        return out
    offsets = offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)
    _ensure_scratch_allocator()
    plain, tuned = _kernel()
    sms = _multiprocessors(x.device.index) if x.is_cuda else 2

    def grid(meta):
        # At most one partial tile per expert, and the rows past the last expert.
        bound = (cdiv(T, meta["BLOCK_M"]) + G + 1) * cdiv(P, meta["BLOCK_P"])
        return (min(bound, sms * meta["PER_SM"]) if meta["PER_SM"] else bound,)

    args = (x, stored, offsets, out, T, P, R, x.stride(0), out.stride(0), G, _rows_key(T))
    gp2 = max(16, 1 << max(G - 1, 1).bit_length())
    if x.is_cuda and config is None:
        tuned[grid](*args, W_PR=w_pr, GP2=gp2)
        return out
    if config is None:
        config = next(c for c in CONFIGS if _fits(c[2], R, w_pr))
    meta = _meta(config)
    extra = dict(num_warps=config[3], num_stages=config[4]) if x.is_cuda else {}
    plain[grid(meta)](*args, W_PR=w_pr, GP2=gp2, **meta, **extra)
    return out


CHOICES: dict[tuple, str] = {}
"""The implementation chosen per (groups, P, R, weight layout, rows' order of magnitude):
``"triton"`` or ``"cutlass"``."""


def choose(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
           cutlass: Callable[[], torch.Tensor]) -> str:
    """``"triton"`` or ``"cutlass"`` for ``x @ w[g].T`` (``cutlass()`` runs the other one).

    ``POLYACCEL_GROUPED_MM=triton|cutlass`` forces one (``triton`` only where
    :func:`takes_triton`). ``auto`` (the default) times both on these rows, device time only,
    once per key (the Triton autotuner's), and keeps the faster; while a CUDA graph is being
    captured, or under ``torch.compile``, an untimed shape takes CUTLASS."""
    want = os.environ.get("POLYACCEL_GROUPED_MM", "auto").strip().lower()
    if want not in ("auto", "triton", "cutlass"):
        raise ValueError(f"POLYACCEL_GROUPED_MM={want!r}: use auto, triton or cutlass")
    if want == "cutlass" or not takes_triton(x, w):
        return "cutlass"
    if want == "triton":
        return "triton"
    key = (w.shape[0], w.shape[1], w.shape[2], weight_layout(w)[1], _rows_key(x.shape[0]), x.device.index)
    if key in CHOICES:
        return CHOICES[key]
    if not x.is_cuda or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return "cutlass"
    try:
        triton_ms = _device_ms(lambda: grouped_mm(x, w, offsets))
    except Exception as e:  # noqa: BLE001  (a Triton that cannot build the kernel here: keep CUTLASS)
        log.warning("grouped GEMM: the Triton kernel failed on %s (%s); using CUTLASS for this shape",
                    key[:3], e)
        CHOICES[key] = "cutlass"
        return "cutlass"
    cutlass_ms = _device_ms(cutlass)
    CHOICES[key] = "triton" if triton_ms < cutlass_ms else "cutlass"
    log.info("grouped GEMM %s rows~%d: Triton %.3f ms, CUTLASS %.3f ms -> %s", key[:3], key[4], triton_ms,
             cutlass_ms, CHOICES[key])
    return CHOICES[key]


def _device_ms(run: Callable[[], torch.Tensor], calls: int = 5) -> float:
    """Median device time of ``run()`` over ``calls`` launches after two warm-up ones (the first
    autotunes); the GPU is held busy while they are queued so that host time is not counted."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms of cycles: the launch below is queued before the GPU gets to it
        start.record()
        run()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in times)[calls // 2]
