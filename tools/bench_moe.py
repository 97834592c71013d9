"""MoE fine-tuning throughput: polyaccel beside Hugging Face Transformers, in one run.

Workload "qwen3-30b-a3b-L8" (docs/benchmarks.md): Qwen3-30B-A3B layer shapes, random init,
bf16 parameters, synthetic tokens, AdamW (fused), ``--accum`` micro-batches of ``--mbs`` x
``--seq`` tokens per optimizer step. The loop is the anchor's (``anchor_moe_hf.py``):
``--warmup`` steps, then the median of ``--steps`` steps; tokens/s = accum x mbs x seq /
median step; peak memory = ``torch.cuda.max_memory_allocated``; MFU = model FLOPs/s over
the H200's measured dense bf16 rate (``--peak-tflops``).

Each variant runs in its own process (a clean allocator and peak counter); the anchor runs
in the same invocation with ``--anchor PATH``. One JSON line per variant on stdout (and in
``--out``), then a table.

  python tools/bench_moe.py --anchor .anchors/anchor_moe_hf.py --variants learned,balanced
  python tools/bench_moe.py --kernels          # per-op micro-benchmarks, ours vs torch
  python tools/bench_moe.py --sanity           # our loss vs HF's on identical weights
  python tools/bench_moe.py --variants hf --profile   # torch.profiler table per variant
  python tools/bench_moe.py --gpus 2 --anchor .anchors/anchor_moe_hf_fsdp.py   # expert parallelism

With ``--gpus N`` (N > 1) every configuration is an N-process torchrun on this host: the
anchor is ``anchor_moe_hf_fsdp.py`` (Transformers + FSDP2, dp=N) and the variants are the
:data:`EP_VARIANTS` settings of ``polyaccel-moe bench`` at EP=N x DP=N (tokens/s and peak
memory per GPU). NVLink multicast is kept off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``) unless already set.

Variants: ``hf`` is Transformers in this process (grouped_mm experts, sdpa; for profiling
and as a check of the anchor); the others build ``polyaccel.moe.AutoModelForCausalLM``
with the :data:`VARIANTS` ``BackendConfig``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

H200_DENSE_BF16_TFLOPS = 790.0
"""8192^3 bf16 matmul measured on the device machine (2026-10/11)."""

_OURS = dict(experts="grouped_mm", loss="fused", rms_norm="fused")
VARIANTS: dict[str, dict | None] = {
    "hf": None,
    "learned": {**_OURS, "gate": "learned", "compile": False},
    "balanced": {**_OURS, "gate": "balanced", "compile": False},
    "learned-compile": {**_OURS, "gate": "learned", "compile": True},
    "balanced-compile": {**_OURS, "gate": "balanced", "compile": True},
    "learned-unfused": {"experts": "grouped_mm", "loss": "standard", "rms_norm": "torch",
                        "gate": "learned", "compile": False, "grad_accumulation": "autograd"},
    "learned-compile-autograd": {**_OURS, "gate": "learned", "compile": True, "grad_accumulation": "autograd"},
    "learned-compile-flat": {**_OURS, "gate": "learned", "compile": True, "optimizer": "flat_adamw"},
    "balanced-compile-flat": {**_OURS, "gate": "balanced", "compile": True, "optimizer": "flat_adamw"},
    "learned-flat-graph": {**_OURS, "gate": "learned", "compile": False, "optimizer": "flat_adamw",
                           "graph": True},
    "learned-compile-flat-graph": {**_OURS, "gate": "learned", "compile": True, "optimizer": "flat_adamw",
                                   "graph": True},
    "balanced-compile-flat-graph": {**_OURS, "gate": "balanced", "compile": True, "optimizer": "flat_adamw",
                                    "graph": True},
    "learned-compile-flat-graph-w2": {**_OURS, "gate": "learned", "compile": True, "optimizer": "flat_adamw",
                                      "graph": True, "wgrad_window": 2},
    "learned-compile-flat-graph-w4": {**_OURS, "gate": "learned", "compile": True, "optimizer": "flat_adamw",
                                      "graph": True, "wgrad_window": 4},
    "balanced-compile-flat-graph-w4": {**_OURS, "gate": "balanced", "compile": True, "optimizer": "flat_adamw",
                                       "graph": True, "wgrad_window": 4},
}
"""name -> ``BackendConfig`` keyword arguments (None: Transformers itself), plus ``optimizer``:
``"adamw"`` (default: ``torch.optim.AdamW(fused=True)``, the anchor's) or ``"flat_adamw"``
(:class:`polyaccel.moe.optim.FlatAdamW`, same math over flat buffers), and ``graph``: each
micro-batch's forward + backward replayed as one CUDA graph
(:class:`polyaccel.moe.graphed_step.GraphedMicroStep`), told each call's place in the step;
``wgrad_window``: its expert weight gradients computed once per that many micro-batches.
``grad_accumulation`` defaults to ``"fused"`` (expert weight gradients accumulated inside the
grouped GEMM)."""


_EP_FAST = ["parallel.dense=replicate", "model.backend.dispatcher=allgather", "model.backend.compile=true",
            "train.cuda_graph=true"]
EP_VARIANTS: dict[str, list[str]] = {
    "ep-replicate-graph-w2": [*_EP_FAST, "train.wgrad_window=2"],
    "ep-replicate-graph-w2-balanced": [*_EP_FAST, "train.wgrad_window=2", "model.backend.gate=balanced"],
    "ep-replicate-graph-w4": [*_EP_FAST, "train.wgrad_window=4"],
    "ep-replicate-eager": ["parallel.dense=replicate", "model.backend.dispatcher=allgather",
                           "model.backend.compile=true"],
    "ep-fsdp-a2a": ["model.backend.dispatcher=nccl_a2a"],
}
"""name -> ``--set`` overrides of ``polyaccel-moe bench --preset qwen3-30b-a3b-L8`` at EP=N x DP=N
(N = ``--gpus``): dense replicas with the fixed-size all-gather dispatch and the graphed
micro-step (the fast layout), eager, and FSDP2 with the all-to-all dispatcher."""
_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ep_command(variant: str, gpus: int, a) -> list[str]:  # noqa: ANN001
    """The torchrun command line of EP variant ``variant`` on ``gpus`` GPUs."""
    sets = [f"parallel.dp={gpus}", f"parallel.ep={gpus}", f"train.seq_len={a.seq}",
            f"train.micro_batch={a.mbs}", f"train.grad_accum={a.accum}",
            f"model.config.num_hidden_layers={a.layers}", *EP_VARIANTS[variant]]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
            "-m", "polyaccel.moe.cli", "bench", "--preset", "qwen3-30b-a3b-L8", "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--peak-tflops", str(a.peak_tflops), *[x for kv in sets for x in ("--set", kv)]]


def ep_record(variant: str, rec: dict) -> dict:
    """``polyaccel-moe bench``'s JSON line in this script's keys (per GPU)."""
    if "tokens_per_s_per_device" not in rec:
        return {"variant": variant, **rec}
    return {"variant": variant, "gpus": rec["world_size"], "tokens_per_s": round(rec["tokens_per_s_per_device"], 1),
            "step_s_median": round(rec["step_time_s"], 4), "peak_gib": round(rec["peak_memory_gib"], 2),
            "mfu": round(rec["mfu"], 4), "loss": rec.get("final_loss"), "backend": rec.get("backend"),
            "sets": EP_VARIANTS.get(variant)}


def backend_kwargs(variant: str) -> dict:
    """The ``BackendConfig`` keyword arguments of ``variant``."""
    return {k: v for k, v in (VARIANTS[variant] or {}).items() if k not in ("optimizer", "graph", "wgrad_window")}


def make_optimizer(model, variant: str, overwritten=()) -> torch.optim.Optimizer:
    """The optimizer ``variant`` names (lr 1e-5 and AdamW defaults otherwise, as the anchor);
    ``overwritten``: params whose grads the micro-step writes over (FlatAdamW leaves them)."""
    if (VARIANTS[variant] or {}).get("optimizer") == "flat_adamw":
        from polyaccel.moe.optim import FlatAdamW

        return FlatAdamW(model.parameters(), lr=1e-5, grads_overwritten=overwritten)
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def forward_kwargs(variant: str) -> dict:
    """``use_cache=False`` for our models: a training step needs no KV cache, and under
    ``torch.compile`` a cache's per-layer state made every decoder layer recompile (the model
    now turns the cache off in training by itself too). The ``hf`` variant runs as the anchor
    does."""
    return {} if VARIANTS[variant] is None else {"use_cache": False}


# ---------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------


def qwen3_config(layers: int):
    """The anchor's Qwen3-30B-A3B-shaped config with ``layers`` layers."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_theta=1e6, tie_word_embeddings=False, router_aux_loss_coef=0.001, output_router_logits=False,
    )


def flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs per trained token, forward + backward (``polyaccel.moe.flops``: attention
    projections, causal QK^T and PV, router, the k active experts, LM head)."""
    from polyaccel.moe.flops import train_flops_per_token

    return train_flops_per_token(cfg, seq)


def build_model(variant: str, cfg):
    """The model for ``variant`` on the GPU in bf16, in train mode."""
    torch.manual_seed(0)
    if VARIANTS[variant] is None:
        from transformers import Qwen3MoeForCausalLM

        cfg._attn_implementation = "sdpa"
        with torch.device("cuda"):
            model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
        model.set_experts_implementation("grouped_mm")
    else:
        from polyaccel.moe import AutoModelForCausalLM, BackendConfig

        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(**backend_kwargs(variant)))
        model = model.to(device="cuda", dtype=torch.bfloat16)
    return model.train()


def train_step(model, opt, ids, accum: int, micro_step=None, **forward_kw) -> torch.Tensor:
    """``accum`` forward/backward passes on ``ids``, one AdamW step; returns the last loss.
    ``micro_step`` (a :class:`~polyaccel.moe.graphed_step.GraphedMicroStep`) replaces the
    eager forward/backward when given."""
    for i in range(accum):
        if micro_step is not None:
            loss = micro_step(input_ids=ids, labels=ids, micro_batch=(i, accum))
        else:
            loss = model(input_ids=ids, labels=ids, **forward_kw).loss
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_variant(a) -> dict:
    """Time one variant in this process; returns its JSON record."""
    cfg = qwen3_config(a.layers)
    t_build = time.perf_counter()
    model = build_model(a.one, cfg)
    build_s = time.perf_counter() - t_build
    nparams = sum(p.numel() for p in model.parameters())
    micro_step = None
    if (VARIANTS[a.one] or {}).get("graph"):
        from polyaccel.moe.graphed_step import GraphedMicroStep

        micro_step = GraphedMicroStep(model, warmup=1, wgrad_window=VARIANTS[a.one].get("wgrad_window", 1),
                                      **forward_kwargs(a.one))
    opt = make_optimizer(model, a.one, micro_step.overwritten_params if micro_step is not None else ())
    warmup = a.warmup
    ids = torch.randint(0, cfg.vocab_size, (a.mbs, a.seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, first_s = [], None
    for i in range(warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(model, opt, ids, a.accum, micro_step, **forward_kwargs(a.one))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        first_s = first_s if first_s is not None else dt
        if i >= warmup:
            times.append(dt)
    med = sorted(times)[len(times) // 2]
    tokens = a.mbs * a.seq * a.accum
    fpt = flops_per_token(cfg, a.seq)
    rec = {
        "variant": a.one, "backend": VARIANTS[a.one] or {"hf": "grouped_mm+sdpa"},
        "optimizer": type(opt).__name__,
        "forward_kwargs": forward_kwargs(a.one),
        "layers": a.layers, "seq": a.seq, "mbs": a.mbs, "accum": a.accum,
        "params_b": round(nparams / 1e9, 3), "step_s_median": round(med, 4),
        "step_s_all": [round(t, 4) for t in times], "first_step_s": round(first_s, 2),
        "build_s": round(build_s, 1), "tokens_per_s": round(tokens / med, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "gflop_per_token": round(fpt / 1e9, 3),
        "mfu": round(tokens / med * fpt / (a.peak_tflops * 1e12), 4),
        "loss": round(float(loss), 4), "torch": torch.__version__,
    }
    if a.profile:
        rec["profile"] = profile_step(model, opt, ids, a, micro_step)
    if a.optimizer_timing:
        rec["optimizer_ms"] = optimizer_timing(model, opt, ids, a, micro_step)
    return rec


def optimizer_timing(model, opt, ids, a, micro_step=None, steps: int = 3) -> dict:  # noqa: ANN001
    """Median ms of ``opt.step()`` (CUDA events) where a training step runs it (right after the
    last backward), after the GPU idled 200 ms, and run again at once: tells a slow pass in the
    step (clocks after tensor-core work? memory state?) from the kernel itself."""
    def backward_then(idle: float) -> tuple[float, float]:
        for i in range(a.accum):
            if micro_step is not None:
                micro_step(input_ids=ids, labels=ids, micro_batch=(i, a.accum))
            else:
                model(input_ids=ids, labels=ids, **forward_kwargs(a.one)).loss.backward()
        if idle:
            torch.cuda.synchronize()
            time.sleep(idle)
        first = _event_ms(opt.step)
        again = _event_ms(opt.step)  # same buffers, the GPU already busy with this very pass
        opt.zero_grad(set_to_none=True)
        return first, again

    in_step, after_idle, again = [], [], []
    for _ in range(steps):
        first, second = backward_then(0.0)
        in_step.append(first)
        again.append(second)
        after_idle.append(backward_then(0.2)[0])
    med = lambda xs: round(sorted(xs)[len(xs) // 2], 3)  # noqa: E731
    return {"in_step": med(in_step), "after_200ms_idle": med(after_idle), "run_again_at_once": med(again)}


def profile_step(model, opt, ids, a, micro_step=None) -> str:
    """One optimizer step under torch.profiler; the top CUDA kernels go to a text file."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train_step(model, opt, ids, a.accum, micro_step, **forward_kwargs(a.one))
        torch.cuda.synchronize()
    return write_profile(prof, f"profile_{a.one}.txt", a.out_dir)


