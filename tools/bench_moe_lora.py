"""LoRA fine-tuning throughput (issue 12): polyaccel's expert LoRA beside Transformers + PEFT.

Run through ``tools/bench_moe.py --lora`` (or directly). Workload: Qwen3-30B-A3B shapes with
the row's layer count, random init, bf16 frozen base, ``--accum`` micro-batches of ``--mbs`` x
``--seq`` synthetic tokens, LoRA r=16 alpha=32 on q/k/v/o and on the fused experts
(PEFT ``target_parameters``), adapters in fp32, fused AdamW over the adapters only.
Each row runs in its own process; one JSON line per row (tokens/s, peak GiB), then a table.

  python tools/bench_moe.py --lora                                  # the default rows below
  python tools/bench_moe.py --lora --rows hf-peft@24,ours-compile@24
  python tools/bench_moe.py --lora --tiny --steps 1 --warmup 1      # CPU dry run, seconds

Rows are ``variant@layers``; variants: ``hf-peft`` (Transformers v5, grouped_mm experts, sdpa,
PEFT materializing ``W + B·A``), ``ours`` / ``ours-compile`` (polyaccel, PEFT's adapters
computed in the grouped expert path), ``-selective`` (selective recomputation), ``-auto``
(``recompute="auto"``: selective only where the memory estimate says it is needed),
``-graphed`` (the micro-step as a :class:`polyaccel.moe.GraphedMicroStep`, CUDA only).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

DEFAULT_ROWS = "hf-peft@24,ours-compile-graphed@24,ours-compile@24,hf-peft@48,ours-compile-graphed@48"
LORA = dict(r=16, alpha=32)


def _config(layers: int, tiny: bool):
    from polyaccel.moe import presets

    if tiny:
        return presets.tiny("qwen3_moe", num_hidden_layers=layers, mlp_only_layers=[], vocab_size=512,
                            hidden_size=64, moe_intermediate_size=32, max_position_embeddings=512)
    return presets.qwen3_30b_a3b(num_hidden_layers=layers, router_aux_loss_coef=0.001)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _recompute(variant: str) -> str:
    return next((r for r in ("selective", "auto") if variant.endswith("-" + r)), "none")


def build(variant: str, cfg, device: torch.device, seq: int = 4096, mbs: int = 1):
    """(the base model of ``variant`` in bf16 on ``device`` with PEFT adapters, the recompute
    mode it runs); ``seq``/``mbs``: the training shape, for ``-auto``'s memory estimate."""
    from polyaccel.moe import lora

    torch.manual_seed(0)
    settings = lora.LoraSettings(**LORA, recompute=_recompute(variant))
    if variant.startswith("hf"):
        from transformers import Qwen3MoeForCausalLM

        cfg._attn_implementation = "sdpa"
        with device:
            model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
        model.set_experts_implementation("grouped_mm" if device.type == "cuda" else "eager")
        settings = lora.resolve_recompute_for(model, settings, seq, mbs)
        model = lora.require_peft().get_peft_model(model, settings.peft_config())
        if settings.recompute == "selective":
            lora.enable_selective_recompute(model)
    else:
        from polyaccel.moe import AutoModelForCausalLM, BackendConfig

        backend = BackendConfig(experts="grouped_mm", loss="fused", rms_norm="fused", gate="learned",
                                compile="compile" in variant)
        with device:
            model = AutoModelForCausalLM.from_config(cfg, backend=backend, dtype=torch.bfloat16)
        model = model.to(device)
        settings = lora.resolve_recompute_for(model, settings, seq, mbs)
        model = lora.apply_lora(model, settings)
    return model.train(), settings.recompute


