"""Expert weight gradients with the accumulation fused in: ``out[g] (+)= sum_s dy_s,g.T @ x_s,g``.

With gradient accumulation, every micro-batch after the first adds its expert weight
gradients into ``.grad``: unfused, the grouped GEMM writes a new [E, N, K] tensor and
``AccumulateGrad`` then reads it and ``.grad`` and writes ``.grad`` again (three passes over
~1 GB per expert weight and layer). Here one Triton kernel loops over each expert's token rows
with an fp32 accumulator and finishes by loading the ``.grad`` tile, adding, and storing it:
one read and one write of ``.grad`` (none with ``accumulate=False``).

At a few hundred rows per expert that store still dominates, so the kernel also takes the
rows of up to :data:`MAX_SOURCES` micro-batches at once (lists of ``dy``, ``x``,
``offsets``): one loop over all of an expert's rows, source after source, and one store of the
sum (:mod:`polyaccel.moe.grouped_linear` defers micro-batches to build such windows).

Programs are ordered expert-major, so the tiles of one expert run together and its token
rows are read from L2, not from memory, by all of them.

A single micro-batch whose experts have many rows each (:data:`TMA_MIN_ROWS` on average,
e.g. Mixtral's 8 experts at ~1,000 rows) takes a second kernel that loads its tiles with
Hopper's tensor-memory copies: one device-side descriptor per expert's row range, so the copy
engine zero-fills past the range's end and no row mask is computed (Mixtral's shapes on an
H200: 605 against 487 TFLOP/s for the first kernel's best tile, and CUTLASS's 552). Its
autotuner also tries persistent launches (a program per SM walks the tiles) that read and store
the ``.grad`` tiles through the copy engine: the store is asynchronous, so it runs under the next
tile's main loop, and adding into ``.grad`` costs little more than writing over it. Over
several micro-batches it would need one short pipelined loop per source, which measured slower
(362 against 461 TFLOP/s at ~256 rows per expert and source), so windows keep the first kernel.

That first kernel also has a persistent launch (:data:`PERSISTENT`, off until timed on a GPU):
a program per SM walks the tiles with the loads pipelined across them, so a tile's epilogue no
longer stalls its SM (at Qwen3's window of four micro-batches, ~1,000 rows per expert, the
one-tile-per-program launch ran at ~430 TFLOP/s in the step, session 31).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

MAX_SOURCES = 4
"""Micro-batches (sources) one launch reads; longer lists take several launches."""

CONFIGS = [  # (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages)
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 32, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 4),
    # longer row chunks and wider tiles, for windows of several micro-batches
    (128, 128, 128, 8, 3),
    (256, 128, 64, 8, 4),
    (256, 128, 128, 8, 2),
    (256, 128, 32, 8, 5),  # the best at Qwen3's window of 4 and OLMoE's of 2 (session 11)
    # skinny outputs: LoRA adapters' gradients, dA [E, r, K] and dB [E, N, r] with r ~ 8-64
    (256, 16, 64, 4, 3),
    (128, 16, 128, 4, 3),
    (256, 32, 64, 8, 3),
    (16, 256, 64, 4, 3),
    (32, 128, 128, 4, 3),
    (16, 128, 128, 4, 3),
]
"""Tile shapes tried by the autotuner (keyed on N, K and the rows' order of magnitude); a
shape with N or K at most :data:`SKINNY` tries only the tiles with a side of 32 or less,
any other shape only the others (:func:`_prune`)."""

SKINNY = 64

TMA_CONFIGS = [  # (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages, PER_SM, TMA_OUT, BAND_N)
    # Persistent (PER_SM programs per SM walk the tiles), tiles of .grad read and stored by the
    # copy engine: a tile's store overlaps the next tile's main loop. Adding into .grad, Mixtral's
    # shapes on an H200: gate/up 570, down 457 TFLOP/s against 472 and 427 for the best of the
    # one-tile-per-program rows below (tools/bench_wgrad_tiles.py, session 28).
    (128, 256, 64, 8, 3, 1, True, 0),
    (256, 128, 64, 8, 3, 1, True, 0),
    (128, 256, 32, 8, 6, 1, True, 0),
    (128, 256, 64, 8, 3, 1, False, 0),
    (128, 128, 64, 4, 4, 2, True, 0),
    # The same in bands of 8 rows of tiles (BAND_N): for outputs many tiles wide (Mixtral's
    # down weights: 56-112 columns of tiles) the tiles in flight then read a part of x, not all.
    (128, 256, 64, 8, 3, 1, True, 8),
    (256, 128, 64, 8, 3, 1, True, 8),
    # One tile per program (PER_SM 0), .grad through pointers: the best five of ten timed, then
    # one warpgroup in ~96 KB of shared memory, two programs per SM, one's pipeline fill and
    # .grad epilogue under the other's main loop (+7% on Mixtral's gate/up in session 23).
    (128, 256, 64, 8, 3, 0, False, 0),
    (128, 256, 64, 8, 4, 0, False, 0),
    (256, 128, 64, 8, 4, 0, False, 0),
    (256, 128, 64, 8, 3, 0, False, 0),
    (128, 256, 32, 8, 6, 0, False, 0),
    (128, 128, 32, 4, 6, 0, False, 0),
    (128, 128, 64, 4, 3, 0, False, 0),
]
"""Tile shapes and launch kinds the tensor-memory kernel's autotuner tries; ``TMA_OUT`` ones
only where the output's rows and pointer are 16-byte aligned (:func:`_prune_tma`)."""

PERSISTENT_CONFIGS = [  # (BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages, PER_SM, FLATTEN)
    (256, 128, 32, 8, 5, 1, True),
    (256, 128, 64, 8, 3, 1, True),
    (128, 256, 64, 8, 3, 1, True),
    (128, 256, 32, 8, 5, 1, True),
    (128, 128, 64, 8, 4, 1, True),
    (256, 128, 32, 8, 5, 1, False),
    (128, 128, 64, 4, 4, 2, False),
]
"""The persistent launch of the pointer kernel (:data:`PERSISTENT`): tiles, warps, stages,
programs per SM, and whether Triton pipelines the loads across tiles (FLATTEN)."""

PERSISTENT = os.environ.get("POLYACCEL_WGRAD_PERSISTENT", "0").strip().lower() in ("1", "true", "yes", "on")
"""Whether windows of micro-batches (and other launches of the pointer kernel with outputs wider
than :data:`SKINNY`) take the persistent launch, autotuned over :data:`PERSISTENT_CONFIGS`:
one program per SM walks the output tiles, so one tile's epilogue overlaps the next tile's
first loads. Off by default until timed on a GPU (``POLYACCEL_WGRAD_PERSISTENT=1``; read at
import, or set the attribute)."""

GRAD_FIRST = False
"""Whether an accumulating tile starts from ``.grad``'s current values, read before the main
loop, instead of adding them after it (where every program of a wave reads its ``.grad`` tile
at the same moment). Off: on an H200 (``tools/bench_wgrad_tiles.py``, rows ``prod-acc`` and
``prod-acc-grad-first``) it measured +7% and -4% on Mixtral's gate/up and down weights in one
run, -6% on both in the next, within the run-to-run spread of the ``prod`` rows."""

TMA_MIN_ROWS = 512
"""Average token rows per expert from which one micro-batch's gradient takes the
tensor-memory kernel (at ~1,000 it measured 1.1-1.3x the first kernel; at ~500 over two
micro-batches the two were even)."""


def _skinny_tile(block_n: int, block_k: int) -> bool:
    return min(block_n, block_k) <= 32


def _prune(configs, named_args, **kwargs):  # noqa: ANN001, ANN201, ARG001
    """The autotuner's early prune: tiles that fit the output's shape (see :data:`CONFIGS`)."""
    skinny = min(named_args["N"], named_args["K"]) <= SKINNY
    kept = [c for c in configs if _skinny_tile(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == skinny]
    return kept or configs


@triton_kernels
def _kernel():
    from polyaccel.cuda import _grouped_wgrad_triton as k  # imports Triton

    return k.grouped_wgrad, _autotuned(k.grouped_wgrad, CONFIGS, ["N", "K", "ROWS", "SOURCES", "ACCUMULATE", "GRAD_FIRST"],
                                       prune_configs_by={"early_config_prune": _prune})


def _autotuned(kernel, configs: list[tuple], key: list[str],  # noqa: ANN001, ANN202
               extra: tuple[str, ...] = ("PER_SM", "TMA_OUT", "BAND_N"), **kwargs):
    """``kernel`` under Triton's autotuner over ``configs`` (BLOCK_N, BLOCK_K, BLOCK_T, warps,
    stages, then the meta-parameters named in ``extra``: by default the tensor-memory kernel's)."""
    import triton

    def meta(c: tuple) -> dict:
        return {"BLOCK_N": c[0], "BLOCK_K": c[1], "BLOCK_T": c[2], **dict(zip(extra, c[5:], strict=False))}

    return triton.autotune(
        configs=[triton.Config(meta(c), num_warps=c[3], num_stages=c[4]) for c in configs],
        key=key,
        restore_value=["OUT"],  # trial runs add into OUT: put it back after each
        reset_to_zero=["SUMSQ"],  # and may write more per-tile sums than the chosen tile does
        **kwargs,
    )(kernel)


@triton_kernels
def _tma_kernel():
    from polyaccel.cuda import _grouped_wgrad_triton as k  # imports Triton

    return k.grouped_wgrad_tma, _autotuned(k.grouped_wgrad_tma, TMA_CONFIGS, ["G", "N", "K", "ROWS", "ACCUMULATE",
                                                                            "GRAD_FIRST"],
                                           prune_configs_by={"early_config_prune": _prune_tma})


@triton_kernels
def _persistent_kernel():
    from polyaccel.cuda import _grouped_wgrad_triton as k  # imports Triton

    return k.grouped_wgrad_persistent, _autotuned(
        k.grouped_wgrad_persistent, PERSISTENT_CONFIGS, ["N", "K", "ROWS", "SOURCES", "ACCUMULATE", "GRAD_FIRST"],
        extra=("PER_SM", "FLATTEN"))


def _out_aligned(out: torch.Tensor) -> bool:
    """Whether the copy engine can address ``out`` [G, N, K]: 16-byte aligned pointer and rows."""
    return out.data_ptr() % 16 == 0 and out.shape[-1] * out.element_size() % 16 == 0


def _prune_tma(configs, named_args, **kwargs):  # noqa: ANN001, ANN201, ARG001
    """The tensor-memory autotuner's early prune: no ``TMA_OUT`` tiles for an unaligned output."""
    if _out_aligned(named_args["OUT"]):
        return configs
    return [c for c in configs if not c.kwargs["TMA_OUT"]]


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:  # noqa: ARG001
    """Triton's allocator for a launch's scratch memory (where device-side descriptors live)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _ensure_scratch_allocator() -> None:
    """Give Triton :func:`_scratch` in this thread's context unless one is set there already
    (the allocator is a context variable, and autograd runs backward on its own threads)."""
    import triton

    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):
        pass
    triton.set_allocator(_scratch)


def _takes_tma(dy: torch.Tensor, x: torch.Tensor, groups: int) -> bool:
    """Whether one micro-batch's gradient takes the tensor-memory kernel: enough rows per expert
    (:data:`TMA_MIN_ROWS`), wide outputs, 16-byte aligned rows and pointers, a Triton that
    has device-side descriptors, and a Hopper or newer GPU (or the interpreter)."""
    if dy.shape[0] < TMA_MIN_ROWS * groups or min(dy.shape[1], x.shape[1]) <= SKINNY:
        return False
    if any(t.stride(0) * t.element_size() % 16 or t.data_ptr() % 16 for t in (dy, x)):
        return False
    return _tma_capable(dy.device.index if dy.is_cuda else None)


@functools.cache
def _tma_capable(cuda_index: int | None) -> bool:
    """Whether Triton has device-side descriptors and the GPU (``None``: the interpreter) is a
    Hopper or newer; asked once per device, not at every launch."""
    import triton
    import triton.language as tl

    if not (hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    return cuda_index is None or torch.cuda.get_device_capability(cuda_index)[0] >= 9


def grouped_mm_wgrad(dy: torch.Tensor | Sequence[torch.Tensor], x: torch.Tensor | Sequence[torch.Tensor],
                     offsets: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor | None = None,
                     accumulate: bool = True, sumsq: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``grouped_mm_wgrad`` on CUDA (bf16/fp16 inputs, contiguous ``out``); other
    inputs take core's reference. ``sumsq``: each tile's epilogue also sums the squares of
    what it stores, one slot per tile, and those are summed in a fixed order."""
    dys, xs, offs = (list(t) if isinstance(t, (list, tuple)) else [t] for t in (dy, x, offsets))
    if (not use_triton(dys[0]) or dys[0].dtype not in (torch.bfloat16, torch.float16)
            or any(t.dtype != dys[0].dtype for t in dys + xs)
            or (out is not None and not out.is_contiguous())):
        from polyaccel.core.ops import grouped_mm_wgrad as core_op

        return core_op.reference(dy, x, offsets, out, accumulate, sumsq)
    accumulate = accumulate and out is not None
    if out is None:
        out = dys[0].new_empty(offs[0].numel(), dys[0].shape[1], xs[0].shape[1])
    for i in range(0, len(dys), MAX_SOURCES):
        part = slice(i, i + MAX_SOURCES)
        last = i + MAX_SOURCES >= len(dys)
        _launch(dys[part], xs[part], offs[part], out, accumulate=accumulate or i > 0,
                sumsq=sumsq if last else None)
    return out


def _tile_sums(sumsq: torch.Tensor | None, out: torch.Tensor, configs: list[tuple]) -> torch.Tensor:
    """A zeroed fp32 slot per output tile for the smallest tile among ``configs`` (the
    autotuner's choice is not known before the launch); a 1-element dummy without ``sumsq``."""
    if sumsq is None:
        return torch.zeros(1, device=out.device, dtype=torch.float32)
    if sumsq.dtype != torch.float32 or sumsq.numel() != 1 or sumsq.device != out.device:
        raise ValueError(f"grouped_mm_wgrad: sumsq must be one fp32 element on {out.device}")
    G, N, K = out.shape
    tiles = max(cdiv(N, c[0]) * cdiv(K, c[1]) for c in configs)
    return torch.zeros(G * tiles, device=out.device, dtype=torch.float32)


def _rows_key(rows: int) -> int:
    """Rows rounded up to a power of two: the autotuner's key, so windows of 1, 2 or 4
    micro-batches each get their own tile shape without retuning on every count."""
    return 1 << max(rows - 1, 1).bit_length()


def _launch(dys: list[torch.Tensor], xs: list[torch.Tensor], offs: list[torch.Tensor], out: torch.Tensor, *,
            accumulate: bool, sumsq: torch.Tensor | None = None) -> None:
    G, N, K = out.shape
    dys, xs = [t.contiguous() for t in dys], [t.contiguous() for t in xs]  # (no-ops for the usual layout)
    if len({t.stride(0) for t in xs}) > 1:
        raise ValueError("grouped_mm_wgrad: the x of all micro-batches must have the same width")
    offs = [o if o.dtype == torch.int32 else o.to(torch.int32) for o in offs]
    for o in offs:
        if o.numel() != G:
            raise ValueError(f"grouped_mm_wgrad: offsets of {o.numel()} groups for an output of {G}")
    n = len(dys)
    if n == 1 and _takes_tma(dys[0], xs[0], G):
        _launch_tma(dys[0], xs[0], offs[0], out, accumulate=accumulate, sumsq=sumsq)
        return
    pad = lambda ts: ts + [ts[0]] * (MAX_SOURCES - len(ts))  # noqa: E731  (unused slots: never read)
    rows = [min(d.shape[0], x.shape[0]) for d, x in zip(dys, xs, strict=True)]
    rows_key = _rows_key(sum(t.shape[0] for t in dys))
    skinny = min(N, K) <= SKINNY
    flags = dict(SOURCES=n, ACCUMULATE=accumulate, GRAD_FIRST=GRAD_FIRST, SQUARES=sumsq is not None)
    if PERSISTENT and not skinny:
        _launch_persistent((*pad(dys), *pad(xs), *pad(offs), *pad(rows)), out, rows_key, dys[0].stride(0),
                           xs[0].stride(0), flags, sumsq)
        return
    plain, tuned = _kernel()

    def grid(meta):
        return cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"]), G

    sums = _tile_sums(sumsq, out, [c for c in CONFIGS if _skinny_tile(c[0], c[1]) == skinny] or CONFIGS)
    args = (*pad(dys), *pad(xs), *pad(offs), *pad(rows), out, N, K, rows_key, dys[0].stride(0), xs[0].stride(0),
            sums)
    if dys[0].is_cuda:
        tuned[grid](*args, **flags)
    else:  # Triton's CPU interpreter (tests): no timing, the first tile shape
        bn, bk, bt, _, _ = CONFIGS[0]
        plain[grid({"BLOCK_N": bn, "BLOCK_K": bk})](*args, **flags, BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt)
    if sumsq is not None:
        torch.sum(sums, dim=0, keepdim=False, out=sumsq.view(()))


def _launch_persistent(sources: tuple, out: torch.Tensor, rows_key: int, stride_dy: int, stride_x: int,
                       flags: dict, sumsq: torch.Tensor | None, config: tuple | None = None) -> None:
    """The pointer kernel's persistent launch (:data:`PERSISTENT`) over the padded source lists
    (dy, x, offsets, rows: four of each): autotuned, or at ``config`` (a
    :data:`PERSISTENT_CONFIGS` entry; the interpreter takes the first)."""
    G, N, K = out.shape
    plain, tuned = _persistent_kernel()
    sms = _multiprocessors(out.device.index) if out.is_cuda else 2

    def grid(meta):
        return (min(G * cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"]), sms * meta["PER_SM"]),)

    sums = _tile_sums(sumsq, out, PERSISTENT_CONFIGS)
    args = (*sources, out, G, N, K, rows_key, stride_dy, stride_x, sums)
    if out.is_cuda and config is None:
        tuned[grid](*args, **flags)
    else:
        bn, bk, bt, warps, stages, per_sm, flatten = config or PERSISTENT_CONFIGS[0]
        meta = dict(BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt, PER_SM=per_sm, FLATTEN=flatten)
        extra = dict(num_warps=warps, num_stages=stages) if out.is_cuda else {}
        plain[grid(meta)](*args, **flags, **meta, **extra)
    if sumsq is not None:
        torch.sum(sums, dim=0, keepdim=False, out=sumsq.view(()))


def _launch_tma(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
                config: tuple | None = None, sumsq: torch.Tensor | None = None) -> None:
    """One micro-batch through the tensor-memory kernel: autotuned, or at ``config`` (a
    :data:`TMA_CONFIGS` entry; the Triton interpreter takes the first one that applies)."""
    G, N, K = out.shape
    _ensure_scratch_allocator()
    plain, tuned = _tma_kernel()
    sms = _multiprocessors(out.device.index) if out.is_cuda else 2

    def grid(meta):
        tiles = G * cdiv(N, meta["BLOCK_N"]) * cdiv(K, meta["BLOCK_K"])
        return (min(tiles, sms * meta["PER_SM"]) if meta["PER_SM"] else tiles,)

    sums = _tile_sums(sumsq, out, TMA_CONFIGS)
    args = (dy, x, offs, min(dy.shape[0], x.shape[0]), out, G, N, K, _rows_key(dy.shape[0]), dy.stride(0),
            x.stride(0), sums)
    flags = dict(ACCUMULATE=accumulate, GRAD_FIRST=GRAD_FIRST, SQUARES=sumsq is not None)
    if dy.is_cuda and config is None:
        tuned[grid](*args, **flags)
    else:
        _launch_tma_at(plain, grid, args, flags, out, config, dy.is_cuda)
    if sumsq is not None:
        torch.sum(sums, dim=0, keepdim=False, out=sumsq.view(()))


def _launch_tma_at(plain, grid, args: tuple, flags: dict, out: torch.Tensor, config: tuple | None,  # noqa: ANN001
                   on_cuda: bool) -> None:
    """The tensor-memory kernel at ``config`` (the interpreter: the first one that applies)."""
    if config is None:  # Triton's CPU interpreter (tests): no timing
        config = next(c for c in TMA_CONFIGS if _out_aligned(out) or not c[6])
    bn, bk, bt, warps, stages, per_sm, tma_out, band_n = config
    if tma_out and not _out_aligned(out):
        raise ValueError("grouped_mm_wgrad: TMA_OUT needs a 16-byte aligned output")
    meta = dict(BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt, PER_SM=per_sm, TMA_OUT=tma_out, BAND_N=band_n)
    extra = dict(num_warps=warps, num_stages=stages) if on_cuda else {}
    plain[grid(meta)](*args, **flags, **meta, **extra)


@functools.cache
def _multiprocessors(cuda_index: int) -> int:
    return torch.cuda.get_device_properties(cuda_index).multi_processor_count