def write_profile(prof, name: str, folder: str) -> str:  # noqa: ANN001
    """The profiler's kernel tables (self and total CUDA time) to file ``name`` in ``$OUT`` (the
    device tool brings that folder back), else in ``folder``; returns the path."""
    path = os.path.join(os.environ.get("OUT") or folder, name)
    averages = prof.key_averages()
    with open(path, "w") as f:
        for key in ("self_cuda_time_total", "cuda_time_total"):
            f.write(f"sorted by {key}\n")
            f.write(averages.table(sort_by=key, row_limit=60, max_name_column_width=90))
            f.write("\n\n")
    return path


# ---------------------------------------------------------------------------------------
# Side checks: kernels alone, and our loss against HF's on the same weights
# ---------------------------------------------------------------------------------------


def bench_kernels() -> list[dict]:
    """Median time (ms) of each op, forward + backward, ours vs plain torch, at workload shapes."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from polyaccel.core import ops
    from polyaccel.cuda import kernels
    from polyaccel.cuda.cross_entropy import linear_cross_entropy
    from polyaccel.cuda.moe_permute import moe_permute, moe_unpermute
    from polyaccel.cuda.swiglu import swiglu
    from polyaccel.cuda.triton_rmsnorm import rms_norm

    dev, bf = "cuda", torch.bfloat16
    T, H, E, k, inter, V = 4096, 2048, 128, 8, 768, 151936

    def fwd_bwd(fn, *inputs):
        def run():
            out = fn(*inputs)
            grads = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.grad(out, grads, torch.ones_like(out))
        return run

    def leaf(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, device=dev) * scale).to(dtype).requires_grad_()

    idx = torch.rand(T, E, device=dev).argsort(-1)[:, :k]
    topw = torch.softmax(torch.randn(T, k, device=dev), -1).requires_grad_()
    x, nw = leaf(T, H), leaf(H)
    gu = leaf(T * k, 2 * inter)
    xs0, order, counts = moe_permute(x.detach(), idx, E)
    ys = leaf(T * k, H)
    w_gu = leaf(E, 2 * inter, H, scale=0.02)
    offs = counts.cumsum(0).to(torch.int32)
    xs = xs0.detach().requires_grad_()
    hid, head = leaf(T, H), leaf(V, H, scale=0.02)
    labels = torch.randint(0, V, (T,), device=dev)
    head_grad, head_step_grad = torch.zeros(V, H, device=dev, dtype=bf), torch.randn(V, H, device=dev, dtype=bf)
    upstream = torch.tensor(0.5, device=dev)

    def ref_ce(h, w, y):
        return F.cross_entropy(F.linear(h, w).float(), y)

    cases = {
        "rms_norm [4096,2048]": (fwd_bwd(rms_norm, x, nw), fwd_bwd(ops.rms_norm.reference, x, nw)),
        "rms_norm q/k [4096*32,128]": (fwd_bwd(rms_norm, leaf(T * 32, 128), leaf(128)),
                                       fwd_bwd(ops.rms_norm.reference, leaf(T * 32, 128), leaf(128))),
        "swiglu [32768,1536]": (fwd_bwd(swiglu, gu), fwd_bwd(ops.swiglu.reference, gu)),
        "permute+unpermute T4096 k8 E128": (
            fwd_bwd(lambda x, w: moe_unpermute(moe_permute(x, idx, E)[0], order, w), x, topw),
            fwd_bwd(lambda x, w: ops.moe_unpermute.reference(ops.moe_permute.reference(x, idx, E)[0], order, w),
                    x, topw)),
        "unpermute only": (fwd_bwd(moe_unpermute, ys, order, topw),
                           fwd_bwd(ops.moe_unpermute.reference, ys, order, topw)),
        "grouped_mm gate_up [32768,2048]x[128,1536,2048]": (
            fwd_bwd(kernels.grouped_mm, xs, w_gu, offs), None),
        "linear_cross_entropy N4096 V151936": (fwd_bwd(linear_cross_entropy, hid, head, labels),
                                              fwd_bwd(ref_ce, hid, head, labels)),
        "LM head grad scaled into .grad: add_scaled_ vs foreach mul + add_": (
            lambda: kernels.add_scaled_(head_grad, head_step_grad, upstream),
            lambda: head_grad.add_(torch._foreach_mul([head_step_grad], upstream)[0])),
    }
    rows = []
    for name, (ours, ref) in cases.items():
        rec = {"kernel": name, "ours_ms": round(do_bench(ours, warmup=50, rep=200, return_mode="median"), 3)}
        if ref is not None:
            rec["torch_ms"] = round(do_bench(ref, warmup=50, rep=200, return_mode="median"), 3)
            rec["speedup"] = round(rec["torch_ms"] / rec["ours_ms"], 2)
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    gemm = next(r for r in rows if r["kernel"].startswith("grouped_mm"))
    gemm["tflops"] = round(3 * 2 * T * k * H * 2 * inter / (gemm["ours_ms"] * 1e-3) / 1e12, 1)
    return rows


def _wgrad_cases(dys, xs, offs, grad, dy_all, x_all, all_offs) -> dict:
    from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

    sources = list(zip(dys, xs, offs, strict=True))
    return {
        "per_micro_batch": lambda: [grouped_mm_wgrad(d, x, o, out=grad) for d, x, o in sources],
        "window_write": lambda: grouped_mm_wgrad(dys, xs, offs, out=grad, accumulate=False),
        "window_accumulate": lambda: grouped_mm_wgrad(dys, xs, offs, out=grad),
        "grouped_mm+add_": lambda: [grad.add_(torch._grouped_mm(d.t(), x, offs=o)) for d, x, o in sources],
        "grouped_mm_concat": lambda: torch._grouped_mm(dy_all.t(), x_all, offs=all_offs)}


def bench_wgrad_accumulation() -> list[dict]:
    """Expert weight gradients of a window of 1, 2 or 4 micro-batches, at the workload's two
    expert GEMM shapes with learned-router-like counts: our Triton kernel once per
    micro-batch accumulating into ``.grad`` (``per_micro_batch``), once over the whole window
    (``window``: lists of sources; written over ``.grad``, or added), against
    ``torch._grouped_mm`` + ``add_`` per micro-batch (what autograd does) and
    ``torch._grouped_mm`` alone over the window's rows concatenated (CUTLASS, no accumulation)."""
    from triton.testing import do_bench

    from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

    dev, bf = "cuda", torch.bfloat16
    T, E, k, H, inter = 4096, 128, 8, 2048, 768
    rows = []
    for window in (1, 2, 4):
        offs = [torch.bincount(torch.rand(T, E, device=dev).argsort(-1)[:, :k].flatten(), minlength=E)
                .cumsum(0).to(torch.int32) for _ in range(window)]
        all_offs = sum(o.diff(prepend=o.new_zeros(1)) for o in offs).cumsum(0).to(torch.int32)
        for name, N, K in (("gate_up", 2 * inter, H), ("down", H, inter)):
            dys = [torch.randn(T * k, N, device=dev, dtype=bf) for _ in range(window)]
            xs = [torch.randn(T * k, K, device=dev, dtype=bf) for _ in range(window)]
            dy_all, x_all = torch.cat(dys), torch.cat(xs)  # (rows not grouped across sources: timing only)
            grad = torch.zeros(E, N, K, device=dev, dtype=bf)
            ref = sum(torch._grouped_mm(d.t(), x, offs=o).float() for d, x, o in zip(dys, xs, offs, strict=True))
            got = grouped_mm_wgrad(dys, xs, offs).float()
            cases = _wgrad_cases(dys, xs, offs, grad, dy_all, x_all, all_offs)
            rec = {"kernel": f"wgrad {name} [E{E},{N},{K}] T*k={T * k} x {window} micro-batches", "window": window,
                   "rel_err_vs_grouped_mm": round(((got - ref).norm() / ref.norm()).item(), 5)}
            for case, fn in cases.items():
                rec[f"{case}_ms"] = round(do_bench(fn, warmup=25, rep=100, return_mode="median"), 3)
            rec["tflops_window_write"] = round(2 * window * T * k * N * K / (rec["window_write_ms"] * 1e-3) / 1e12, 1)
            rows.append(rec)
            print(json.dumps(rec), flush=True)
            del dys, xs, dy_all, x_all, grad, ref, got
    return rows