def run_row(variant: str, layers: int, a) -> dict:  # noqa: ANN001
    """Time one row in this process; returns its JSON record."""
    from polyaccel.core import select_backend

    device = _device()
    select_backend("auto")
    cfg = _config(layers, a.tiny)
    t0 = time.perf_counter()
    model, recompute = build(variant, cfg, device, a.seq, a.mbs)
    build_s = time.perf_counter() - t0
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=device.type == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (a.mbs, a.seq), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if "graphed" in variant:  # the documented loop change: one graphed micro-step
        from polyaccel.moe import GraphedMicroStep

        graphed = GraphedMicroStep(model, grad_accum=a.accum, use_cache=False)

        def micro_step():
            return graphed(input_ids=ids, labels=ids)
    else:
        def micro_step():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss
    def optimizer_step():
        for _ in range(a.accum):
            loss = micro_step()
        opt.step()
        opt.zero_grad(set_to_none="graphed" not in variant)  # a graph accumulates into the same .grad
        return loss

    times, first_s, loss = [], None, None
    for i in range(a.warmup + a.steps):
        _sync(device)
        t = time.perf_counter()
        loss = optimizer_step()
        _sync(device)
        dt = time.perf_counter() - t
        first_s = dt if first_s is None else first_s
        if i >= a.warmup:
            times.append(dt)
    med = sorted(times)[len(times) // 2]
    profile_path = None
    if a.profile and device.type == "cuda":
        from bench_moe import write_profile
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            optimizer_step()  # the row's own step (graph replays for -graphed)
            torch.cuda.synchronize()
        profile_path = write_profile(prof, f"profile_lora-{variant}_{layers}.txt", os.getcwd())
    tokens = a.mbs * a.seq * a.accum
    return {"variant": f"lora-{variant}@{layers}", "layers": layers, "seq": a.seq, "mbs": a.mbs, "accum": a.accum,
            "lora": LORA, "recompute": recompute, "adapter_params_m": round(sum(p.numel() for p in trainable) / 1e6, 2),
            "step_s_median": round(med, 4), "step_s_all": [round(x, 4) for x in times],
            "first_step_s": round(first_s, 2), "build_s": round(build_s, 1), "tokens_per_s": round(tokens / med, 1),
            "peak_gib": round(_peak_gib(device), 2), "loss": round(float(loss), 4), "device": device.type,
            "torch": torch.__version__, **({"profile": profile_path} if profile_path else {})}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parse_rows(rows: str, default_layers: int) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, rows.split(",")):
        variant, _, layers = item.partition("@")
        if not (variant.startswith("hf-peft") or variant.startswith("ours")):
            raise SystemExit(f"unknown LoRA variant {variant!r} (hf-peft, ours, ours-compile, ...-selective, ...-auto)")
        out.append((variant, int(layers) if layers else default_layers))
    return out


def main(a) -> None:  # noqa: ANN001
    """``bench_moe.py --lora``: each row in its own process, then the table."""
    from bench_moe import finish, run_subprocess

    if a.tiny:
        a.seq = min(a.seq, 64)
    rows = parse_rows(a.rows or (DEFAULT_ROWS if not a.tiny else "hf-peft@2,ours@2,ours-compile-selective@2"),
                      a.layers)
    if a.one:
        variant, layers = rows[0]
        print(json.dumps(run_row(variant, layers, a)), flush=True)
        return
    common = ["--seq", str(a.seq), "--mbs", str(a.mbs), "--accum", str(a.accum), "--steps", str(a.steps),
              "--warmup", str(a.warmup)] + (["--tiny"] if a.tiny else []) + (["--profile"] if a.profile else [])
    recs = []
    for variant, layers in rows:
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_moe.py"), "--lora",
               "--one", "1", "--rows", f"{variant}@{layers}", *common]
        for r in run_subprocess(cmd, a.timeout):
            r.setdefault("variant", f"lora-{variant}@{layers}")
            recs.append(r)
            print(json.dumps(r), flush=True)
    finish(recs, a.out)
    peer = {r["layers"]: r for r in recs if r.get("variant", "").startswith("lora-hf") and "tokens_per_s" in r}
    for r in recs:
        if "tokens_per_s" in r and r["layers"] in peer and r is not peer[r["layers"]]:
            print(f"{r['variant']}: {r['tokens_per_s'] / peer[r['layers']]['tokens_per_s']:.2f}x Transformers + PEFT "
                  f"at {r['peak_gib'] / peer[r['layers']]['peak_gib']:.2f}x its peak memory")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_moe

    bench_moe.main([*sys.argv[1:], "--lora"] if "--lora" not in sys.argv else sys.argv[1:])
