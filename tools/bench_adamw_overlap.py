"""How much of the AdamW step could hide under the next step's first forward + backward.

The fused AdamW pass moves ~14 bytes per bf16 parameter at the memory's rate (24.8 ms of a
216 ms step for qwen3-30b-a3b-L8 in session 11's profile, 21 ms of 366 for Mixtral's). The next
step's forward needs layer ``i``'s new weights only when it reaches layer ``i``, and its GEMMs
leave the memory mostly idle: the step could be split per layer and run on a side stream, each
layer's forward waiting for its own part alone. Before building that into FlatAdamW and the
graphed micro-step, this measures it, eagerly, on a preset's model (our default model, layers
not compiled: hooks wait on events between layers):

- ``adamw``: the AdamW pass alone (one kernel per contiguous part of the flat buffer);
- ``micro_batch``: one forward + backward alone;
- ``sequential``: the AdamW pass, then the forward + backward (what a step does today);
- ``overlapped``: the AdamW pass split per layer on a side stream (embedding first, then
  each decoder layer, then the final norm and LM head), the forward waiting per layer.

``hidden`` = (sequential - overlapped) / adamw: the share of the AdamW pass that overlapping
hides. The overlapped parameters are checked against the sequential ones (same start, same
gradients): the split must not change the update.

  python tools/bench_adamw_overlap.py --shape qwen3-30b-a3b-L8
  python tools/bench_adamw_overlap.py --shape mixtral-8x7b-L4
  python tools/bench_adamw_overlap.py --shape qwen3-moe-tiny --device cpu --seq 64  # dry run

One JSON line on stdout. Needs a CUDA device for the streams (on CPU both orders run one after
the other: a dry run of the code, not a measurement).
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

HYPER = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def layer_ranges(model: torch.nn.Module, flat) -> list[tuple[torch.nn.Module | None, list[slice]]]:  # noqa: ANN001
    """The flat buffer's index ranges in forward order: (module whose forward waits, ranges).
    The embedding's part first, then each decoder layer's, then what is left (norm, LM head:
    waited for by the model's last norm)."""
    inner = model.model
    groups = [(inner.embed_tokens, list(inner.embed_tokens.parameters()))]
    groups += [(layer, list(layer.parameters())) for layer in inner.layers]
    seen = {id(p) for _, ps in groups for p in ps}
    groups.append((inner.norm, [p for p in model.parameters() if id(p) not in seen]))
    out = []
    for module, params in groups:
        spans = sorted((flat.offsets[flat.index[p]], flat.offsets[flat.index[p]] + p.numel()) for p in params)
        merged: list[list[int]] = []
        for a, b in spans:  # contiguous spans merge (alignment gaps between views included)
            if merged and a - merged[-1][1] < 64:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out.append((module, [slice(a, b) for a, b in merged]))
    return out


def adamw(flat, part: slice, step: int) -> None:  # noqa: ANN001
    from polyaccel.core import ops

    ops.adamw_step_(flat.param[part], flat.grad[part], flat.exp_avg[part], flat.exp_avg_sq[part], step=step,
                    zero_grad=True, **HYPER)


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
    opt = FlatAdamW(model.parameters(), **{"lr": HYPER["lr"], "weight_decay": HYPER["weight_decay"]})
    (flat,) = opt._flats[0]
    ranges = layer_ranges(model, flat)
    covered = sum(s.stop - s.start for _, parts in ranges for s in parts)
    ids = torch.randint(0, config.vocab_size, (1, a.seq), device=dev)
    side = torch.cuda.Stream() if dev.type == "cuda" else None
    events: dict[int, object] = {}

    def wait_for(module):  # noqa: ANN001, ANN202
        def hook(mod, args):  # noqa: ANN001, ANN202, ARG001
            ev = events.pop(id(module), None)
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
        return hook

    handles = [m.register_forward_pre_hook(wait_for(m)) for m, _ in ranges]
    # The final norm runs after the last layer; the LM head after it: waiting before the norm
    # covers the head too.

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fill_grads(seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        for grad in flat.grads:  # the views only: the alignment gaps between them stay zero
            grad.normal_(0.0, 1e-3, generator=g)

    def micro_batch() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def whole_adamw(step: int) -> None:
        for part in (slice(0, flat.param.numel()),):
            adamw(flat, part, step)

    def overlapped(step: int) -> None:
        if side is None:
            whole_adamw(step)
            micro_batch()
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for module, parts in ranges:
                for part in parts:
                    adamw(flat, part, step)
                ev = torch.cuda.Event()
                ev.record(side)
                events[id(module)] = ev
        micro_batch()
        torch.cuda.current_stream().wait_stream(side)

    def timed(fn, seed: int) -> float:  # noqa: ANN001
        fill_grads(seed)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    # The split must not change the update: same start, same gradients, both orders.
    start = flat.param.clone(), flat.exp_avg.clone(), flat.exp_avg_sq.clone()
    fill_grads(1)
    whole_adamw(1)
    after_whole = flat.param.clone()
    flat.param.copy_(start[0]), flat.exp_avg.copy_(start[1]), flat.exp_avg_sq.copy_(start[2])
    fill_grads(1)
    if side is not None:
        with torch.cuda.stream(side):
            for _, parts in ranges:
                for part in parts:
                    adamw(flat, part, 1)
        torch.cuda.current_stream().wait_stream(side)
    else:
        for _, parts in ranges:
            for part in parts:
                adamw(flat, part, 1)
    sync()
    same = bool(torch.equal(flat.param, after_whole))
    del start, after_whole

    rows: dict[str, list[float]] = {k: [] for k in ("adamw", "micro_batch", "sequential", "overlapped")}
    for rep in range(2 + a.reps):
        step = rep + 2
        times = {
            "adamw": timed(lambda s=step: whole_adamw(s), rep),
            "micro_batch": timed(micro_batch, rep),
            "sequential": timed(lambda s=step: (whole_adamw(s), micro_batch()), rep),
            "overlapped": timed(lambda s=step: overlapped(s), rep),
        }
        if rep >= 2:
            for k, v in times.items():
                rows[k].append(v)
    for h in handles:
        h.remove()
    ms = {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items()}
    rec = {"shape": a.shape, "seq": a.seq, "device": a.device, "params": flat.param.numel(),
           "params_covered": covered, "split_update_equal": same, **{f"{k}_ms": v for k, v in ms.items()},
           "hidden": round((ms["sequential"] - ms["overlapped"]) / ms["adamw"], 3) if ms["adamw"] else None,
           "torch": torch.__version__}
    print(json.dumps(rec), flush=True)
    return 0 if same and covered >= sum(q.numel() for q in flat.params) else 1


if __name__ == "__main__":
    raise SystemExit(main())
