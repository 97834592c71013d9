"""MoE fine-tuning as users run it: every entry point beside its free peers, per shape, one run.

For each shape (a ``polyaccel-moe`` preset: ``qwen3-30b-a3b-L8``, ``olmoe-1b-7b``, ``qwen3-235b-a22b-L2``,
``moonlight-16b-a3b-L8`` (DeepSeek-V3 architecture),
``mixtral-8x7b-L4``, ...) and each entry point, one process (a clean allocator and peak
counter) trains ``--warmup + --steps`` optimizer steps of ``--accum`` micro-batches of
``1 x --seq`` random tokens, bf16, learned router, lr 1e-5, and reports the median step:

- ``hf``: Transformers' own model (grouped_mm experts, sdpa), ``torch.optim.AdamW(fused=True)``,
  the plain loop ``model(input_ids=ids, labels=ids).loss.backward()`` x accum, then ``step()``;
- ``hf-compile``: the same after ``model = torch.compile(model)`` (the strongest free peer);
- ``hf-trainer-compile``: Transformers' model under ``transformers.Trainer(torch_compile=True)``;
- ``loop-adamw``: our model with its default ``BackendConfig``, the same plain loop unchanged;
- ``loop``: the same plain loop with the documented change: ``FlatAdamW`` (told the
  micro-step's ``overwritten_params``) in place of ``torch.optim.AdamW`` and ``loss = step(input_ids=ids, labels=ids)`` (a
  ``GraphedMicroStep(model, grad_accum=4, wgrad_window="auto")``; ``--wgrad-window N`` sets it) in
  place of ``loss = model(...).loss; loss.backward()``;
- ``trainer``: our model under ``polyaccel.moe.Trainer`` (batch 1, ``--accum`` accumulation steps);
- ``cli``: ``polyaccel-moe bench --preset SHAPE`` with no speed flags.

``--profile`` also runs one more optimizer step of each plain-loop entry under torch.profiler
and adds its kernel time by category (``profile_ms``: GEMMs, grouped GEMMs, attention, routing,
norms, loss, optimizer, copies, the rest) to the row; the full kernel table goes to
``profile_<shape>_<entry>[_<variant>].txt`` in ``$OUT`` (else ``--out-dir``).

The peak (``peak_gib``) is the whole run's, warm-up (compilation, autotuning, graph capture)
included; plain-loop rows also give ``peak_after_warmup_gib``, the measured steps' alone.

One JSON line per row on stdout (and ``--out``), then a table with tokens/s, peak GiB, MFU
against the measured dense bf16 rate (790 TFLOP/s) and the H200 spec (989), and the ratio to
``hf-compile``.

``--variant NAME:KEY=VALUE[,KEY=VALUE...]`` (repeatable) also runs each of our entries (not the
``hf*`` peers) with those environment variables set in its process, right after the row
without them, so an A/B of a switch shares one machine and one run (rows say ``variant``).

  python tools/bench_moe_users.py --shapes qwen3-30b-a3b-L8 --out moe_users.jsonl
  python tools/bench_moe_users.py --entries hf-compile,cli,loop --variant persistent:POLYACCEL_WGRAD_PERSISTENT=1
  python tools/bench_moe_users.py --shapes olmoe-1b-7b,mixtral-8x7b-L4 --entries hf,hf-compile,cli,trainer,loop
  python tools/bench_moe_users.py --shapes qwen3-moe-tiny --device cpu --seq 64 --steps 2 --warmup 1  # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ENTRIES = ("hf", "hf-compile", "hf-trainer-compile", "loop-adamw", "loop", "trainer", "cli")
DENSE_TFLOPS, SPEC_TFLOPS = 790.0, 989.0
_MARK = "BENCH_ROW "


def shape_config(shape: str, layers: int | None, overrides: list[str] = ()):
    """The Transformers config of preset ``shape`` (``layers`` overrides its depth; each
    ``KEY=VALUE`` of ``overrides`` a field, the value read as YAML)."""
    import yaml

    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import preset

    cfg = preset(shape).model
    for item in overrides:
        key, _, value = item.partition("=")
        cfg.config[key] = yaml.safe_load(value)
    if layers:
        cfg.config["num_hidden_layers"] = layers
    return resolve_model_config(cfg)


def build(entry: str, config, device: str):
    """The model ``entry`` trains, on ``device`` in bf16, in train mode."""
    import torch

    torch.manual_seed(0)
    if entry.startswith("hf"):
        import transformers

        config._attn_implementation = "sdpa"
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if hasattr(model, "set_experts_implementation"):
            model.set_experts_implementation("grouped_mm")
    else:
        from polyaccel.moe import AutoModelForCausalLM

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.to(device).train()


def plain_loop(entry: str, config, a) -> tuple[list[float], float]:
    """Step times and last loss of the plain user loop of ``entry``."""
    import torch

    model = build(entry, config, a.device)
    step = None
    if entry == "loop":  # the documented two-line change
        from polyaccel.moe import FlatAdamW, GraphedMicroStep

        window = a.wgrad_window if a.wgrad_window == "auto" else int(a.wgrad_window)
        step = GraphedMicroStep(model, grad_accum=a.accum, wgrad_window=window) if a.device == "cuda" else None
        a.loop_fast, a.loop_step = {"cuda_graph": step is not None, "wgrad_window": window}, step
        opt = FlatAdamW(model.parameters(), lr=1e-5, grads_overwritten=step.overwritten_params if step else ())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=a.device == "cuda")
    if entry == "hf-compile":
        model = torch.compile(model)
    ids = torch.randint(0, config.vocab_size, (1, a.seq), device=a.device)

    def one_step() -> torch.Tensor:
        for _ in range(a.accum):
            if step is not None:
                loss = step(input_ids=ids, labels=ids)
            else:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    times, loss = [], None
    for i in range(a.warmup + a.steps):
        if i == a.warmup and a.device == "cuda":  # the peak of the measured steps alone, too
            a.peak_warmup = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        _sync(a.device)
        t0 = time.perf_counter()
        loss = one_step()
        _sync(a.device)
        times.append(time.perf_counter() - t0)
    if a.profile:
        a.profile_ms = profile_categories(one_step, a, "_".join(["profile", a.one[0], entry, *([a.row_variant] if a.row_variant else [])]) + ".txt")
    return times[a.warmup:], float(loss)


CATEGORIES = (  # first match wins: grouped GEMMs before GEMMs, the fused loss before linear
    ("grouped_gemm", r"grouped|wgrad|lowrank"),
    ("attention", r"flash|fmha|attention|sdpa|cudnn"),
    ("loss", r"cross_entropy|log_softmax|nll|logsumexp"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|addmm|\bmm\b|::mm|bmm|linear"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("norm", r"norm"),
    ("routing", r"sort|permute|scatter|gather|index|topk|histc|bincount|cumsum|route|segment"),
    ("copy", r"memcpy|memset|copy|fill|zero"),
)


def category(name: str) -> str:
    """The :data:`CATEGORIES` entry a kernel (or CPU op) name falls in; "other" if none."""
    import re

    low = name.lower()
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, low)), "other")


def profile_categories(run, a, name: str) -> dict[str, float]:  # noqa: ANN001
    """``run()`` once under torch.profiler: milliseconds of kernel time per :func:`category`
    (on CPU: the ops' own CPU time), largest first; the profiler's table goes to file ``name``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        _sync(a.device)
    key = "self_device_time_total" if a.device == "cuda" else "self_cpu_time_total"
    totals: dict[str, float] = {}
    averages = prof.key_averages()
    for avg in averages:
        us = getattr(avg, key, 0) or 0
        if us > 0:
            totals[category(avg.key)] = totals.get(category(avg.key), 0.0) + us / 1e3
    with open(os.path.join(os.environ.get("OUT") or a.out_dir, name), "w") as f:
        f.write(averages.table(sort_by=key, row_limit=80, max_name_column_width=100))
    if a.device == "cuda":  # once more, kernels only (host ops recorded stretch the gaps): where the GPU idles
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from profile_gaps import gpu_busy

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            _sync(a.device)
            wall_ms = (time.perf_counter() - t0) * 1e3
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        a.profile_gaps = {"wall_ms": round(wall_ms, 2), **gpu_busy(kernels)}
    return {k: round(v, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def trainer_run(entry: str, config, a) -> tuple[list[float], float]:
    """Step times and last logged loss of ``entry`` under a Trainer (ours or Transformers')."""
    import torch
    import transformers

    model = build(entry, config, a.device)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, config.vocab_size, ((a.warmup + a.steps) * a.accum, a.seq))]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(a.out_dir, f"trainer_{entry}"), per_device_train_batch_size=1,
        gradient_accumulation_steps=a.accum, max_steps=a.warmup + a.steps, learning_rate=1e-5,
        optim="adamw_torch_fused" if a.device == "cuda" else "adamw_torch", bf16=a.device == "cuda",
        logging_steps=1, save_strategy="no", report_to=[], torch_compile=entry == "hf-trainer-compile",
        use_cpu=a.device == "cpu", dataloader_pin_memory=False, disable_tqdm=True)
    if entry == "trainer":
        from polyaccel.moe import Trainer
    else:
        Trainer = transformers.Trainer  # noqa: N806
    timer = _StepTimer(a.device)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return timer.times[a.warmup:], float(losses[-1]) if losses else float("nan")


