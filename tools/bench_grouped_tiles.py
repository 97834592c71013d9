"""CUTLASS's two grouped-GEMM tiles on routed tokens: does the small one win when experts are uneven?

``torch._grouped_mm`` (the expert forward and input-gradient GEMMs, ours and Transformers')
picks its tile on Hopper from the rows per expert *on average*, ``rows // groups``: the small
tile (64 x 128, ping-pong) at 128 or fewer, else the large one (128 x 256, cooperative).
Routed tokens are uneven, and an expert with 257 rows fills three 128-row tiles. This forces
the small tile without copying anything: expert ``g`` becomes group ``s * g`` of a view whose
group stride is ``1/s`` of the weights' (the views overlap), and the groups between get no rows,
so ``rows // groups`` falls to 128. For each expert GEMM and each routing (``balanced``: every
expert the average; ``mild``: 0.7-1.3x it, as a trained router; ``learned``: 40% of the
experts get none and the rest are skewed, as a random-init router gives) it checks that both
tiles give the same bits, then times the forward (``x @ W[g]``) and the input gradient
(``dy @ W[g].T``) with each. ``--triton`` also checks and times polyaccel's Triton grouped GEMM
(:mod:`polyaccel.cuda.grouped_gemm`, tiles from each expert's first row), autotuned
(``triton``) and at each of its tiles (``triton-M-P-R-warps-stages-perSM``).

  python tools/bench_grouped_tiles.py                                  # every case
  python tools/bench_grouped_tiles.py --device cpu --scale 64 --reps 1  # dry run (no timing meaning)

JSON lines on stdout (TFLOP/s per variant).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CASES = {  # name: (experts, rows = tokens x top-k, K, N)
    "qwen3-gate_up": (128, 32768, 2048, 1536),
    "qwen3-down": (128, 32768, 768, 2048),
    "olmoe-gate_up": (64, 32768, 2048, 2048),
    "olmoe-down": (64, 32768, 1024, 2048),
}
ROUTINGS = ("balanced", "mild", "learned")
SMALL_TILE_ROWS = 128


def routed_counts(routing: str, experts: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert summing to ``rows``."""
    if routing == "balanced":
        weight = torch.ones(experts)
    elif routing == "mild":
        weight = torch.rand(experts, generator=gen) * 0.6 + 0.7
    elif routing == "learned":
        weight = torch.distributions.Gamma(0.7, 1.0).sample((experts,))
        weight[torch.randperm(experts, generator=gen)[: int(0.4 * experts)]] = 0
    else:
        raise ValueError(f"unknown routing {routing!r}: one of {ROUTINGS}")
    counts = (weight / weight.sum() * rows).floor().long()
    counts[int(weight.argmax())] += rows - int(counts.sum())
    return counts


def spread(b: torch.Tensor, offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(b, offsets)`` with empty groups between the experts so that ``rows // groups`` is at
    most :data:`SMALL_TILE_ROWS`; None where the weights' group stride does not divide."""
    experts = b.shape[0]
    s = 1
    while rows // (s * (experts - 1) + 1) > SMALL_TILE_ROWS:
        s *= 2  # (a power of two divides the weights' group stride)
    if b.stride(0) % s or (b.stride(0) // s * b.element_size()) % 16:
        return None
    view = b.as_strided((s * (experts - 1) + 1, *b.shape[1:]), (b.stride(0) // s, *b.stride()[1:]))
    return view, torch.cat([offsets[:-1, None].expand(experts - 1, s).reshape(-1), offsets[-1:]])


def timed_ms(fn, device: str, reps: int) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def run_case(name: str, experts: int, rows: int, k: int, n: int, a: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)  # (the Gamma draws of the learned routing use the global generator)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=gen).to(a.device, torch.bfloat16)
    dy = torch.randn(rows, n, generator=gen).to(a.device, torch.bfloat16)
    w = (torch.randn(experts, n, k, generator=gen) * 0.02).to(a.device, torch.bfloat16)  # F.linear layout
    out = []
    for routing in ROUTINGS:
        counts = routed_counts(routing, experts, rows, gen)
        offsets = torch.cumsum(counts, 0).to(torch.int32).to(a.device)
        row = {"case": name, "routing": routing, "experts": experts, "rows": rows, "K": k, "N": n,
               "empty_experts": int((counts == 0).sum()), "device": a.device}
        flop = 2 * rows * k * n
        for what, lhs, b in (("fwd", x, w.transpose(-2, -1)), ("dgrad", dy, w)):
            spread_b = spread(b, offsets, rows)
            if spread_b is None:
                row[f"{what}_small_tile"] = "stride does not divide"
                continue
            view, spread_offsets = spread_b
            row[f"{what}_equal"] = torch.equal(torch._grouped_mm(lhs, b, offs=offsets),
                                               torch._grouped_mm(lhs, view, offs=spread_offsets))
            row["groups_small_tile"] = view.shape[0]
            for tile, args in (("large", (lhs, b, offsets)), ("small", (lhs, view, spread_offsets))):
                ms = timed_ms(lambda args=args: torch._grouped_mm(args[0], args[1], offs=args[2]), a.device, a.reps)
                row[f"{what}_{tile}_tflops"] = round(flop / ms / 1e9, 1)
            if a.triton:
                time_triton(row, what, lhs, b.transpose(-2, -1), offsets, torch._grouped_mm(lhs, b, offs=offsets),
                            flop, a)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def time_triton(row: dict, what: str, lhs: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                cutlass: torch.Tensor, flop: int, a: argparse.Namespace) -> None:
    """Check polyaccel's Triton grouped GEMM (``lhs @ w[g].T``) against CUTLASS's output and
    time it autotuned and at each of its tiles, into ``row``."""
    from polyaccel.cuda import grouped_gemm

    if not grouped_gemm.takes_triton(lhs, w):
        row[f"{what}_triton"] = "not taken"
        return
    variants = {"triton": None} if a.device == "cuda" else {}
    variants.update({"triton-" + "-".join(map(str, c)): c for c in grouped_gemm.CONFIGS})
    for name, config in variants.items():
        try:
            got = grouped_gemm.grouped_mm(lhs, w, offsets, config=config)
        except Exception as e:  # noqa: BLE001  (a tile that does not compile here: say so, go on)
            row[f"{what}_{name}"] = f"{type(e).__name__}: {str(e)[:80]}"
            continue
        err = ((got.float() - cutlass.float()).norm() / cutlass.float().norm().clamp_min(1e-30)).item()
        row[f"{what}_{name}_rel_err"] = float(f"{err:.2e}")
        ms = timed_ms(lambda config=config: grouped_gemm.grouped_mm(lhs, w, offsets, config=config), a.device, a.reps)
        row[f"{what}_{name}_tflops"] = round(flop / ms / 1e9, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--scale", type=int, default=1, help="divide K and N by this (dry runs; the rows stay)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--triton", action="store_true", help="also check and time polyaccel's Triton grouped GEMM")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu --scale 64 for a dry run)")
    for name in a.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}: one of {', '.join(CASES)}")
        experts, rows, k, n = CASES[name]
        k, n = (-(-max(8, d // a.scale) // 8) * 8 for d in (k, n))  # 16-byte rows, as the GEMM needs
        run_case(name, experts, rows, k, n, a)


if __name__ == "__main__":
    main()