def bench_wgrad_one_micro_batch() -> list[dict]:
    """One micro-batch's expert weight gradients at ~1,000 rows per expert (Mixtral's shapes,
    8 experts top-2, and Qwen3's at four micro-batches' rows): the tensor-memory kernel that
    takes them (``grouped_mm_wgrad``) against the pointer kernel (forced) and CUTLASS's
    ``torch._grouped_mm`` (which writes a new tensor: no accumulation)."""
    rows = []
    for shape in (("mixtral gate_up", 8, 2, 4096, 2 * 14336, 4096), ("mixtral down", 8, 2, 4096, 4096, 14336),
                  ("qwen3 gate_up", 128, 8, 16384, 1536, 2048)):
        rows.append(_time_wgrad_one_micro_batch(*shape))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _time_wgrad_one_micro_batch(name: str, E: int, k: int, T: int, N: int, K: int) -> dict:
    from triton.testing import do_bench

    from polyaccel.cuda import grouped_wgrad

    dev, bf = "cuda", torch.bfloat16
    offs = torch.bincount(torch.rand(T, E, device=dev).argsort(-1)[:, :k].flatten(), minlength=E
                          ).cumsum(0).to(torch.int32)
    dy = torch.randn(T * k, N, device=dev, dtype=bf)
    x = torch.randn(T * k, K, device=dev, dtype=bf)
    grad = torch.empty(E, N, K, device=dev, dtype=bf)
    ref = torch._grouped_mm(dy.t(), x, offs=offs).float()
    assert grouped_wgrad._takes_tma(dy, x, E)
    got = grouped_wgrad.grouped_mm_wgrad(dy, x, offs).float()
    rec = {"kernel": f"wgrad one micro-batch {name} [E{E},{N},{K}] {T * k} rows",
           "rel_err_vs_grouped_mm": round(((got - ref).norm() / ref.norm()).item(), 5)}

    def ours():
        grouped_wgrad.grouped_mm_wgrad(dy, x, offs, out=grad, accumulate=False)

    def timed(fn) -> float:  # noqa: ANN001
        return round(do_bench(fn, warmup=25, rep=100, return_mode="median"), 3)

    rec["tma_ms"], rec["grouped_mm_ms"] = timed(ours), timed(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
    saved, grouped_wgrad.TMA_MIN_ROWS = grouped_wgrad.TMA_MIN_ROWS, 1 << 40
    try:
        rec["pointer_ms"] = timed(ours)
    finally:
        grouped_wgrad.TMA_MIN_ROWS = saved
    for case in ("tma", "pointer", "grouped_mm"):
        rec[f"tflops_{case}"] = round(2 * T * k * N * K / (rec[f"{case}_ms"] * 1e-3) / 1e12, 1)
    return rec


def bench_adamw() -> list[dict]:
    """One optimizer step over ~1.26 B bf16 parameters shaped like the workload's (one MoE
    layer's experts, attention matrices, embedding and LM head, norms): ``ops.adamw_step_``
    (one Triton pass over FlatAdamW's flat buffer, grads zeroed in the same pass) and
    ``FlatAdamW.step()`` against ``torch.optim.AdamW(fused=True)``, with and without its
    ``zero_grad(set_to_none=False)`` memset. GB/s counts the bytes each one must move."""
    from triton.testing import do_bench

    from polyaccel.core import ops
    from polyaccel.moe.optim import FlatAdamW

    dev, bf = "cuda", torch.bfloat16
    shapes = [(128, 1536, 2048), (128, 2048, 768), *[(4096, 2048)] * 4, (151936, 2048), (151936, 2048),
              *[(2048,)] * 4]

    def params():
        ps = [torch.nn.Parameter(torch.randn(s, device=dev, dtype=bf) * 0.02) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    n = sum(torch.Size(s).numel() for s in shapes)
    ours_params = params()
    flat_opt = FlatAdamW(ours_params, lr=1e-5, weight_decay=0.0)
    flat = flat_opt._flats[0][0]
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, zero_grad=True)

    def ours():
        ops.adamw_step_(flat.param, flat.grad, flat.exp_avg, flat.exp_avg_sq, **hyper)

    ref = torch.optim.AdamW(params(), lr=1e-5, weight_decay=0.0, fused=True)

    def ref_zero():
        ref.step()
        ref.zero_grad(set_to_none=False)

    rec = {"kernel": f"adamw step bf16 {len(shapes)} tensors {n / 1e9:.3f}B params"}
    for name, fn in (("ours", ours), ("flat_adamw_step", flat_opt.step), ("torch", ref.step),
                     ("torch_step_zero_grad", ref_zero)):
        rec[f"{name}_ms"] = round(do_bench(fn, warmup=10, rep=100, return_mode="median"), 3)
    rec["speedup"] = round(rec["torch_ms"] / rec["ours_ms"], 2)
    rec["speedup_with_zero_grad"] = round(rec["torch_step_zero_grad_ms"] / rec["ours_ms"], 2)
    # bf16 bytes per element: ours reads p, g, m, v and writes p, m, v, g (zeros); torch's step
    # reads four and writes three, its zero_grad writes g once more.
    rec["ours_gbps"] = round(16 * n / (rec["ours_ms"] * 1e-3) / 1e9, 1)
    rec["torch_gbps"] = round(14 * n / (rec["torch_ms"] * 1e-3) / 1e9, 1)
    print(json.dumps(rec), flush=True)
    return [rec]


def bench_adamw_full_size() -> list[dict]:
    """``ops.adamw_step_`` over one flat buffer of the whole workload's 5.607 B parameters (45 GB
    of bf16 state) and of one EP=2 rank's 3.2 B, with and without zeroing the grads, on a
    nonzero state (random params, grads and moments) and on one whose second half has zero
    grads and moments (as in a model where half the experts got no token: IEEE square root and
    division take their slow path on zeros, which the kernel steps around)."""
    from triton.testing import do_bench

    from polyaccel.core import ops

    dev, bf = "cuda", torch.bfloat16
    hyper = dict(lr=1e-5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=3)
    rows = []
    for n in (5_607_000_000, 3_200_000_000):
        state = [torch.randn(n, device=dev, dtype=bf).mul_(0.02), torch.randn(n, device=dev, dtype=bf).mul_(1e-3),
                 torch.randn(n, device=dev, dtype=bf).mul_(1e-4), torch.rand(n, device=dev, dtype=bf).mul_(1e-6)]
        for zero, values in ((True, "nonzero state"), (False, "nonzero state"), (True, "half zero moments")):
            if values == "half zero moments":
                for t in state[1:]:
                    t[n // 2:].zero_()
            ms = do_bench(lambda z=zero, st=state: ops.adamw_step_(*st, **hyper, zero_grad=z), warmup=20, rep=100,
                          return_mode="median")
            rows.append({"kernel": f"adamw step bf16 one flat buffer {n / 1e9:.3f}B params, zero_grad={zero}, "
                                   f"{values}", "ours_ms": round(ms, 3),
                         "ours_gbps": round((16 if zero else 14) * n / (ms * 1e-3) / 1e9, 1)})
            rows[-1]["after_gemm_burst_ms"] = round(_after_gemm_burst(
                lambda z=zero, st=state: ops.adamw_step_(*st, **hyper, zero_grad=z)), 3)
            print(json.dumps(rows[-1]), flush=True)
        state.clear()
        torch.cuda.empty_cache()
    return rows


def _after_gemm_burst(fn, reps: int = 5, gemms: int = 40) -> float:  # noqa: ANN001
    """Median ms of ``fn`` run right after ``gemms`` 8192^3 bf16 matrix products (as in a
    training step, where the optimizer follows the backward's tensor-core work)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(reps):
        for _ in range(gemms):
            a @ a
        times.append(_event_ms(fn))
    return sorted(times)[len(times) // 2]


def _event_ms(fn) -> float:  # noqa: ANN001
    """Milliseconds of the GPU work ``fn`` queues, between two CUDA events (synchronised after)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def loss_sanity(layers: int, seq: int) -> dict:
    """Our model's loss and HF's on identical weights and tokens, bf16 on the GPU."""
    from transformers import Qwen3MoeForCausalLM

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig

    cfg = qwen3_config(layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    hf.set_experts_implementation("grouped_mm")
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
    rec = {"sanity": "loss_vs_hf", "layers": layers, "seq": seq}
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids).loss.float().item()
    rec["hf_loss"] = round(ref, 5)
    state = hf.state_dict()
    del hf
    for spec_name in ("learned", "learned-unfused"):
        with torch.device("cuda"):  # a fresh config: HF's set_experts_implementation edited the other
            ours = AutoModelForCausalLM.from_config(qwen3_config(layers),
                                                    backend=BackendConfig(**backend_kwargs(spec_name)))
        ours = ours.to(device="cuda", dtype=torch.bfloat16)
        missing, unexpected = ours.load_state_dict(state, strict=False)
        with torch.no_grad():
            got = ours(input_ids=ids, labels=ids).loss.float().item()
        rec[f"{spec_name}_loss"] = round(got, 5)
        rec[f"{spec_name}_rel_err"] = abs(got - ref) / abs(ref)
        rec[f"{spec_name}_missing_keys"] = list(missing)[:5]
        rec[f"{spec_name}_unexpected_keys"] = list(unexpected)[:5]
        del ours
        torch.cuda.empty_cache()
    return rec


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------


def run_subprocess(cmd: list[str], timeout: float) -> list[dict]:
    """Run ``cmd``; its JSON lines (others echoed to stderr)."""
    print(f"# {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return [{"cmd": " ".join(cmd), "error": f"timed out after {timeout:.0f}s",
                 "stderr_tail": (e.stderr or b"")[-1500:].decode(errors="replace")
                 if isinstance(e.stderr, bytes) else str(e.stderr)[-1500:]}]
    recs = []
    for line in p.stdout.splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            print(line, file=sys.stderr)
    if p.returncode != 0:
        recs.append({"cmd": " ".join(cmd), "error": f"exit {p.returncode}", "stderr_tail": p.stderr[-3000:]})
    return recs


def run_expert_parallel(a) -> None:  # noqa: ANN001
    """``--gpus N``: the FSDP2 anchor and the EP variants, each an N-process torchrun."""
    for k, v in _MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    variants = [v for v in a.variants.split(",") if v] if a.variants is not None else list(EP_VARIANTS)[:2]
    unknown = [v for v in variants if v not in EP_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown} with --gpus; known: {', '.join(EP_VARIANTS)}")
    recs: list[dict] = []
    if a.anchor:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.gpus}", a.anchor,
               "--layers", str(a.layers), "--seq", str(a.seq), "--mbs", str(a.mbs), "--accum", str(a.accum),
               "--steps", str(a.steps), "--warmup", str(a.warmup)]
        for r in run_subprocess(cmd, a.timeout)[:1]:
            if "tokens_per_s_per_gpu" in r:
                r = {**r, "tokens_per_s": r["tokens_per_s_per_gpu"], "peak_gib": r["peak_gib_max_rank"],
                     "mfu": round(r["tokens_per_s_per_gpu"] * flops_per_token(qwen3_config(a.layers), a.seq)
                                  / (a.peak_tflops * 1e12), 4)}
            recs.append(r)
            print(json.dumps(r), flush=True)
    for v in variants:
        out = run_subprocess(ep_command(v, a.gpus, a), a.timeout)
        r = ep_record(v, out[0] if out else {"error": "no output"})  # every rank prints; rank 0's is first
        recs.append(r)
        print(json.dumps(r), flush=True)
    finish(recs, a.out)