class _StepTimerBase:
    def __init__(self, device: str) -> None:
        self.device, self.times, self.t0 = device, [], None

    def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001
        _sync(self.device)
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001
        _sync(self.device)
        self.times.append(time.perf_counter() - self.t0)


def _StepTimer(device: str):  # noqa: N802
    """A TrainerCallback timing each optimizer step (the device synchronised at both ends)."""
    import transformers

    cls = type("StepTimer", (_StepTimerBase, transformers.TrainerCallback), {})
    return cls(device)


def cli_run(shape: str, a) -> dict:
    """``polyaccel-moe bench --preset shape`` with no speed flags; its JSON record."""
    cmd = [sys.executable, "-m", "polyaccel.moe.cli", "bench", "--preset", shape, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--set", f"train.seq_len={a.seq}", "--set", f"train.grad_accum={a.accum}",
           "--set", f"train.device={a.device}"]
    for item in a.config:
        cmd += ["--set", f"model.config.{item}"]
    if a.layers:
        cmd += ["--set", f"model.config.num_hidden_layers={a.layers}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"polyaccel-moe bench failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(lines[-1])


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def run_one(shape: str, entry: str, a) -> dict:
    """Measure one (shape, entry) in this process; its JSON record."""
    import torch

    from polyaccel.moe.flops import train_flops_per_token

    config = shape_config(shape, a.layers, a.config)
    tokens = a.seq * a.accum
    t_start = time.perf_counter()
    fast = steady = None
    if entry == "cli":
        rec = cli_run(shape, a)
        step_s, loss, peak, fast = rec["step_time_s"], rec["final_loss"], rec["peak_memory_gib"], rec.get("fast_path")
    else:
        if a.wgrad_tiles == "one-per-program":
            from polyaccel.cuda import grouped_wgrad

            grouped_wgrad.TMA_CONFIGS = [c for c in grouped_wgrad.TMA_CONFIGS if not c[5]]
        a.profile_ms = a.profile_gaps = a.peak_warmup = a.loop_fast = None
        times, loss = (trainer_run if "trainer" in entry else plain_loop)(entry, config, a)
        fast = a.loop_fast
        if fast is not None and fast["cuda_graph"]:  # "auto" resolves at the first micro-batch
            fast["wgrad_window"] = a.loop_step.wgrad_window
        if not entry.startswith("hf"):
            from polyaccel.moe import attention_choice

            fast = {**(fast or {}), "attention": "+".join(sorted(set(attention_choice.chosen().values()))) or "sdpa"}
            if a.device == "cuda":  # which expert GEMM each shape took (polyaccel.cuda.grouped_gemm.choose)
                from polyaccel.cuda import grouped_gemm

                fast["grouped_mm"] = {"x".join(map(str, k[:3])) + ("" if k[3] else "T"): v
                                      for k, v in sorted(grouped_gemm.CHOICES.items())} or "cutlass"
        step_s = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None
        if peak is not None and a.peak_warmup is not None:
            steady, peak = peak, max(peak, a.peak_warmup)
    fpt = train_flops_per_token(config, a.seq)
    tok_s = tokens / step_s
    return {"shape": shape, "entry": entry, "layers": config.num_hidden_layers, "seq": a.seq, "accum": a.accum,
            **({"config": a.config} if a.config else {}), "tokens_per_s": round(tok_s, 1), "step_s_median": round(step_s, 4),
            "peak_gib": None if peak is None else round(peak, 2),
            **({"peak_after_warmup_gib": round(steady, 2)} if steady is not None else {}),
            "mfu_dense": round(tok_s * fpt / (DENSE_TFLOPS * 1e12), 4),
            "mfu_spec": round(tok_s * fpt / (SPEC_TFLOPS * 1e12), 4),
            "loss": None if loss is None else round(loss, 4), "fast_path": fast,
            **({"profile_ms": a.profile_ms} if getattr(a, "profile_ms", None) else {}),
            **({"profile_gaps": a.profile_gaps} if getattr(a, "profile_gaps", None) else {}),
            "wall_s": round(time.perf_counter() - t_start, 1), "torch": torch.__version__}


def _ratio(row: dict, ref: dict, peer: str) -> str:
    return f"{row['tokens_per_s'] / ref[peer]:.2f}" if ref.get(peer) else "-"


def table(rows: list[dict]) -> str:
    """Rows grouped by shape, with each entry's ratio to hf-compile and to hf."""
    out = [f"{'shape':<20} {'entry':<20} {'tok/s':>9} {'GiB':>7} {'MFU790':>7} {'x hf-compile':>12} {'x hf':>6}"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        ref = {r["entry"]: r.get("tokens_per_s") for r in mine if not r.get("variant")}
        for r in mine:
            label = r["entry"] + (f"/{r['variant']}" if r.get("variant") else "")
            if "error" in r:
                out.append(f"{shape:<20} {label:<20} error: {r['error'][:80]}")
                continue
            out.append(f"{shape:<20} {label:<20} {r['tokens_per_s']:>9,.0f} {r['peak_gib'] or 0:>7.2f} "
                       f"{r['mfu_dense']:>7.1%} {_ratio(r, ref, 'hf-compile'):>12} {_ratio(r, ref, 'hf'):>6}")
    return "\n".join(out)


def _variant_arg(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:KEY=VALUE[,KEY=VALUE...]`` -> (NAME, {KEY: VALUE})."""
    name, sep, rest = text.partition(":")
    pairs = [item.partition("=") for item in rest.split(",")] if rest else []
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not pairs or any(
            not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) for key, eq, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: NAME:KEY=VALUE[,KEY=VALUE...] (NAME of letters, digits, "
                                         "'.', '_', '-'; KEY an environment variable name)")
    return name, {key: value for key, _, value in pairs}


def _runs(entry: str, variants: list[tuple[str, dict[str, str]]]) -> list[tuple[str | None, dict[str, str]]]:
    """(variant name, extra environment) of each row of ``entry``: the plain row first, then one
    per variant for our entries (the ``hf*`` peers run once)."""
    return [(None, {})] + ([] if entry.startswith("hf") else variants)


def _window_arg(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: auto or a whole number >= 1")
    return text


def _row(shape: str, entry: str, variant: str | None, env: dict[str, str], passthrough: list[str],
         timeout: float) -> dict:
    """One row in its own process (with ``env`` added to its environment); its JSON record."""
    cmd = [sys.executable, __file__, "--one", shape, entry, *passthrough, *([f"--row-variant={variant}"] if variant else [])]
    named = {"variant": variant, "env": env} if variant else {}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                             env={**os.environ, **env} if env else None)
        found = [ln[len(_MARK):] for ln in out.stdout.splitlines() if ln.startswith(_MARK)]
        rec = json.loads(found[-1]) if found else {"shape": shape, "entry": entry,
                                                   "error": (out.stderr or out.stdout)[-2000:]}
    except subprocess.TimeoutExpired:
        rec = {"shape": shape, "entry": entry, "error": f"timed out after {timeout:.0f} s"}
    return {**rec, **named}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--shapes", default="qwen3-30b-a3b-L8", help="comma-separated polyaccel-moe presets")
    p.add_argument("--entries", default=",".join(ENTRIES), help=f"comma-separated, of {', '.join(ENTRIES)}")
    p.add_argument("--layers", type=int, help="override the presets' depth")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every shape's model config (the value read as YAML), e.g. "
                        "--config hidden_size=1536 --config num_experts=40: shapes no preset has; repeatable")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="measured optimizer steps")
    p.add_argument("--wgrad-window", default="auto", type=_window_arg,
                   help="the loop entry's GraphedMicroStep weight-gradient window (auto or a count)")
    p.add_argument("--wgrad-tiles", default="all", choices=("all", "one-per-program"),
                   help="one-per-program: the expert weight-gradient kernel's launches before session 28 "
                        "(no persistent ones), for an A/B in the loop and trainer entries (not cli)")
    p.add_argument("--warmup", type=int, default=3, help="steps before measuring (compile, graph capture)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--timeout", type=float, default=900, help="seconds per row")
    p.add_argument("--out", help="also append the JSON lines here")
    p.add_argument("--profile", action="store_true",
                   help="profile one extra step of each plain-loop entry: kernel time by category in the row")
    p.add_argument("--out-dir", default=None, help="Trainer output folders (default: a new private temporary folder)")
    p.add_argument("--variant", action="append", default=[], type=_variant_arg, metavar="NAME:KEY=VALUE[,...]",
                   help="also run each of our entries with these environment variables (repeatable)")
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "ENTRY"), help=argparse.SUPPRESS)
    p.add_argument("--row-variant", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.out_dir is None:  # never a predictable name in a shared /tmp
        a.out_dir = tempfile.mkdtemp(prefix="polyaccel-moe-users-")
    if a.one:
        print(_MARK + json.dumps(run_one(*a.one, a)), flush=True)
        return 0
    entries = a.entries.split(",")
    bad = [e for e in entries if e not in ENTRIES]
    if bad:
        p.error(f"unknown entries {bad}; choose from {', '.join(ENTRIES)}")
    names = [name for name, _ in a.variant]
    if len(set(names)) != len(names):
        p.error(f"--variant names repeat: {names}")
    rows = []
    passthrough = [f"--seq={a.seq}", f"--accum={a.accum}", f"--steps={a.steps}", f"--warmup={a.warmup}",
                   f"--device={a.device}", f"--out-dir={a.out_dir}", f"--wgrad-window={a.wgrad_window}", f"--wgrad-tiles={a.wgrad_tiles}"]
    passthrough += [f"--layers={a.layers}"] if a.layers else []
    passthrough += [f"--config={item}" for item in a.config]
    passthrough += ["--profile"] if a.profile else []
    for shape in a.shapes.split(","):
        for entry in entries:
            for variant, env in _runs(entry, a.variant):
                rec = _row(shape, entry, variant, env, passthrough, a.timeout)
                rows.append(rec)
                line = json.dumps(rec)
                print(line, flush=True)
                if a.out:
                    with open(a.out, "a") as f:
                        f.write(line + "\n")
    print(table(rows), flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
