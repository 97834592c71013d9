"""ASR throughput benchmark: our static-graph runner vs Hugging Face `generate()`, side by side.

Prints one JSON line per (system, model, batch). RTFx = seconds of audio / wall seconds.
Our rows start from raw 30 s waveforms in host memory (feature extraction INCLUDED); the HF
anchor rows start from log-mel features already on the GPU (feature extraction excluded).
Every system decodes exactly ``--new-tokens`` tokens per utterance (EOS suppressed until
then, as the anchor's ``min_new_tokens``), random weights, bf16, greedy.

Sections (``--sections``):
  ours     our ASRRunner per model and batch (CUDA graphs on cuda; ``--eager`` adds eager rows)
  anchor   the peer baseline from ../shared/anchors/anchor_asr_hf.py (``--anchor-dir``)
  runtime  ReplicaPool vs a threaded shared-queue loop vs a process pool, same model/graphs
  exact    greedy tokens of graphs == eager at several batch sizes (must print "exact": true)

Run on a GPU machine (packages on PYTHONPATH, not installed):
  PYTHONPATH=packages/core/src:packages/backend_cuda/src:packages/asr/src \
  POLYACCEL_PLUGINS=polyaccel.cuda.plugin python tools/bench_asr.py --anchor-dir .anchors
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

# name: (d_model, enc_layers, dec_layers, heads, ffn, n_mels, vocab)
WHISPER_SHAPES = {
    "whisper-large-v3-turbo": (1280, 32, 4, 20, 5120, 128, 51866),
    "whisper-large-v3": (1280, 32, 32, 20, 5120, 128, 51866),
    "whisper-small": (768, 12, 12, 12, 3072, 80, 51865),
    "whisper-base": (512, 6, 6, 8, 2048, 80, 51865),
}
CONFORMER_SHAPES = ("canary-1b-flash-shape", "canary-180m-flash-shape")
AUDIO_S = 30.0


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def build_model(name: str, device: str, dtype: torch.dtype):
    """A random-weight model of the named shape on ``device``."""
    torch.manual_seed(0)
    if name in WHISPER_SHAPES:
        from polyaccel.asr.whisper import WhisperASR, WhisperConfig

        d, el, dl, h, f, mels, vocab = WHISPER_SHAPES[name]
        cfg = WhisperConfig(num_mel_bins=mels, d_model=d, encoder_layers=el, encoder_attention_heads=h,
                            encoder_ffn_dim=f, decoder_layers=dl, decoder_attention_heads=h, decoder_ffn_dim=f,
                            vocab_size=vocab, decoder_start_token_id=50258, eos_token_id=50257,
                            no_timestamps_token_id=None)
        with torch.device(device):
            model = WhisperASR(cfg)
    elif name in CONFORMER_SHAPES:
        from polyaccel.asr import conformer_config
        from polyaccel.asr.conformer import ConformerAED

        preset = {"canary-1b-flash-shape": conformer_config.canary_1b_flash_shape,
                  "canary-180m-flash-shape": conformer_config.canary_180m_flash_shape}[name]()
        with torch.device(device):
            model = ConformerAED(preset)
    else:
        raise SystemExit(f"unknown model {name!r}")
    with torch.no_grad():  # Hugging Face-style init (std 0.02) so greedy tokens vary with the input
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.02)
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    if name in WHISPER_SHAPES:  # random weights ship no tokenizer; text is not measured here
        model.decode_text = lambda ids: ""
    return model


def make_runner(model, backend: str, batch: int, new_tokens: int, use_graphs: bool):
    from polyaccel.asr.runner import ASRRunner

    return ASRRunner(model, backend=backend, batch_buckets=(batch,), max_new_tokens=new_tokens,
                     min_new_tokens=new_tokens, use_graphs=use_graphs)


def waveforms(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(int(AUDIO_S * 16000))).astype(np.float32) for _ in range(n)]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up: compiles / captures graphs
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def section_ours(args, device, dtype):
    for name in args.models.split(","):
        model = build_model(name, device, dtype)
        for b in [int(x) for x in args.batches.split(",")]:
            audio = waveforms(b)
            modes = [("graphs", True, args.new_tokens)] + ([("eager", False, args.new_tokens)] if args.eager else [])
            if args.breakdown:  # one decode step: encoder + features + setup, the rest is decoding
                modes.append(("graphs_1tok", True, 1))
            for mode, graphs, new_tokens in modes:
                try:
                    runner = make_runner(model, args.backend, b, new_tokens, graphs)
                    hyps = []
                    dt = time_it(lambda r=runner, a=audio, h=hyps: h.append(r.recognize(a)), args.repeats)
                    ntok = len(hyps[-1][0].tokens)
                    emit(system=f"polyaccel_{mode}", model=name, batch=b, new_tokens=ntok, wall_s=round(dt, 4),
                         rtfx=round(AUDIO_S * b / dt, 1), features_included=True, device=_device_name())
                except Exception as e:  # keep the sweep going; the error is the result
                    emit(system=f"polyaccel_{mode}", model=name, batch=b, error=repr(e)[:400])
                finally:
                    runner = None
                    torch.cuda.empty_cache() if torch.cuda.is_available() else None
        del model


def section_exact(args, device, dtype):
    """Greedy tokens through graphs == eager, batch by batch, on a real-sized model."""
    name = args.models.split(",")[0]
    model = build_model(name, device, dtype)
    audio = waveforms(8, seed=1)
    from polyaccel.asr.runner import ASRRunner

    ref = ASRRunner(model, backend=args.backend, batch_buckets=(1,), max_new_tokens=24,
                    use_graphs=False).recognize(audio[:1])[0].tokens
    for b in (1, 3, 8):
        got = ASRRunner(model, backend=args.backend, batch_buckets=(1, 2, 4, 8), max_new_tokens=24,
                        use_graphs=True).recognize(audio[:b])
        eager = ASRRunner(model, backend=args.backend, batch_buckets=(b,), max_new_tokens=24,
                          use_graphs=False).recognize(audio[:b])
        same = [g.tokens == e.tokens for g, e in zip(got, eager)]
        emit(check="graphs_vs_eager", model=name, batch=b, exact=all(same) and got[0].tokens == ref,
             rows_equal=sum(same), first_tokens=got[0].tokens[:8])


# ---- runtime comparison: ReplicaPool vs threaded queue vs process pool ----------------------

_RT: dict = {}


def _runtime_factory(index: int):
    """Replica for the runtime comparison; in a child process it builds its own model."""
    cfg = _RT.get("cfg") or json.loads(os.environ["POLYACCEL_BENCH_RT"])
    if "model" not in _RT:
        _RT["cfg"] = cfg
        _RT["model"] = build_model(cfg["model"], cfg["device"], getattr(torch, cfg["dtype"]))
    return _Replica(_RT["model"], cfg, index)


class _Replica:
    """One replica: its own runner (graphs, decoder state) and its own CUDA stream."""

    def __init__(self, model, cfg, index):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.runner = make_runner(model, cfg["backend"], cfg["batch"], cfg["new_tokens"], True)
        with self._on_stream():
            self.runner.recognize(waveforms(cfg["batch"], seed=index))  # capture before timing
        sync()

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else _Null()

    def process(self, batch):
        with self._on_stream():
            hyps = self.runner.recognize(batch)
        return [len(h.tokens) for h in hyps]


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def section_runtime(args, device, dtype):
    from polyaccel.core.runtime import ProcessPoolBaseline, ReplicaPool, ThreadedQueueBaseline

    name = args.runtime_model
    cfg_base = {"model": name, "device": device, "dtype": str(dtype).split(".")[-1], "backend": args.backend,
                "new_tokens": args.runtime_tokens}
    for b in [int(x) for x in args.runtime_batches.split(",")]:
        cfg = {**cfg_base, "batch": b}
        _RT.clear()
        _RT["cfg"] = cfg
        # built here, once: replica threads must not draw CUDA random numbers while another captures
        _RT["model"] = build_model(name, device, dtype)
        os.environ["POLYACCEL_BENCH_RT"] = json.dumps(cfg)
        n_items = b * args.replicas * args.runtime_rounds
        items = waveforms(min(n_items, 64))
        items = [items[i % len(items)] for i in range(n_items)]
        systems = [("replica_pool", lambda b=b: ReplicaPool(_runtime_factory, args.replicas, batch_size=b,
                                                        queue_capacity=4 * b * args.replicas)),
                   ("threaded_queue", lambda b=b: ThreadedQueueBaseline(_runtime_factory, args.replicas, batch_size=b)),
                   ("process_pool", lambda b=b: ProcessPoolBaseline(_runtime_factory, args.replicas, batch_size=b))]
        for sys_name, make in systems:
            if sys_name not in args.runtime_systems.split(","):
                continue
            try:
                with make() as pool:
                    list(pool.map(items[: b * args.replicas]))  # warm every replica
                    sync()
                    t = time.perf_counter()
                    results = list(pool.map(items))
                    sync()
                    dt = time.perf_counter() - t
                ok = sum(1 for r in results if r.ok)
                emit(system=sys_name, model=name, batch=b, replicas=args.replicas, items=n_items, ok=ok,
                     wall_s=round(dt, 3), rtfx=round(AUDIO_S * n_items / dt, 1), features_included=True)
            except Exception as e:
                emit(system=sys_name, model=name, batch=b, error=repr(e)[:400])
        _RT.clear()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def section_profile(args, device, dtype):
    """Top GPU kernels of one recognize() call at the largest batch (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    name, b = args.models.split(",")[0], max(int(x) for x in args.batches.split(","))
    model = build_model(name, device, dtype)
    runner = make_runner(model, args.backend, b, args.new_tokens, True)
    audio = waveforms(b)
    runner.recognize(audio)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.recognize(audio)
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table, file=sys.stderr)
    out = os.environ.get("OUT")
    if out:
        Path(out, "asr_profile.txt").write_text(table)