def finish(recs: list[dict], out: str | None) -> None:
    """Append the JSON lines to ``out`` (if given) and print the table."""
    if out:
        with open(out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    print_table(recs)


def print_table(recs: list[dict]) -> None:
    anchor = next((r for r in recs if r.get("anchor") and "tokens_per_s" in r), None)
    print("\n| config | tokens/s | vs HF anchor | step s | peak GiB | MFU |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        if "tokens_per_s" not in r:
            continue
        name = f"HF anchor ({r['anchor']})" if r.get("anchor") else r["variant"]
        ratio = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}x" if anchor else "-"
        mfu = f"{r['mfu'] * 100:.1f}%" if "mfu" in r else "-"
        print(f"| {name} | {r['tokens_per_s']:,.0f} | {ratio} | {r['step_s_median']} | {r['peak_gib']} | {mfu} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default=None,
                   help=f"comma list of {', '.join(VARIANTS)}; with --gpus: {', '.join(EP_VARIANTS)} "
                        "(default: learned- and balanced-compile-flat-graph-w4; with --gpus the first two)")
    p.add_argument("--anchor", help="path of anchor_moe_hf.py to run first, same workload")
    p.add_argument("--kernels", nargs="?", const="wgrad,ops,adamw", default="",
                   help="per-op micro-benchmarks instead (comma list of wgrad, ops, adamw; default all)")
    p.add_argument("--sanity", action="store_true", help="our loss vs HF's on identical weights")
    p.add_argument("--sanity-layers", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="write a torch.profiler table per variant")
    p.add_argument("--optimizer-timing", action="store_true",
                   help="also time opt.step() in the step, after the GPU idled, and run again at once")
    p.add_argument("--peak-tflops", type=float, default=H200_DENSE_BF16_TFLOPS)
    p.add_argument("--timeout", type=float, default=420, help="seconds per variant process")
    p.add_argument("--out", help="append every JSON line to this file")
    p.add_argument("--gpus", type=int, default=1,
                   help="N > 1: expert parallelism over N GPUs of this host (variants from EP_VARIANTS)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--lora", action="store_true",
                   help="LoRA rows beside Transformers + PEFT instead (tools/bench_moe_lora.py; --rows)")
    p.add_argument("--rows", help="with --lora: comma list of variant@layers (default: bench_moe_lora.DEFAULT_ROWS)")
    p.add_argument("--tiny", action="store_true", help="with --lora: a tiny shape (CPU dry run)")
    a = p.parse_args(argv)
    if a.lora:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_moe_lora

        bench_moe_lora.main(a)
        return
    if a.gpus > 1:
        run_expert_parallel(a)
        return
    a.out_dir = os.path.dirname(os.path.abspath(a.out)) if a.out else os.getcwd()

    if a.one:  # child process: one variant
        from polyaccel.core import select_backend

        select_backend("cuda")
        print(json.dumps(run_variant(a)), flush=True)
        return

    recs: list[dict] = []
    if a.kernels or a.sanity:
        from polyaccel.core import select_backend

        select_backend("cuda")
        if a.kernels:
            benches = {"wgrad": lambda: bench_wgrad_accumulation() + bench_wgrad_one_micro_batch(),
                       "ops": bench_kernels,
                       "adamw": lambda: bench_adamw() + bench_adamw_full_size()}
            for name in a.kernels.split(","):
                if name not in benches:
                    raise SystemExit(f"unknown --kernels {name!r}; known: {', '.join(benches)}")
                recs += benches[name]()
        if a.sanity:
            recs.append(loss_sanity(a.sanity_layers, a.seq))
            print(json.dumps(recs[-1]), flush=True)
    common = ["--layers", str(a.layers), "--seq", str(a.seq), "--mbs", str(a.mbs), "--accum", str(a.accum),
              "--steps", str(a.steps), "--warmup", str(a.warmup), "--peak-tflops", str(a.peak_tflops)]
    if a.anchor:
        for r in run_subprocess([sys.executable, a.anchor, "--layers", str(a.layers), "--seq", str(a.seq),
                                 "--mbs", str(a.mbs), "--accum", str(a.accum), "--steps", str(a.steps),
                                 "--warmup", str(a.warmup)], a.timeout):
            if "tokens_per_s" in r:
                r["mfu"] = round(r["tokens_per_s"] * flops_per_token(qwen3_config(a.layers), a.seq)
                                 / (a.peak_tflops * 1e12), 4)
            recs.append(r)
            print(json.dumps(r), flush=True)
    if a.variants is None:
        a.variants = "learned-compile-flat-graph-w4,balanced-compile-flat-graph-w4"
    for v in filter(None, a.variants.split(",")):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
        cmd = [sys.executable, os.path.abspath(__file__), "--one", v, *common]
        if a.profile:
            cmd.append("--profile")
        if a.optimizer_timing:
            cmd.append("--optimizer-timing")
        if a.out:
            cmd += ["--out", a.out]
        for r in run_subprocess(cmd, a.timeout):
            recs.append(r)
            print(json.dumps(r), flush=True)
    finish(recs, a.out)


if __name__ == "__main__":
    main()
