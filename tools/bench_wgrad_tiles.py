"""Expert weight-gradient kernels tile by tile: which kernel and tile shape wins at each shape.

For each case (an MoE shape's expert GEMM, with one or several micro-batches' rows) one
process times, after checking each result against ``torch._grouped_mm`` (CUTLASS):

- ``prod``: ``polyaccel.cuda.grouped_wgrad.grouped_mm_wgrad`` as shipped (its autotuner, and
  the tensor-memory kernel where it applies); ``prod-acc`` the same adding into ``.grad``, and
  ``prod-acc-grad-first`` adding with ``GRAD_FIRST`` (the ``.grad`` tile read before the loop);
- ``ptr(...)``: the pointer kernel at each tile shape of :data:`PTR`; ``prod-persistent`` /
  ``prod-persistent-acc`` its persistent launch as it would ship (``grouped_wgrad.PERSISTENT``,
  autotuned) and ``ptr-pers(...)`` that launch at each entry of ``PERSISTENT_CONFIGS``;
- ``tma(...)``: the tensor-memory kernel at each tile of :data:`TMA`, extended here to several
  micro-batches as one pipelined loop per micro-batch (an experiment: slower at windows);
- ``il(...)``: an experiment that interleaves the micro-batches in one loop, one descriptor
  pair each, zero-filled past each one's rows (slower too);
- ``shipped(...)`` / ``shipped-acc(...)``: the shipped tensor-memory kernel at each entry of
  its ``TMA_CONFIGS`` (one micro-batch), writing over the output and adding into it;
- ``pers(...)``: an experiment, a persistent tensor-memory kernel with and without Triton's
  automatic warp specialization (``-ws``: wrong results at some 4-warp tiles with Triton 3.6,
  and slower when adding into ``.grad``) and with the output's tiles through the copy engine
  (``-tmaepi``, shipped since session 28);
- ``cutlass-concat``: ``torch._grouped_mm`` over the rows of all micro-batches at once (no
  accumulation into ``.grad``: a bound, not a replacement).

  python tools/bench_wgrad_tiles.py                       # every case, every variant
  python tools/bench_wgrad_tiles.py --cases mixtral-gate_up-w1 --budget 120

JSON lines on stdout, then the best tile of each kernel per case. Needs a Hopper GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
import triton
import triton.language as tl

CASES = {  # name: (experts, N, K, rows per micro-batch, micro-batches)
    "qwen3-gate_up-w4": (128, 1536, 2048, 32768, 4),
    "mixtral-gate_up-w1": (8, 28672, 4096, 8192, 1),
    "qwen3-gate_up-1x4": (128, 1536, 2048, 131072, 1),
    "qwen3-down-w4": (128, 2048, 768, 32768, 4),
    "mixtral-down-w1": (8, 4096, 14336, 8192, 1),
    "olmoe-gate_up-w2": (64, 2048, 2048, 32768, 2),
    "olmoe-down-w2": (64, 2048, 1024, 32768, 2),
}
PTR = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
       (128, 256, 64, 8, 4), (256, 128, 64, 8, 4), (128, 128, 128, 8, 3), (256, 128, 128, 8, 2),
       (128, 256, 32, 8, 5), (256, 128, 32, 8, 5)]
"""(BLOCK_N, BLOCK_K, BLOCK_T, num_warps, num_stages) tried for the pointer kernel."""
TMA = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4),
       (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (128, 256, 128, 8, 2),
       (256, 128, 128, 8, 2), (128, 256, 32, 8, 6)]
PERSISTENT = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
              (128, 128, 64, 4, 4), (128, 128, 32, 4, 6), (128, 256, 32, 8, 6)]
"""Tile shapes for the persistent experiment (one micro-batch), each without and with Triton's
automatic warp specialization and with pointer or tensor-memory epilogues."""
IL = [(128, 256, 16, 8, 3), (128, 256, 16, 8, 4), (256, 128, 16, 8, 4), (128, 256, 32, 8, 2),
      (128, 128, 32, 8, 3), (128, 128, 32, 8, 4), (256, 128, 32, 8, 2), (128, 128, 16, 8, 5)]


# The two multi-micro-batch tensor-memory experiments (not shipped).
@triton.jit
def _descs(DY, X, OFFS, g, N, K, stride_dy, stride_x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_T: tl.constexpr):
    start = tl.load(OFFS + g - 1, mask=g > 0, other=0)
    rows = tl.load(OFFS + g) - start
    # An empty range gets a one-row descriptor read from row 1: zero-filled, like all rows past it.
    shape_rows = tl.maximum(rows, 1)
    dy = tl.make_tensor_descriptor(DY + start.to(tl.int64) * stride_dy, shape=[shape_rows, N],
                                   strides=[stride_dy, 1], block_shape=[BLOCK_T, BLOCK_N])
    x = tl.make_tensor_descriptor(X + start.to(tl.int64) * stride_x, shape=[shape_rows, K],
                                  strides=[stride_x, 1], block_shape=[BLOCK_T, BLOCK_K])
    return dy, x, rows, (rows == 0).to(tl.int32)

@triton.jit
def _store(acc, OUT, g, n0, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(OUT + g.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :], acc.to(OUT.dtype.element_ty),
             mask=(rn[:, None] < N) & (rk[None, :] < K))

@triton.jit
def per_source_loops(DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, OUT, N, K, stride_dy,
                     stride_x, SOURCES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    tile, g = tl.program_id(0), tl.program_id(1)
    n0, k0 = (tile // tl.cdiv(K, BLOCK_K)) * BLOCK_N, (tile % tl.cdiv(K, BLOCK_K)) * BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for s in tl.static_range(SOURCES):
        if s == 0:
            DY, X, OFFS = DY0, X0, OFFS0
        elif s == 1:
            DY, X, OFFS = DY1, X1, OFFS1
        elif s == 2:
            DY, X, OFFS = DY2, X2, OFFS2
        else:
            DY, X, OFFS = DY3, X3, OFFS3
        dy, x, rows, _ = _descs(DY, X, OFFS, g, N, K, stride_dy, stride_x, BLOCK_N, BLOCK_K, BLOCK_T)
        for t in range(0, rows, BLOCK_T):
            acc = tl.dot(dy.load([t, n0]).T, x.load([t, k0]), acc)
    _store(acc, OUT, g, n0, k0, N, K, BLOCK_N, BLOCK_K)

@triton.jit
def interleaved(DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, OUT, N, K, stride_dy,
                stride_x, SOURCES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_T: tl.constexpr):
    tile, g = tl.program_id(0), tl.program_id(1)
    n0, k0 = (tile // tl.cdiv(K, BLOCK_K)) * BLOCK_N, (tile % tl.cdiv(K, BLOCK_K)) * BLOCK_K
    d0, x0, rmax, z0 = _descs(DY0, X0, OFFS0, g, N, K, stride_dy, stride_x, BLOCK_N, BLOCK_K, BLOCK_T)
    if SOURCES > 1:
        d1, x1, r1, z1 = _descs(DY1, X1, OFFS1, g, N, K, stride_dy, stride_x, BLOCK_N, BLOCK_K, BLOCK_T)
        rmax = tl.maximum(rmax, r1)
    if SOURCES > 2:
        d2, x2, r2, z2 = _descs(DY2, X2, OFFS2, g, N, K, stride_dy, stride_x, BLOCK_N, BLOCK_K, BLOCK_T)
        rmax = tl.maximum(rmax, r2)
    if SOURCES > 3:
        d3, x3, r3, z3 = _descs(DY3, X3, OFFS3, g, N, K, stride_dy, stride_x, BLOCK_N, BLOCK_K, BLOCK_T)
        rmax = tl.maximum(rmax, r3)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in range(0, rmax, BLOCK_T):  # rows past a micro-batch's own are zero-filled
        acc = tl.dot(d0.load([t + z0, n0]).T, x0.load([t + z0, k0]), acc)
        if SOURCES > 1:
            acc = tl.dot(d1.load([t + z1, n0]).T, x1.load([t + z1, k0]), acc)
        if SOURCES > 2:
            acc = tl.dot(d2.load([t + z2, n0]).T, x2.load([t + z2, k0]), acc)
        if SOURCES > 3:
            acc = tl.dot(d3.load([t + z3, n0]).T, x3.load([t + z3, k0]), acc)
    _store(acc, OUT, g, n0, k0, N, K, BLOCK_N, BLOCK_K)


@triton.jit
def persistent(DY, X, OFFS, T, OUT, G, N, K, stride_dy, stride_x, ACCUMULATE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, PROGRAMS: tl.constexpr,
               WS: tl.constexpr, EPI_TMA: tl.constexpr):
    # One program per SM (or two) walks the output tiles expert-major; with WS Triton splits
    # the loads from the MMAs into warp groups, so a tile's epilogue overlaps the next's loads.
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_group = tl.cdiv(N, BLOCK_N) * tiles_k
    if EPI_TMA:  # needs N % BLOCK_N == 0 (a tile never crosses into the next expert)
        out = tl.make_tensor_descriptor(OUT, shape=[G * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    for tile in tl.range(tl.program_id(0), G * per_group, PROGRAMS, warp_specialize=WS):
        g = tile // per_group
        t = tile - g * per_group
        n0 = (t // tiles_k) * BLOCK_N
        k0 = (t % tiles_k) * BLOCK_K
        start = tl.minimum(tl.load(OFFS + g - 1, mask=g > 0, other=0), T)
        rows = tl.minimum(tl.load(OFFS + g), T) - start
        dy = tl.make_tensor_descriptor(DY + start.to(tl.int64) * stride_dy, shape=[tl.maximum(rows, 1), N],
                                       strides=[stride_dy, 1], block_shape=[BLOCK_T, BLOCK_N])
        x = tl.make_tensor_descriptor(X + start.to(tl.int64) * stride_x, shape=[tl.maximum(rows, 1), K],
                                      strides=[stride_x, 1], block_shape=[BLOCK_T, BLOCK_K])
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r in range(0, rows, BLOCK_T):
            acc = tl.dot(dy.load([r, n0]).T, x.load([r, k0]), acc)
        if EPI_TMA:
            if ACCUMULATE:
                acc += out.load([g * N + n0, k0]).to(tl.float32)
            out.store([g * N + n0, k0], acc.to(OUT.dtype.element_ty))
        else:
            rn = n0 + tl.arange(0, BLOCK_N)
            rk = k0 + tl.arange(0, BLOCK_K)
            off = g.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :]
            mask = (rn[:, None] < N) & (rk[None, :] < K)
            if ACCUMULATE:
                acc += tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT + off, acc.to(OUT.dtype.element_ty), mask=mask)


def _launch(kernel, dys, xs, offs, out, cfg) -> None:  # noqa: ANN001
    from polyaccel.cuda._triton import cdiv

    bn, bk, bt, warps, stages = cfg
    G, N, K = out.shape
    pad = lambda ts: list(ts) + [ts[0]] * (4 - len(ts))  # noqa: E731
    kernel[(cdiv(N, bn) * cdiv(K, bk), G)](*pad(dys), *pad(xs), *pad(offs), out, N, K, dys[0].stride(0),
                                           xs[0].stride(0), SOURCES=len(dys), BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt,
                                           num_warps=warps, num_stages=stages)


def run_case(name: str, only: str | None = None) -> list[dict]:
    from triton.testing import do_bench

    from polyaccel.cuda import grouped_wgrad as gw

    G, N, K, R, S = CASES[name]
    top_k = 8 if G >= 64 else 2
    dev, bf = "cuda", torch.bfloat16
    offs = [torch.bincount(torch.rand(R // top_k, G, device=dev).argsort(-1)[:, :top_k].flatten(), minlength=G)
            .cumsum(0).to(torch.int32) for _ in range(S)]
    dys = [torch.randn(R, N, device=dev, dtype=bf) for _ in range(S)]
    xs = [torch.randn(R, K, device=dev, dtype=bf) for _ in range(S)]
    ref = sum(torch._grouped_mm(d.t(), x, offs=o).float() for d, x, o in zip(dys, xs, offs, strict=True))
    out = torch.empty(G, N, K, device=dev, dtype=bf)
    flop = 2 * S * R * N * K
    rows = []

    def record(variant: str, fn, check: bool = True) -> None:  # noqa: ANN001
        rec = {"case": name, "variant": variant}
        if only and not re.search(only, variant):
            return
        try:
            fn()
            torch.cuda.synchronize()
            if check:
                rec["rel_err"] = round(((out.float() - ref).norm() / ref.norm()).item(), 5)
            ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
            rec |= {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)}
        except Exception as e:  # noqa: BLE001  (a tile that does not compile: reported, not fatal)
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(rec)
        print(json.dumps(rec), flush=True)

    record("prod", lambda: gw.grouped_mm_wgrad(dys, xs, offs, out=out, accumulate=False))
    # Adding into .grad, as every micro-batch after the first does: the tile read after the main
    # loop (shipped) or before it (GRAD_FIRST). Repeated calls keep adding, so not checked here
    # (the interpreter and GPU tests check both).
    def with_flag(flag: str, value: bool, accumulate: bool):  # noqa: ANN202
        """grouped_mm_wgrad as shipped, with ``gw.<flag>`` set to ``value`` while it runs."""
        def run():
            saved = getattr(gw, flag)
            setattr(gw, flag, value)
            try:
                gw.grouped_mm_wgrad(dys, xs, offs, out=out, accumulate=accumulate)
            finally:
                setattr(gw, flag, saved)
        return run

    for grad_first in (False, True):
        out.zero_()
        record("prod-acc-grad-first" if grad_first else "prod-acc", with_flag("GRAD_FIRST", grad_first, True),
               check=False)
    dy_all, x_all = torch.cat(dys), torch.cat(xs)
    all_offs = sum(o.diff(prepend=o.new_zeros(1)) for o in offs).cumsum(0).to(torch.int32)
    record("cutlass-concat", lambda d=dy_all, x=x_all: torch._grouped_mm(d.t(), x, offs=all_offs), check=False)
    del dy_all, x_all
    plain, _ = gw._kernel()
    counts = [min(d.shape[0], x.shape[0]) for d, x in zip(dys, xs, strict=True)]
    pad = lambda ts: list(ts) + [ts[0]] * (4 - len(ts))  # noqa: E731
    no_sums = torch.zeros(1, device=dev)  # (SQUARES off: never written)
    for cfg in PTR:
        bn, bk, bt, warps, stages = cfg
        record(f"ptr{cfg}", lambda bn=bn, bk=bk, bt=bt, w=warps, st=stages: plain[
            (-(-N // bn) * -(-K // bk), G)](*pad(dys), *pad(xs), *pad(offs), *pad(counts), out, N, K,
                                            gw._rows_key(S * R), dys[0].stride(0), xs[0].stride(0), no_sums,
                                            SOURCES=S, ACCUMULATE=False, GRAD_FIRST=False, SQUARES=False, BLOCK_N=bn,
                                            BLOCK_K=bk, BLOCK_T=bt, num_warps=w, num_stages=st))
    # The pointer kernel's persistent launch: as it would ship (autotuned), then at each entry.
    for acc in (False, True):
        out.zero_()
        record(f"prod-persistent{'-acc' if acc else ''}", with_flag("PERSISTENT", True, acc), check=not acc)
    flags = dict(SOURCES=S, ACCUMULATE=False, GRAD_FIRST=False, SQUARES=False)
    for cfg in gw.PERSISTENT_CONFIGS:
        record(f"ptr-pers{cfg}", lambda cfg=cfg: gw._launch_persistent(
            (*pad(dys), *pad(xs), *pad(offs), *pad(counts)), out, gw._rows_key(S * R), dys[0].stride(0),
            xs[0].stride(0), flags, None, config=cfg))
    gw._ensure_scratch_allocator()
    for cfg in gw.TMA_CONFIGS if S == 1 else []:
        for acc in (False, True):
            out.zero_()
            record(f"shipped{'-acc' if acc else ''}{cfg}", lambda cfg=cfg, acc=acc: gw._launch_tma(
                dys[0], xs[0], offs[0], out, accumulate=acc, config=cfg), check=not acc)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for cfg in PERSISTENT if S == 1 else []:
        bn, bk, bt, warps, stages = cfg
        per_sm = 2 if warps == 4 else 1
        for ws in (False, True):
            for epi_tma in (False, True):
                for acc in (False, True):
                    out.zero_()
                    tiles = G * -(-N // bn) * -(-K // bk)
                    programs = min(tiles, sms * per_sm)
                    variant = f"pers{'-ws' if ws else ''}{'-tmaepi' if epi_tma else ''}{'-acc' if acc else ''}{cfg}"
                    record(variant, lambda bn=bn, bk=bk, bt=bt, w=warps, st=stages, acc=acc, ws=ws, e=epi_tma, p=programs:
                           persistent[(p,)](dys[0], xs[0], offs[0], counts[0], out, G, N, K, dys[0].stride(0),
                                            xs[0].stride(0), ACCUMULATE=acc, BLOCK_N=bn, BLOCK_K=bk, BLOCK_T=bt,
                                            PROGRAMS=p, WS=ws, EPI_TMA=e, num_warps=w, num_stages=st),
                           check=not acc)
    for family, kernel, cfgs in (("tma", per_source_loops, TMA), ("il", interleaved, IL if S > 1 else [])):
        for cfg in cfgs:
            record(f"{family}{cfg}", lambda k=kernel, c=cfg: _launch(k, dys, xs, offs, out, c))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--budget", type=float, default=600, help="seconds; no case starts after them")
    p.add_argument("--only", help="run only the variants whose name this regular expression finds")
    a = p.parse_args(argv)
    from polyaccel.core import select_backend

    select_backend("cuda")
    torch.manual_seed(0)
    t0, rows = time.time(), []
    for name in a.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
        if time.time() - t0 > a.budget:
            print(f"budget spent: {name} and later cases not run", flush=True)
            break
        rows += run_case(name, a.only)
        torch.cuda.empty_cache()
    print("best tile per kernel and case (TFLOP/s):")
    for case in dict.fromkeys(r["case"] for r in rows):
        for family in ("prod", "prod-acc", "prod-persistent", "prod-persistent-acc", "cutlass", "ptr(", "ptr-pers",
                       "tma", "il", "shipped(", "shipped-acc", "pers(",
                       "pers-acc", "pers-tmaepi(", "pers-tmaepi-acc", "pers-ws(", "pers-ws-acc", "pers-ws-tmaepi(",
                       "pers-ws-tmaepi-acc"):
            mine = [r for r in rows if r["case"] == case and r["variant"].startswith(family) and "tflops" in r
                    and (not family.startswith("prod") or r["variant"] == family)]
            if mine:
                best = max(mine, key=lambda r: r["tflops"])
                print(f"  {case:<20} {best['variant']:<28} {best['tflops']:>7}")


if __name__ == "__main__":
    main()