def section_anchor(args):
    path = Path(args.anchor_dir) / "anchor_asr_hf.py"
    if not path.is_file():
        emit(system="hf_anchor", error=f"{path} not found (copy ../shared/anchors into --anchor-dir)")
        return
    spec = importlib.util.spec_from_file_location("anchor_asr_hf", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.argv = [str(path), "--models", args.anchor_models, "--batches", args.batches,
                "--new-tokens", str(args.new_tokens), "--modes", args.anchor_modes]
    mod.main()


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="exact,ours,anchor,runtime")
    p.add_argument("--models", default="whisper-large-v3-turbo,canary-1b-flash-shape")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="also time the eager (no graphs) path")
    p.add_argument("--breakdown", action="store_true", help="also time 1-token decoding (encoder share)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--anchor-dir", default=".anchors")
    p.add_argument("--anchor-models", default="whisper-large-v3-turbo")
    p.add_argument("--anchor-modes", default="generate")
    p.add_argument("--runtime-model", default="whisper-base")
    p.add_argument("--runtime-batches", default="1,8,64")
    p.add_argument("--runtime-tokens", type=int, default=32)
    p.add_argument("--runtime-rounds", type=int, default=4)
    p.add_argument("--runtime-systems", default="replica_pool,threaded_queue,process_pool")
    p.add_argument("--replicas", type=int, default=2)
    args = p.parse_args(argv)

    from polyaccel.core import select_backend

    backend = select_backend(args.backend)
    args.backend = backend.name
    device = "cuda" if backend.device_type == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    emit(info="bench_asr", backend=backend.name, device=_device_name(), torch=torch.__version__,
         date=time.strftime("%Y-%m-%d"))
    sections = args.sections.split(",")
    if "exact" in sections:
        section_exact(args, device, dtype)
    if "ours" in sections:
        section_ours(args, device, dtype)
    if "anchor" in sections and device == "cuda":
        section_anchor(args)
    if "runtime" in sections:
        section_runtime(args, device, dtype)
    if "profile" in sections and device == "cuda":
        section_profile(args, device, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
