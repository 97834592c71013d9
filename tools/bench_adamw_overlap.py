"""How much of the AdamW step hides under the next step's first forward + backward.

The fused AdamW pass moves ~14 bytes per bf16 parameter at the memory's rate (24.8 ms of a
216 ms step for qwen3-30b-a3b-L8 in session 11's profile, 21 ms of 366 for Mixtral's). With
``FlatAdamW(..., defer_to=model)`` (:mod:`polyaccel.moe.deferred_step`) the next forward applies
the step module by module on a side stream, each layer waiting only for its own part. This
times it eagerly on a preset's model (layers not compiled), one FlatAdamW with ``defer_to``:

- ``adamw``: ``step()`` then ``flush()``: the whole pass in line, alone;
- ``micro_batch``: one forward + backward alone;
- ``sequential``: the pass in line, then the forward + backward (what a step does without it);
- ``overlapped``: ``step()``, then the forward + backward, which applies it beside itself.

``hidden`` = (sequential - overlapped) / adamw: the share of the pass that overlapping hides.
From the same start and gradients, the overlapped weights must equal the in-line ones.

  python tools/bench_adamw_overlap.py --shape qwen3-30b-a3b-L8
  python tools/bench_adamw_overlap.py --shape mixtral-8x7b-L4
  python tools/bench_adamw_overlap.py --shape qwen3-moe-tiny --device cpu --seq 64  # dry run

One JSON line on stdout; exit status 1 when the weights differ. Needs a CUDA device for the
side stream (on CPU the parts run in line before the forward: a dry run, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shape", default="qwen3-30b-a3b-L8", help="a polyaccel-moe preset")
    p.add_argument("--layers", type=int, help="override the preset's depth")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (after 2 warm-up ones)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args(argv)

    from bench_moe_users import shape_config

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, FlatAdamW

    config = shape_config(a.shape, a.layers)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.apply_backend(BackendConfig(compile=False))
    model.train()
    opt = FlatAdamW(model.parameters(), lr=1e-5, weight_decay=0.01, defer_to=model)
    flats = [flat for group in opt._flats for flat in group]
    ids = torch.randint(0, config.vocab_size, (1, a.seq), device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fill_grads(seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        for flat in flats:
            for grad in flat.grads:  # the views only: the alignment gaps between them stay zero
                grad.normal_(0.0, 1e-3, generator=g)

    def micro_batch() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def in_line() -> None:
        opt.step()
        opt.flush()

    def overlapped() -> None:
        opt.step()
        micro_batch()
        opt.flush()  # (the side stream joined: nothing left to apply)

    def timed(fn, seed: int) -> float:  # noqa: ANN001
        fill_grads(seed)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    # The same start and gradients both ways: the weights after the step must be equal.
    start = [(f.param.clone(), f.exp_avg.clone(), f.exp_avg_sq.clone()) for f in flats]
    steps = [float(s["step"]) for s in opt.state.values()]

    def restore() -> None:
        for f, (p0, m0, v0) in zip(flats, start, strict=True):
            f.param.copy_(p0), f.exp_avg.copy_(m0), f.exp_avg_sq.copy_(v0)
        for s, n in zip(opt.state.values(), steps, strict=True):
            s["step"].fill_(n)

    fill_grads(1)
    in_line()
    want = [f.param.clone() for f in flats]
    restore()
    fill_grads(1)
    opt.step()
    with torch.no_grad():
        model(input_ids=ids[:, :8])  # a forward applies it
    opt.flush()
    sync()
    same = all(torch.equal(f.param, w) for f, w in zip(flats, want, strict=True))
    restore()
    start.clear(), want.clear()  # (a copy of every parameter and moment: memory the timing needs)

    rows: dict[str, list[float]] = {k: [] for k in ("adamw", "micro_batch", "sequential", "overlapped")}
    for rep in range(2 + a.reps):
        times = {"adamw": timed(in_line, rep), "micro_batch": timed(micro_batch, rep),
                 "sequential": timed(lambda: (in_line(), micro_batch()), rep),
                 "overlapped": timed(overlapped, rep)}
        if rep >= 2:
            for k, v in times.items():
                rows[k].append(v)
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items()}
    rec = {"shape": a.shape, "seq": a.seq, "device": a.device, "params": sum(f.param.numel() for f in flats),
           "overlapped_weights_equal": same, **{f"{k}_ms": v for k, v in ms.items()},
           "hidden": round((ms["sequential"] - ms["overlapped"]) / ms["adamw"], 3) if ms["adamw"] else None,
           "torch": torch.__version__}
    print(json.dumps(rec), flush=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
