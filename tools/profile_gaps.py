"""How much of a profiled call the GPU worked, for the benchmarks' ``--profile`` rows
(``tools/bench_asr.py``, ``tools/bench_moe_users.py``)."""

from __future__ import annotations


def gpu_busy(kernels, top: int = 6) -> dict:
    """How much of a profiled call the GPU worked: the union of the kernels' (and copies')
    intervals, and the longest idle gaps between them, each with its start (ms from the first
    kernel) and length, so host-side time on the critical path shows up."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    if not spans:
        return {}
    busy, gaps, (s0, end) = 0.0, [], spans[0]
    start = s0
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            gaps.append((round((end - s0) / 1e3, 2), round((s - end) / 1e3, 3)))
            start = s
        end = max(end, e)
    busy += end - start
    sizes = {"<5us": 5, "5-20us": 20, "20-50us": 50, "50-200us": 200, ">=200us": float("inf")}
    hist, low = {}, 0.0
    for name, high in sizes.items():  # gaps of each size: count and total ms
        inside = [g for _, g in gaps if low <= g * 1e3 < high]
        hist[name] = [len(inside), round(sum(inside), 3)]
        low = high
    return {"span_ms": round((end - s0) / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "longest_gaps_ms": sorted(gaps, key=lambda g: -g[1])[:top], "gaps": hist}
