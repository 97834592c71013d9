"""Causal self-attention, forward and forward+backward, per implementation: checked, then timed.

Implementations (each where it runs):

- ``sdpa``: ``F.scaled_dot_product_attention`` with ``enable_gqa``, PyTorch picking the kernel
  (what ``BackendConfig(attn="sdpa")`` runs, and ``attn="auto"``'s alternative);
- ``sdpa-cudnn``: forced to cuDNN, K/V repeated for GQA (what ``attn="cudnn"`` runs);
- ``sdpa-flash``: forced to PyTorch's flash kernel, ``enable_gqa=True``;
- ``fa4``: core's ``causal_attention`` op as the cuda backend registers it (FlashAttention-4's
  CuTe kernels, package ``flash-attn-4``, on [B, S, H, D] with GQA in the kernel);
- ``fa4-direct``: ``flash_attn.cute.interface.flash_attn_func`` called as is.

Each variant is first checked against fp32 math attention on the same random inputs (output
and the three input gradients, relative error), then timed: device time per call, the device
held back by a sleep until the host has queued every timed call, so the host's own time per
call (large for kernels launched from Python, gone once a step is replayed as a CUDA graph) is
not counted; median of 5 runs of ``--iters`` calls. One JSON line per (shape, variant)::

    python tools/bench_attention.py --shapes qwen3,mixtral,olmoe --seq 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPES = {  # name: (query heads, key/value heads, head dim)
    "qwen3": (32, 4, 128),
    "mixtral": (32, 8, 128),
    "olmoe": (16, 16, 128),
    "deepseek-v3-like": (16, 16, 192),
}


def reference(q, k, v, scale):  # noqa: ANN001, ANN201
    """fp32 math attention on [B, S, H, D] inputs (GQA by repetition)."""
    import torch

    rep = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).transpose(1, 2)


def variant(name: str):  # noqa: ANN201
    """``fn(q, k, v, scale) -> out`` on [B, S, H, D] tensors, or None where it cannot run."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "sdpa":
        def fn(q, k, v, scale):  # noqa: ANN001, ANN202
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale,
                                                  enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        return fn
    if name == "sdpa-cudnn":
        def fn(q, k, v, scale):  # noqa: ANN001, ANN202
            rep = q.shape[2] // k.shape[2]
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
            if rep > 1:
                k_, v_ = k_.repeat_interleave(rep, dim=1), v_.repeat_interleave(rep, dim=1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale).transpose(1, 2)
        return fn
    if name == "sdpa-flash":
        def fn(q, k, v, scale):  # noqa: ANN001, ANN202
            q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale,
                                                      enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
        return fn
    if name == "fa4-direct":
        try:
            from flash_attn.cute.interface import flash_attn_func
        except ImportError as e:
            print(f"fa4-direct: {type(e).__name__}: {e}", file=sys.stderr)
            return None

        def fn(q, k, v, scale):  # noqa: ANN001, ANN202
            out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
            return out[0] if isinstance(out, tuple) else out
        return fn
    if name == "fa4":
        from polyaccel.core import ops, select_backend
        from polyaccel.core.kernels import registry

        select_backend("cuda")
        if "cuda" not in registry.implementations("causal_attention"):
            print("fa4: the cuda backend registered no causal_attention (flash-attn-4 not installed)", file=sys.stderr)
            return None

        def fn(q, k, v, scale):  # noqa: ANN001, ANN202
            return ops.causal_attention(q, k, v, scale)
        return fn
    raise SystemExit(f"unknown variant {name!r}")


def time_ms(fn, warmup: int, iters: int, repeats: int = 5) -> float:  # noqa: ANN001
    """Device milliseconds per call of ``fn`` (see the module docstring), median of ``repeats``."""
    from polyaccel.moe.attention_choice import device_time_ms

    for _ in range(warmup):
        fn()
    return statistics.median(device_time_ms(fn, iters) for _ in range(repeats))


def run(shape: str, seq: int, name: str, a) -> dict:  # noqa: ANN001
    import torch

    nh, nkv, d = SHAPES[shape]
    rec = {"shape": shape, "heads": nh, "kv_heads": nkv, "head_dim": d, "seq": seq, "batch": a.batch, "variant": name}
    fn = variant(name)
    if fn is None:
        return {**rec, "error": "not available here"}
    torch.manual_seed(0)
    mk = lambda h: torch.randn(a.batch, seq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    q, k, v = mk(nh), mk(nkv), mk(nkv)
    scale = d ** -0.5
    t0 = time.perf_counter()
    out = fn(q, k, v, scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    rec["first_call_s"] = round(time.perf_counter() - t0, 2)
    ref = reference(q, k, v, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    rel = lambda x, y: float((x.detach().float() - y).norm() / y.norm())  # noqa: E731
    rec["rel_err"] = {"out": rel(out, ref), **{f"d{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads, strict=True)}}
    rec["ok"] = all(e < a.tol for e in rec["rel_err"].values())
    del ref, ref_grads
    flops_fwd = 4 * a.batch * nh * seq * seq * d / 2  # causal: half the score matrix
    fwd = time_ms(lambda: fn(q, k, v, scale), a.warmup, a.iters)
    both = time_ms(lambda: torch.autograd.grad(fn(q, k, v, scale), (q, k, v), dout), a.warmup, a.iters)
    rec.update(fwd_ms=round(fwd, 3), bwd_ms=round(both - fwd, 3), fwd_bwd_ms=round(both, 3),
               fwd_tflops=round(flops_fwd / fwd / 1e9, 1), bwd_tflops=round(2.5 * flops_fwd / (both - fwd) / 1e9, 1))
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3,mixtral,olmoe", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--seq", default="4096", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--variants", default="sdpa,sdpa-cudnn,fa4")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tol", type=float, default=2e-2, help="largest relative error against fp32 math")
    p.add_argument("--out", help="also append the JSON lines here")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA device", file=sys.stderr)
        return 2
    bad = [s for s in a.shapes.split(",") if s not in SHAPES]
    if bad:
        p.error(f"unknown shape {bad[0]!r}; known: {', '.join(SHAPES)}")
    failed = False
    for shape in a.shapes.split(","):
        for seq in (int(s) for s in a.seq.split(",")):
            for name in a.variants.split(","):
                try:
                    rec = run(shape, seq, name, a)
                except Exception as e:  # noqa: BLE001  (one variant's failure is that row's result)
                    rec = {"shape": shape, "seq": seq, "variant": name, "error": f"{type(e).__name__}: {e}"[:2000]}
                failed |= rec.get("ok") is False
                line = json.dumps(rec)
                print(line, flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(line + "\n")
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
