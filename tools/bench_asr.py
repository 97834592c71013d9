"""ASR throughput benchmark: our static-graph runner vs Hugging Face `generate()`, side by side.

Prints one JSON line per (system, model, batch). RTFx = seconds of audio / wall seconds.
Our rows start from raw 30 s waveforms in host memory (feature extraction INCLUDED); the
Transformers rows start from log-mel features already on the GPU (feature extraction excluded).
Every system decodes exactly ``--new-tokens`` tokens per utterance (EOS suppressed until
then, as ``min_new_tokens``), random weights, bf16, greedy.

Sections (``--sections``):
  ours     our ASRRunner per model and batch (CUDA graphs on cuda; ``--eager`` adds eager rows,
           ``--invariant`` rows with Whisper's batch-invariant kernels, ``--plain-decode`` rows
           without Whisper's fused decoder step, on by default on CUDA; ``--no-pdl`` rows without
           that step's kernels launched early, programmatic dependent launch, also on by default)
  hf       the free peer from the project itself: Transformers' Whisper ``generate()`` on the same
           shapes (``--hf-modes generate,compile``: as called, and with static cache + torch.compile)
  runtime  ReplicaPool vs a threaded shared-queue loop vs a process pool, same model/graphs
  kernels  launch shapes of the fused decoder step's kernels per decoder weight, at 1 and 16
           rows, in CUDA graphs beside cuBLAS; greedy_pick beside the torch ops it replaces
  profile  kernels of one call per batch (``--plain-decode``: the plain step too): a table per
           call in $OUT, and kernel launches and kernel ms per decoded token
  exact    greedy tokens of graphs == eager at several batch sizes (must print "exact": true)
  lengths  ConformerAED shapes (``--models``) on real-length clips (``--lengths-corpus``, a
           tools/make_asr_corpus.py folder): length-bucketed batches against every clip padded to
           the longest window, the same clips and tokens per clip; RTFx over the real durations
  fp8      real weights (``--fp8-models``) on real speech (``--fp8-corpus`` or the LibriVox
           clips): token agreement and WER of FP8 encoder GEMMs against bf16, and (CUDA) the
           encoder's time per batch of ``--fp8-batch`` in both

Run on a GPU machine (packages on PYTHONPATH, not installed):
  PYTHONPATH=packages/core/src:packages/backend_cuda/src:packages/asr/src \
  POLYACCEL_PLUGINS=polyaccel.cuda.plugin python tools/bench_asr.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_gaps import gpu_busy  # noqa: E402

# name: (d_model, enc_layers, dec_layers, heads, ffn, n_mels, vocab)
WHISPER_SHAPES = {
    "whisper-large-v3-turbo": (1280, 32, 4, 20, 5120, 128, 51866),
    "whisper-large-v3": (1280, 32, 32, 20, 5120, 128, 51866),
    "whisper-small": (768, 12, 12, 12, 3072, 80, 51865),
    "whisper-base": (512, 6, 6, 8, 2048, 80, 51865),
    "whisper-tiny": (384, 4, 4, 6, 1536, 80, 51865),
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
        from polyaccel.asr.conformer import ConformerAED

        with torch.device(device):
            model = ConformerAED(_conformer_preset(name))
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


def _conformer_preset(name: str):
    from polyaccel.asr import conformer_config

    return {"canary-1b-flash-shape": conformer_config.canary_1b_flash_shape,
            "canary-180m-flash-shape": conformer_config.canary_180m_flash_shape}[name]()


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
        _ours_rows(args, name, model, "")
        if args.fp8 and _encoder_to_fp8(name, model, cross_kv=False):
            _ours_rows(args, name, model, "_fp8enc")
            model.fp8_cross_kv = True
            _ours_rows(args, name, model, "_fp8")
        del model


def _encoder_to_fp8(name, model, cross_kv: bool = True) -> bool:
    """``--fp8``: the model's encoder GEMMs in FP8 (and with ``cross_kv`` the decoder's
    cross-attention K/V in e4m3); False (an error row) where it cannot be."""
    from polyaccel.asr.fp8 import fp8_encoder

    try:
        fp8_encoder(model, cross_kv=cross_kv)
    except ValueError as e:  # not Whisper, or no FP8 on this GPU
        emit(system="polyaccel_graphs_fp8", model=name, error=str(e)[:400])
        return False
    return True


def _ours_rows(args, name, model, suffix: str) -> None:
    """The ``ours`` rows of one model, every batch size and mode; ``suffix`` ends each system name."""
    for b in [int(x) for x in args.batches.split(",")]:
        audio = waveforms(b)
        modes = [("graphs", True, args.new_tokens)] + ([("eager", False, args.new_tokens)] if args.eager else [])
        if args.breakdown:  # one decode step: encoder + features + setup, the rest is decoding
            modes.append(("graphs_1tok", True, 1))
        if args.invariant:  # what batch invariance costs
            modes.append(("graphs_invariant", True, args.new_tokens))
        if args.plain_decode and hasattr(model, "fused_decode"):  # Whisper without its fused step
            modes.append(("graphs_plain", True, args.new_tokens))
        if args.no_pdl:  # the step's kernels not launched early (programmatic dependent launch)
            modes.append(("graphs_no_pdl", True, args.new_tokens))
        for mode, graphs, new_tokens in modes:
            try:
                _set_dependent_launch(False if mode == "graphs_no_pdl" else None)
                model.batch_invariant = mode == "graphs_invariant"
                if hasattr(model, "fused_decode"):
                    model.fused_decode = False if mode == "graphs_plain" else None
                runner = make_runner(model, args.backend, b, new_tokens, graphs)
                hyps = []
                dt = time_it(lambda r=runner, a=audio, h=hyps: h.append(r.recognize(a)), args.repeats)
                ntok = len(hyps[-1][0].tokens)
                emit(system=f"polyaccel_{mode}{suffix}", model=name, batch=b, new_tokens=ntok, wall_s=round(dt, 4),
                     rtfx=round(AUDIO_S * b / dt, 1), features_included=True, device=_device_name())
            except Exception as e:  # keep the sweep going; the error is the result
                emit(system=f"polyaccel_{mode}{suffix}", model=name, batch=b, error=repr(e)[:400])
            finally:
                runner = None
                gc.collect()  # the runner's graphs and caches, before the next row allocates its own
                _set_dependent_launch(None)
                model.batch_invariant = False
                if hasattr(model, "fused_decode"):
                    model.fused_decode = None
                torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _set_dependent_launch(on: bool | None) -> None:
    """Programmatic dependent launch for the CUDA backend's decoder-step kernels (read when a
    graph is captured); ``None``: as ``POLYACCEL_CUDA_PDL`` says (on unless it is 0)."""
    with contextlib.suppress(ImportError):
        from polyaccel.cuda import _triton

        _triton.DEPENDENT_LAUNCH = os.environ.get("POLYACCEL_CUDA_PDL", "1") != "0" if on is None else on


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
    """GPU kernels of one recognize() call per batch of ``--batches`` (where the time goes):
    the default step (fused on CUDA), and the plain step too with ``--plain-decode``. Tables go to
    stderr and ``$OUT/asr_profile_<mode>_b<batch>.txt``; a row per call gives kernel launches
    and kernel milliseconds per decoded token (whole call, encoder included)."""
    from torch.profiler import ProfilerActivity, profile

    name = args.models.split(",")[0]
    model = build_model(name, device, dtype)
    modes = ["graphs"] + (["graphs_plain"] if args.plain_decode and hasattr(model, "fused_decode") else [])
    if args.fp8:  # the FP8 encoder's calls only
        if not _encoder_to_fp8(name, model):
            return
        modes = [m + "_fp8" for m in modes]
    for b in [int(x) for x in args.batches.split(",")]:
        audio = waveforms(b)
        for mode in modes:
            if hasattr(model, "fused_decode"):
                model.fused_decode = False if mode.startswith("graphs_plain") else None
            runner = make_runner(model, args.backend, b, args.new_tokens, True)
            runner.recognize(audio)
            sync()
            with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.profile_ops else [])
                         ) as prof:
                t0 = time.perf_counter()
                runner.recognize(audio)
                sync()
                wall_ms = (time.perf_counter() - t0) * 1e3
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=120)
            print(table, file=sys.stderr)
            out = os.environ.get("OUT")
            if out:
                Path(out, f"asr_profile_{mode}_b{b}.txt").write_text(table)
                if args.profile_ops:  # the torch ops behind the kernels, by their kernels' total time
                    Path(out, f"asr_profile_ops_{mode}_b{b}.txt").write_text(prof.key_averages(group_by_input_shape=True).table(
                        sort_by="cuda_time_total", row_limit=60, max_name_column_width=60, max_shapes_column_width=90))
            emit(system=f"profile_{mode}", model=name, batch=b, new_tokens=args.new_tokens,
                 kernels_per_token=round(len(kernels) / args.new_tokens, 1),
                 kernel_ms_per_token=round(sum(e.device_time for e in kernels) / 1e3 / args.new_tokens, 4),
                 wall_ms=round(wall_ms, 2), **gpu_busy(kernels))
            runner = None
            torch.cuda.empty_cache()
    if hasattr(model, "fused_decode"):
        model.fused_decode = None


def graph_us(fn, calls: int = 20, rounds: int = 7) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls
    (how a captured decoder step runs it: no launch overhead from Python)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _gemm_candidates(N: int, K: int):
    from polyaccel.cuda.fused_decode import GemmConfig

    widths = (64, 128) if N > 8192 else (16, 32)
    for split in (1, 2, 4, 8):
        for block_n in widths:
            for block_k in (128, 256, 512):
                if split > 1 and (N > 8192 or -(-K // split) < block_k // 2):
                    continue
                yield GemmConfig(block_n, block_k, split, 4, 4)
                if block_k == 512:
                    yield GemmConfig(block_n, block_k, split, 8, 3)
    # then other warps and pipeline depths around the usual tiles
    for split in (1, 8) if K > 2 * N else (1,):
        for block_n in widths:
            for block_k in (128, 256):
                if split > 1 and (N > 8192 or -(-K // split) < block_k // 2):
                    continue
                for warps, stages in ((2, 4), (8, 4), (4, 2), (4, 3), (4, 6)):
                    yield GemmConfig(block_n, block_k, split, warps, stages)


COLD_BYTES = 256 << 20
"""Bytes of weight copies a kernel row cycles through (several times an H200's 50 MB L2)."""


def section_kernels(args, device, dtype):
    """Launch shapes for the fused decoder step's kernels (``polyaccel.cuda.fused_decode``),
    each Whisper decoder weight of the first ``--models`` shape at 1 and 16 rows, per call in a
    CUDA graph beside cuBLAS (core's references), every call reading its weights from memory
    (:data:`COLD_BYTES`); and ``greedy_pick`` beside the torch ops it replaces. Rows are
    checked against the references before they are timed."""
    from polyaccel.core import ops
    from polyaccel.cuda import fused_decode as fd

    name = args.models.split(",")[0]
    if name in CONFORMER_SHAPES:  # its decoder step's one Triton op: the cross-attention
        cfg = _conformer_preset(name)
        heads = cfg.decoder_heads
        _cross_attention_splits(args, device, dtype, heads, cfg.decoder_dim // heads,
                                frames=-(-int(AUDIO_S * 100) // 8), fp8=False)
        return
    d, _, _, heads, ffn, _, vocab = WHISPER_SHAPES[name]

    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=device)).to(dtype)

    cases = {"o_proj": (d, d, "res"), "cross_q": (d, d, "ln"), "fc1": (ffn, d, "ln_gelu"), "fc2": (d, ffn, "res"),
             "lm_head": (vocab, d, "ln_fp32"), "qkv": (d, d, "qkv")}
    budget = args.kernels_budget / len(cases)
    for case, (N, K, kind) in cases.items():
        w, b = rand(N, K, scale=K ** -0.5), (None if kind == "ln_fp32" else rand(N, scale=0.1))
        ln = (1 + rand(K, scale=0.1), rand(K, scale=0.1), 1e-5)
        ws = [w, rand(N, K, scale=K ** -0.5), rand(N, K, scale=K ** -0.5)]
        inputs = {M: (1 + rand(M, K), rand(M, N), [rand(M, heads, 448, N // heads) for _ in range(2)],
                      torch.full((M,), 7, device=device, dtype=torch.int64)) for M in (1, 16)}
        # In a decoder step a weight is read again only a token later, after ~300 MB of others:
        # from memory, not L2. Each call here takes the next of enough equal copies that
        # together are several times the L2, so no call finds its weight there.
        copies = [(w, ws)] + [(w.clone(), [t.clone() for t in ws])
                              for _ in range(max(1, -(-COLD_BYTES // (w.nbytes * (3 if kind == "qkv" else 1)))) - 1)]
        turn = itertools.count()

        def run(cfg, M, b=b, ln=ln, kind=kind, inputs=inputs, copies=copies, turn=turn):
            w, ws = copies[next(turn) % len(copies)]
            x, res, cache, pos = inputs[M]
            if kind == "qkv":
                return fd.ln_qkv_into_cache_(x, *ln, ws, [b, None, b], cache[0], cache[1], pos)
            if kind == "res":
                return fd._linear(x, w, b, residual=res, out_dtype=dtype, config=cfg)
            return fd._linear(x, w, b, ln=ln, gelu=kind == "ln_gelu",
                              out_dtype=torch.float32 if kind == "ln_fp32" else dtype, config=cfg)

        def reference(M, b=b, ln=ln, kind=kind, inputs=inputs, copies=copies, turn=turn):
            w, ws = copies[next(turn) % len(copies)]
            x, res, cache, pos = inputs[M]
            if kind == "qkv":
                return ops.ln_qkv_into_cache_.reference(x, *ln, ws, [b, None, b], cache[0], cache[1], pos)
            if kind == "res":
                return ops.linear_residual.reference(x, w, b, res)
            return ops.ln_linear.reference(x, *ln, w, b, "gelu" if kind == "ln_gelu" else None,
                                           torch.float32 if kind == "ln_fp32" else None)

        def timed(cfg, M, want, N=N, K=K, case=case, kind=kind, run=run) -> float | None:
            shipped = fd._config
            try:
                if kind == "qkv":
                    fd._config = lambda *_, **__: cfg
                got = run(cfg, M).float()
                err = ((got - want).norm() / want.norm()).item()
                us = graph_us(lambda: run(cfg, M)) if err < 2e-2 else None
                emit(system="kernel_fused", case=case, rows=M, N=N, K=K, config=list(cfg), rel_err=round(err, 5),
                     us=None if us is None else round(us, 2))
                return us
            except Exception as e:  # a launch shape Triton refuses: the error is the row
                emit(system="kernel_fused", case=case, rows=M, config=list(cfg), error=repr(e)[:200])
                return None
            finally:
                fd._config = shipped

        wants = {M: reference(M).float() for M in (1, 16)}
        for M in (1, 16):
            emit(system="kernel_cublas", case=case, rows=M, N=N, K=K, us=round(graph_us(lambda M=M: reference(M)), 2))
        shipped_cfg = fd._config(N, K, dtype, parts=3 if kind == "qkv" else 1)
        deadline = time.monotonic() + budget
        found = {}
        for cfg in [shipped_cfg] + [c for c in _gemm_candidates(N, K) if c != shipped_cfg]:
            if time.monotonic() > deadline:
                break
            if kind == "qkv" and cfg.split_k > 1:
                continue
            us = timed(cfg, 1, wants[1])
            if us is not None:
                found[cfg] = us
        for cfg in sorted(found, key=found.get)[:4] + [shipped_cfg]:  # the best at one row, at 16 rows
            timed(cfg, 16, wants[16])
    for M in (1, 16):
        logits = torch.randn(M, vocab, generator=g, device=device)
        bias = torch.zeros(vocab, device=device)
        emit(system="pick_torch", rows=M, us=round(graph_us(lambda lg=logits, bs=bias: ops.greedy_pick.reference(lg, bs)), 2))
        shipped = fd.PICK_PART
        for part in (1024, 2048, 4096, 8192):
            fd.PICK_PART = part
            same = torch.equal(fd.greedy_pick(logits, bias)[0], ops.greedy_pick.reference(logits, bias)[0])
            emit(system="pick_fused", rows=M, part=part, same=same,
                 us=round(graph_us(lambda lg=logits, bs=bias: fd.greedy_pick(lg, bs)), 2))
        fd.PICK_PART = shipped
    _cross_attention_splits(args, device, dtype, heads, d // heads)


def _cross_attention_splits(args, device, dtype, heads: int, head_dim: int, frames: int = 1500,
                            fp8: bool = True) -> None:
    """Cross-attention's key splits (``polyaccel.cuda.decode_attention.SplitConfig``) at 1, 16
    and 128 rows over the encoder's frames, with ``dtype`` keys and with e4m3 keys and values
    (``--fp8-encoder``'s cross-attention), beside core's reference: each launch checked against
    the reference and for the same bits alone and in a batch, then timed in a CUDA graph."""
    from polyaccel.core import ops
    from polyaccel.cuda import decode_attention as da

    g = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(128, heads, n, head_dim, generator=g, device=device).to(dtype) for n in (1, frames, frames))
    (k8, ks), (v8, vs) = ((x.view(k.shape), s.view(k.shape[:-1])) for x, s in (ops.rows_to_fp8(t) for t in (k, v)))
    kinds = {"": ((q, k, v), {}, ops.decode_attention.reference(q.float(), k.float(), v.float()),
                  da.config_for(head_dim, False)),
             "_fp8": ((q, k8, v8), {"k_scale": ks, "v_scale": vs},
                      ops.decode_attention.reference(q, k8, v8, None, ks, vs).float(), da.config_for(head_dim, True))}
    if not fp8:
        del kinds["_fp8"]
    configs = [da.config_for(head_dim, False), da.config_for(head_dim, True)] + [
        da.SplitConfig(n, b, w) for n in (1, 2, 3, 4, 6, 12, 24) for b in (32, 64, 128, 256, 512) for w in (2, 4, 8)
        if -(-frames // n) >= b // 2 and b * head_dim <= 65536 and (w != 2 or b <= 128)]
    deadline = time.monotonic() + args.kernels_budget / 4
    turn = itertools.count()

    def rows(M: int) -> slice:  # one row: each call the next of 128 (keys not in L2)
        r = next(turn) % 128 if M == 1 else 0
        return slice(r, r + M)

    for M in (1, 16, 128):
        emit(system="cross_attn_torch", rows=M, us=round(graph_us(
            lambda M=M: ops.decode_attention.reference(*(t[rows(M)] for t in (q, k, v)))), 2))
    for config in dict.fromkeys(configs):
        if time.monotonic() > deadline:
            break
        for kind, (qkv, scales, want, shipped) in kinds.items():
            def call(M: int, c=config, qkv=qkv, scales=scales):
                sl = rows(M)
                return da.decode_attention(*(t[sl] for t in qkv), **{n: t[sl] for n, t in scales.items()}, config=c)

            full = da.decode_attention(*qkv, **scales, config=config)
            err = ((full.float() - want).norm() / want.norm()).item()
            same = torch.equal(da.decode_attention(*(t[:1] for t in qkv), **{n: t[:1] for n, t in scales.items()},
                                                   config=config), full[:1])
            for M in (1, 16, 128):
                emit(system=f"cross_attn_fused{kind}", rows=M, config=list(config), rel_err=round(err, 5), same=same,
                     shipped=config == shipped, us=round(graph_us(lambda M=M, call=call: call(M)), 2))


def _speech(args) -> tuple[list[np.ndarray], list[str | None]]:
    """(waveforms at 16 kHz, references or None): ``--fp8-corpus`` (tools/make_asr_corpus.py,
    files up to 30 s, at most ``--fp8-files``) or the five LibriVox clips."""
    from polyaccel.asr.audio import load_audio

    if args.fp8_corpus:
        paths, refs, durations = corpus_items(Path(args.fp8_corpus), None)
        keep = [p for p in paths if durations[Path(p).stem] <= 30.0][: args.fp8_files]
        return [load_audio(p, 16000) for p in keep], [refs.get(Path(p).stem) for p in keep]
    import re

    from polyaccel.asr import samples

    folder = samples.librivox_dir()
    refs = dict((m.group(2), m.group(1).strip()) for line in (folder / "transcription").read_text().splitlines()
                if (m := re.match(r"<s>(.*)</s>\s*\((\S+)\)", line.strip())))
    names = sorted(refs)
    return [load_audio(str(folder / f"{n}.wav"), 16000) for n in names], [refs[n] for n in names]


def section_lengths(args, device, dtype):
    """Variable-length batching measured: the same real-length clips through one runner twice,
    as they are (sorted into frame buckets, each batch padded to its own bucket) and each padded
    to the model's longest window (what batching without buckets costs); ``--new-tokens``
    tokens per clip in both, so only the audio-dependent work differs."""
    from polyaccel.asr.audio import load_audio

    if not args.lengths_corpus:
        raise SystemExit("--sections lengths needs --lengths-corpus DIR (tools/make_asr_corpus.py)")
    paths, _, durations = corpus_items(Path(args.lengths_corpus), None)
    for name in [m for m in args.models.split(",") if m in CONFORMER_SHAPES or m == "tiny-conformer"]:
        model = _tiny_conformer(device, dtype) if name == "tiny-conformer" else build_model(name, device, dtype)
        longest = int(model.max_audio_seconds() * 16000)
        short = [p for p in paths if durations[Path(p).stem] * 16000 <= longest][: args.lengths_files]
        clips = [load_audio(p, 16000) for p in short]
        real_s = sum(len(c) for c in clips) / 16000
        padded = [np.pad(c, (0, longest - len(c))) for c in clips]
        runner = make_runner(model, args.backend, args.lengths_batch, args.new_tokens, device == "cuda")
        for mode, audio in (("length_buckets", clips), ("padded_to_longest", padded)):
            dt = time_it(lambda a=audio, r=runner: r.recognize(a), args.repeats)
            emit(system=f"polyaccel_{mode}", model=name, batch=args.lengths_batch, clips=len(clips),
                 audio_s=round(real_s, 1), new_tokens=args.new_tokens, wall_s=round(dt, 4),
                 rtfx=round(real_s / dt, 1), device=_device_name())
        runner = model = None
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def _tiny_conformer(device: str, dtype: torch.dtype):
    """The tiny ConformerAED of the tests (a CPU dry run of ``--sections lengths``)."""
    from polyaccel.asr import conformer_config
    from polyaccel.asr.conformer import ConformerAED

    return ConformerAED.from_config(conformer_config.tiny(), seed=0).to(device=device, dtype=dtype).eval()


def section_fp8(args, device):
    """FP8 encoder GEMMs (polyaccel.asr.fp8) against bf16 on real weights and speech."""
    from polyaccel.asr.fp8 import fp8_encoder
    from polyaccel.asr.runner import ASRRunner
    from polyaccel.asr.text import wer
    from polyaccel.asr.whisper import WhisperASR

    audio, refs = _speech(args)
    scored = [i for i, r in enumerate(refs) if r]
    for name in args.fp8_models.split(","):
        model = WhisperASR.from_pretrained(name, device=device, dtype=torch.bfloat16)
        rows = {}
        for label in ("bf16", "fp8"):
            if label == "fp8":
                fp8_encoder(model)
            runner = ASRRunner(model, backend=args.backend, batch_buckets=(args.fp8_batch,),
                               use_graphs=device == "cuda")
            hyps = runner.recognize(audio)
            enc_s = None
            if device == "cuda":  # the encoder alone, one batch of --fp8-batch windows
                feats, lengths = model.compute_features([audio[i % len(audio)] for i in range(args.fp8_batch)])
                with torch.inference_mode():
                    enc_s = time_it(lambda m=model, f=feats, n=lengths: m.encode(f, n), args.repeats)
            rows[label] = (hyps, enc_s)
        (ref_h, ref_s), (fp8_h, fp8_s) = rows["bf16"], rows["fp8"]
        same = sum(a.tokens == b.tokens for a, b in zip(ref_h, fp8_h, strict=True))
        emit(system="fp8_encoder", model=name, files=len(audio), identical=same,
             agreement=round(same / len(audio), 4),
             wer_bf16=round(wer([refs[i] for i in scored], [ref_h[i].text for i in scored]), 4) if scored else None,
             wer_fp8=round(wer([refs[i] for i in scored], [fp8_h[i].text for i in scored]), 4) if scored else None,
             batch=args.fp8_batch, encoder_ms_bf16=None if ref_s is None else round(ref_s * 1e3, 3),
             encoder_ms_fp8=None if fp8_s is None else round(fp8_s * 1e3, 3), device=_device_name())


def build_hf_whisper(name: str, device: str, dtype: torch.dtype):
    """Transformers' own Whisper at a ``WHISPER_SHAPES`` shape, its own random init."""
    from transformers import WhisperConfig as HFWhisperConfig
    from transformers import WhisperForConditionalGeneration

    d, el, dl, h, f, mels, vocab = WHISPER_SHAPES[name]
    cfg = HFWhisperConfig(vocab_size=vocab, num_mel_bins=mels, d_model=d, encoder_layers=el, decoder_layers=dl,
                          encoder_attention_heads=h, decoder_attention_heads=h, encoder_ffn_dim=f,
                          decoder_ffn_dim=f, max_source_positions=1500, max_target_positions=448)
    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperForConditionalGeneration(cfg)
    model = model.to(dtype=dtype).eval()
    gen = model.generation_config
    gen.decoder_start_token_id, gen.forced_decoder_ids, gen.suppress_tokens, gen.begin_suppress_tokens = (
        50258, None, None, None)
    gen.max_length = gen.min_length = None  # max_new_tokens / min_new_tokens rule
    return model


def hf_generate(model, features: torch.Tensor, new_tokens: int) -> int:
    """Greedy ``generate()`` of exactly ``new_tokens`` tokens (EOS held off by ``min_new_tokens``)."""
    start = torch.full((features.shape[0], 1), 50258, device=features.device)
    with torch.inference_mode():
        out = model.generate(features, decoder_input_ids=start, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, num_beams=1)
    return int(out.shape[-1]) - int(bool((out[:, 0] == 50258).all()))  # Whisper may drop the start token


def section_hf(args, device, dtype):
    """The free peer, run from here: Transformers' Whisper ``generate()`` on the same shapes.

    Modes (``--hf-modes``): ``generate`` as a user calls it; ``compile``, Transformers' documented
    speed-up (static KV cache and ``torch.compile(forward, mode="reduce-overhead")``). Inputs are
    log-mel features already on the device, so the peer's feature extraction is not counted.
    """
    for name in args.models.split(","):
        if name not in WHISPER_SHAPES:
            continue
        for mode in args.hf_modes.split(","):
            model = build_hf_whisper(name, device, dtype)
            if mode == "compile":
                model.generation_config.cache_implementation = "static"
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
            elif mode != "generate":
                raise SystemExit(f"unknown --hf-modes entry {mode!r} (generate, compile)")
            for b in [int(x) for x in args.batches.split(",")]:
                feats = torch.randn(b, model.config.num_mel_bins, 3000, device=device, dtype=dtype)
                try:
                    counts = []
                    dt = time_it(lambda m=model, f=feats, c=counts: c.append(hf_generate(m, f, args.new_tokens)),
                                 args.repeats)
                    emit(system=f"hf_{mode}", model=name, batch=b, new_tokens=counts[-1], wall_s=round(dt, 4),
                         rtfx=round(AUDIO_S * b / dt, 1), features_included=False, device=_device_name())
                except Exception as e:  # keep the sweep going; the error is the result
                    emit(system=f"hf_{mode}", model=name, batch=b, error=repr(e)[:400])
            del model
            torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ---- end to end: the CLI's path over a real-length corpus, vs the Transformers pipeline -------

E2E_STAGES = ("decode", "resample", "prepare", "features", "model")


class StageClock:
    """Wall and thread-CPU seconds per stage, summed over threads (thread-safe)."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self._active = threading.local()  # stages being timed on this thread
        self.wall = dict.fromkeys(E2E_STAGES, 0.0)
        self.cpu = dict.fromkeys(E2E_STAGES, 0.0)
        self.batches: list[tuple[float, float]] = []  # (start, end) of each recognize batch

    def wrap(self, stage: str, fn, minus: str | None = None):
        """``fn`` timed into ``stage``; time spent in ``minus`` inside the call is not counted
        twice, nor is a call nested in another of the same stage (sf.read calls SoundFile.read)."""
        def timed(*a, **k):
            active = self._active.__dict__.setdefault("stages", set())
            if stage in active:
                return fn(*a, **k)
            active.add(stage)
            w0, c0 = time.perf_counter(), time.thread_time()
            inner0 = (self.wall[minus], self.cpu[minus]) if minus else (0.0, 0.0)
            try:
                return fn(*a, **k)
            finally:
                active.discard(stage)
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                with self.lock:
                    if minus:  # other threads may add to `minus` meanwhile: an estimate, clamped
                        w = max(0.0, w - (self.wall[minus] - inner0[0]))
                        c = max(0.0, c - (self.cpu[minus] - inner0[1]))
                    self.wall[stage] += w
                    self.cpu[stage] += c
        return timed

    def as_dict(self) -> dict:
        return {"cpu_s": {k: round(v, 3) for k, v in self.cpu.items()},
                "wall_s_by_stage": {k: round(v, 3) for k, v in self.wall.items()}}


def instrument(clock: StageClock):
    """Time decode (soundfile), resample (soxr), the rest of waveform preparation, features and
    the model inside the unchanged CLI path, by wrapping the functions it calls. Returns a
    function that puts the originals back."""
    import soundfile
    import soxr

    from polyaccel.asr import audio, runner, transcriber

    saved = [(soundfile, "read"), (soundfile, "info"), (soundfile.SoundFile, "read"), (soxr, "resample"),
             (soxr.ResampleStream, "resample_chunk"), (audio, "prepare_waveform"),
             (transcriber, "prepare_waveform"), (runner.ASRRunner, "_recognize_batch")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in saved]
    soundfile.read = clock.wrap("decode", soundfile.read)
    soundfile.info = clock.wrap("decode", soundfile.info)
    soundfile.SoundFile.read = clock.wrap("decode", soundfile.SoundFile.read)  # streamed decoding
    soxr.resample = clock.wrap("resample", soxr.resample)
    soxr.ResampleStream.resample_chunk = clock.wrap("resample", soxr.ResampleStream.resample_chunk)
    audio.prepare_waveform = clock.wrap("prepare", audio.prepare_waveform, minus="resample")
    transcriber.prepare_waveform = audio.prepare_waveform
    batch_fn = runner.ASRRunner._recognize_batch

    def recognize_batch(self, wave):
        t0 = time.perf_counter()
        cls = type(self.model)
        with clock.lock:  # replicas share the model: wrap its class once, never the instance
            if (cls, "compute_features") not in wrapped:
                saved.append((cls, "compute_features", cls.compute_features))
                cls.compute_features = clock.wrap("features", cls.compute_features)
                wrapped.add((cls, "compute_features"))
        try:
            return clock.wrap("model", batch_fn, minus="features")(self, wave)
        finally:
            with clock.lock:
                clock.batches.append((t0, time.perf_counter()))

    wrapped: set = set()
    runner.ASRRunner._recognize_batch = recognize_batch

    def restore() -> None:
        for obj, name, fn in saved:
            setattr(obj, name, fn)

    return restore


class GpuSampler:
    """GPU utilization (NVML: share of time a kernel ran) sampled every ``period`` s in a thread."""

    def __init__(self, period: float = 0.1):
        import threading

        self.period, self.samples, self._stop = period, [], threading.Event()
        self._read = self._nvml_reader()
        self._thread = threading.Thread(target=self._run, daemon=True) if self._read else None

    @staticmethod
    def _nvml_reader():
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            return None

    def _run(self):
        while not self._stop.wait(self.period):
            try:
                self.samples.append((time.perf_counter(), self._read()))
            except Exception:
                return

    def __enter__(self):
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join()

    def mean(self, t0: float = float("-inf"), t1: float = float("inf")) -> float | None:
        vals = [u for t, u in self.samples if t0 <= t <= t1]
        return round(sum(vals) / len(vals), 1) if vals else None


def corpus_items(corpus: Path, limit: int | None) -> tuple[list[str], dict[str, str], dict[str, float]]:
    """(audio paths in manifest order, references by id, durations by id) of a make_asr_corpus folder."""
    recs = [json.loads(line) for line in (corpus / "manifest.jsonl").read_text().splitlines() if line.strip()]
    recs = recs[:limit] if limit else recs
    paths = [str(corpus / r["path"]) for r in recs]
    return paths, {r["id"]: r["text"] for r in recs if r.get("text")}, {r["id"]: r["duration_s"] for r in recs}


def corpus_wer(texts: dict[str, str], refs: dict[str, str], durations: dict[str, float]) -> dict:
    """Corpus WER (normalized) over the files with a reference: all, up to 35 s, and longer."""
    from polyaccel.asr.wer import wer_counts

    out = {}
    for key, keep in (("wer", lambda d: True), ("wer_short", lambda d: d <= 35.0), ("wer_long", lambda d: d > 35.0)):
        ids = [i for i in refs if i in texts and keep(durations[i])]
        if ids:
            c = wer_counts([refs[i] for i in ids], [texts[i] for i in ids])
            out[key] = round(c.wer, 4)
            out[key.replace("wer", "files")] = len(ids)
    out["ref_words"] = sum(len(refs[i].split()) for i in refs if i in texts)
    out["wer_files"] = out.pop("files", 0)
    return out


def e2e_ours(args, corpus: Path, batch: int) -> dict:
    """One run of ``polyaccel-asr transcribe`` (model load included) over the corpus, instrumented."""
    from polyaccel.asr import cli

    paths, refs, durations = corpus_items(corpus, args.limit)
    clock = StageClock()
    restore = instrument(clock)
    fp8 = "f8" if args.e2e_fp8 else ""
    label = f"b{batch}" if batch else "default"
    out = Path(args.e2e_out) / f"ours_{label}{f'x{args.e2e_replicas}' if args.e2e_replicas else ''}{fp8}.jsonl"
    argv = ["transcribe", *paths, "-o", str(out), "--model", args.e2e_model, "--backend", args.backend,
            "--overwrite", "-q"]
    if batch:  # batch 0: the CLI's own defaults (batch size and dtype)
        argv += ["--batch-size", str(batch)] + (["--dtype", args.e2e_dtype] if args.device == "cuda" else [])
    if args.e2e_replicas:
        argv += ["--replicas", str(args.e2e_replicas)]
    if args.e2e_fp8:
        argv += ["--fp8-encoder"]
    cpu0, t0 = os.times(), time.perf_counter()
    try:
        with GpuSampler() as gpu:
            rc = cli.main(argv)
    finally:
        restore()
    wall, cpu1 = time.perf_counter() - t0, os.times()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    ok = [r for r in recs if not r.get("error")]
    first = min((b for _, b in clock.batches), default=t0)
    last = max((b for _, b in clock.batches), default=t0)
    texts = {Path(r["path"]).stem: r["text"] for r in ok}
    audio_s = sum(durations[Path(r["path"]).stem] for r in ok)
    return {"system": "polyaccel_e2e" + ("_fp8" if args.e2e_fp8 else ""), "model": args.e2e_model,
            "batch": batch or "default",
            "replicas": args.e2e_replicas,
            "rc": rc, "files": len(recs),
            "failed": len(recs) - len(ok), "audio_s": round(audio_s, 1), "wall_s": round(wall, 3),
            "first_batch_s": round(first - t0, 3), "files_per_s": round(len(recs) / wall, 2),
            "rtfx": round(audio_s / wall, 1), "steady_rtfx": round(audio_s / max(last - first, 1e-9), 1),
            "gpu_busy_pct": gpu.mean(first, last), "gpu_busy_pct_all": gpu.mean(),
            "process_cpu_s": round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system), 2),
            "cores": os.cpu_count(), **clock.as_dict(), **corpus_wer(texts, refs, durations)}


def _load16k(path: str) -> dict:
    from polyaccel.asr.audio import load_audio

    return {"raw": load_audio(path, 16000), "sampling_rate": 16000}


def e2e_hf(args, corpus: Path, batch: int) -> dict:
    """Transformers ``pipeline("automatic-speech-recognition")`` over the corpus: same weights and
    dtype, 30 s chunks for long files, and audio decoded the same way (our load_audio) on a
    thread pool ahead of the pipeline (the pipeline itself runs chunked inputs with at most one
    DataLoader worker)."""
    from concurrent.futures import ThreadPoolExecutor

    import transformers

    from polyaccel.asr.weights import resolve_model

    paths, refs, durations = corpus_items(corpus, args.limit)
    hf_dir = str(resolve_model(args.e2e_model))
    generate_kwargs = {} if _english_only(hf_dir) else {"language": "en", "task": "transcribe"}
    threads = args.e2e_hf_workers or max(1, (os.cpu_count() or 1) - 2)
    t0 = time.perf_counter()
    with GpuSampler() as gpu, ThreadPoolExecutor(threads) as pool:
        pipe = transformers.pipeline("automatic-speech-recognition", model=hf_dir,
                                     device=0 if args.device == "cuda" else -1,
                                     dtype=getattr(torch, args.e2e_dtype) if args.device == "cuda" else torch.float32,
                                     chunk_length_s=30)
        t_load = time.perf_counter()
        audio = pool.map(_load16k, paths)  # in order, decoded ahead
        outs = [o["text"] for o in pipe(audio, batch_size=batch, generate_kwargs=generate_kwargs)]
    wall = time.perf_counter() - t0
    texts = {Path(p).stem: t for p, t in zip(paths, outs, strict=True)}
    with open(Path(args.e2e_out) / f"hf_b{batch}.jsonl", "w") as f:
        f.writelines(json.dumps({"path": p, "text": t}) + "\n" for p, t in zip(paths, outs))
    audio_s = sum(durations.values())
    return {"system": "hf_pipeline_e2e", "model": args.e2e_model, "batch": batch, "files": len(outs),
            "audio_s": round(audio_s, 1), "wall_s": round(wall, 3), "load_s": round(t_load - t0, 3),
            "files_per_s": round(len(outs) / wall, 2), "rtfx": round(audio_s / wall, 1),
            "steady_rtfx": round(audio_s / max(wall - (t_load - t0), 1e-9), 1), "gpu_busy_pct_all": gpu.mean(),
            "gpu_busy_pct": gpu.mean(t_load), "decode_threads": threads,
            "transformers": transformers.__version__, **corpus_wer(texts, refs, durations)}


def _english_only(hf_dir: str) -> bool:
    gen = Path(hf_dir, "generation_config.json")
    return gen.is_file() and not json.loads(gen.read_text()).get("is_multilingual", True)


def e2e_prep(args, corpus: Path) -> dict:
    """CPU cost of each preprocessing stage per audio second, on one thread, over the corpus's
    first ``--prep-files`` files (decode, resample, the rest of load_audio); and the cores
    needed to feed the GPU at ``--prep-target-rtfx``."""
    from polyaccel.asr import audio

    clock = StageClock()
    restore = instrument(clock)
    paths, _, _ = corpus_items(corpus, args.prep_files)
    audio_s = 0.0
    try:
        for p in paths:
            audio_s += len(audio.load_audio(p, 16000)) / 16000
    finally:
        restore()
    per_s = {k: clock.cpu[k] / audio_s for k in ("decode", "resample", "prepare")}
    total = sum(per_s.values())
    return {"check": "cpu_preprocessing", "files": len(paths), "audio_s": round(audio_s, 1),
            "cpu_ms_per_audio_s": {k: round(1e3 * v, 3) for k, v in per_s.items()},
            "total_ms_per_audio_s": round(1e3 * total, 3), "one_core_rtfx": round(1 / total, 1),
            "target_rtfx": args.prep_target_rtfx, "cores_needed": round(args.prep_target_rtfx * total, 2)}


def section_e2e(args) -> None:
    """Each row in its own process (its own model load, CUDA context and memory): ours at every
    ``--e2e-batches`` entry (``B`` or ``BxR`` for R replicas), the pipeline at every
    ``--e2e-hf-batches``, and the CPU preprocessing cost."""
    import subprocess

    corpus = Path(args.e2e)
    Path(args.e2e_out).mkdir(parents=True, exist_ok=True)
    from polyaccel.asr.weights import resolve_model

    resolve_model(args.e2e_model)  # convert a CTranslate2 model once, before the timed rows
    systems = args.e2e_systems.split(",")
    rows = [("prep", ["--e2e-batch", "0"])] if "prep" in systems else []
    for entry in args.e2e_batches.split(",") if "ours" in systems else []:
        entry, fp8 = (entry[:-2], True) if entry.endswith("f8") else (entry, False)
        b, _, r = entry.partition("x")
        b = "0" if b == "default" else b
        rows.append(("ours", ["--e2e-batch", b] + (["--e2e-replicas", r] if r else []) + (["--e2e-fp8"] if fp8 else [])))
    rows += [("hf", ["--e2e-batch", b]) for b in args.e2e_hf_batches.split(",") if "hf" in systems]
    base = [sys.executable, os.path.abspath(__file__), "--backend", args.backend, "--dtype", args.dtype,
            "--e2e", str(corpus), "--e2e-model", args.e2e_model, "--e2e-out", args.e2e_out,
            "--e2e-dtype", args.e2e_dtype, "--prep-files", str(args.prep_files),
            "--prep-target-rtfx", str(args.prep_target_rtfx)]
    base += ["--limit", str(args.limit)] if args.limit else []
    base += ["--e2e-replicas", str(args.e2e_replicas)] if args.e2e_replicas else []
    base += ["--e2e-hf-workers", str(args.e2e_hf_workers)] if args.e2e_hf_workers is not None else []
    for system, extra in rows:
        try:
            p = subprocess.run(base + ["--e2e-worker", system, *extra], capture_output=True, text=True,
                               timeout=args.e2e_timeout)
            line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
            if p.returncode == 0 and line:
                print(line, flush=True)
            else:
                emit(system=system, args=extra, error=f"rc={p.returncode}: {p.stderr.strip()[-600:]}")
        except subprocess.TimeoutExpired:
            emit(system=system, args=extra, error=f"timed out after {args.e2e_timeout} s")


def e2e_worker(args) -> None:
    corpus = Path(args.e2e)
    row = {"prep": lambda: e2e_prep(args, corpus), "ours": lambda: e2e_ours(args, corpus, args.e2e_batch),
           "hf": lambda: e2e_hf(args, corpus, args.e2e_batch)}[args.e2e_worker]()
    emit(**row, device=_device_name())


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="exact,ours,hf,runtime")
    p.add_argument("--models", default="whisper-large-v3-turbo,canary-1b-flash-shape")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="also time the eager (no graphs) path")
    p.add_argument("--fp8", action="store_true",
                   help="ours: then every row again with Whisper's encoder GEMMs in FP8 (systems *_fp8enc), then "
                   "also the cross-attention K/V in e4m3 (*_fp8, what --fp8-encoder runs); "
                   "profile: the FP8 model's calls instead")
    p.add_argument("--breakdown", action="store_true", help="also time 1-token decoding (encoder share)")
    p.add_argument("--invariant", action="store_true",
                   help="also time Whisper with batch-invariant kernels (polyaccel.asr.batch_invariant)")
    p.add_argument("--no-pdl", action="store_true",
                   help="ours: also rows without the decoder step's kernels launched early (programmatic dependent "
                        "launch, on by default; POLYACCEL_CUDA_PDL=0), polyaccel_graphs_no_pdl")
    p.add_argument("--plain-decode", action="store_true",
                   help="also time Whisper without its fused decoder step (WhisperASR.fused_decode=False)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hf-modes", default="generate",
                   help="hf section: generate (as called), compile (static cache + torch.compile)")
    p.add_argument("--profile-ops", action="store_true",
                   help="profile section: also record the host's torch ops (slower call; a table of ops by their kernels' time)")
    p.add_argument("--kernels-budget", type=float, default=300.0, help="kernels section: seconds of search")
    p.add_argument("--runtime-model", default="whisper-base")
    p.add_argument("--runtime-batches", default="1,8,64")
    p.add_argument("--runtime-tokens", type=int, default=32)
    p.add_argument("--runtime-rounds", type=int, default=4)
    p.add_argument("--runtime-systems", default="replica_pool,threaded_queue,process_pool")
    p.add_argument("--replicas", type=int, default=2)
    ln = p.add_argument_group("lengths section")
    ln.add_argument("--lengths-corpus", help="a tools/make_asr_corpus.py folder (its files up to one window)")
    ln.add_argument("--lengths-files", type=int, default=256, help="at most this many clips")
    ln.add_argument("--lengths-batch", type=int, default=64, help="the runner's largest batch bucket")
    f8 = p.add_argument_group("fp8 section")
    f8.add_argument("--fp8-models", default="whisper-tiny.en,whisper-base", help="real checkpoints (names or folders)")
    f8.add_argument("--fp8-corpus", help="a tools/make_asr_corpus.py folder (default: the five LibriVox clips)")
    f8.add_argument("--fp8-files", type=int, default=64, help="at most this many corpus files (up to 30 s each)")
    f8.add_argument("--fp8-batch", type=int, default=8, help="batch size of the runs and the encoder timing")
    e2e = p.add_argument_group("end to end (--e2e DIR; corpus from tools/make_asr_corpus.py)")
    e2e.add_argument("--e2e", metavar="DIR", help="run the end-to-end section on this corpus (alone)")
    e2e.add_argument("--e2e-model", default="whisper-base", help="model name or directory (ours and the pipeline)")
    e2e.add_argument("--e2e-systems", default="prep,ours,hf")
    e2e.add_argument("--e2e-batches", default="32,64,128",
                     help="our rows: B, BxR (R replicas), or default (the CLI with no --batch-size "
                          "nor --dtype); an f8 suffix adds --fp8-encoder (e.g. 128f8)")
    e2e.add_argument("--e2e-hf-batches", default="16,64")
    e2e.add_argument("--e2e-dtype", default="float16", help="dtype on cuda (cpu always runs float32)")
    e2e.add_argument("--e2e-replicas", type=int, default=None, help="our replicas (default: the CLI's)")
    e2e.add_argument("--e2e-fp8", action="store_true", help=argparse.SUPPRESS)  # an --e2e-batches entry ending in f8
    e2e.add_argument("--e2e-hf-workers", type=int, default=None, help="threads decoding for the pipeline (default: cores - 2)")
    e2e.add_argument("--e2e-out", default=None,
                     help="where each row's transcripts go (default: a new private temporary folder)")
    e2e.add_argument("--e2e-timeout", type=int, default=600, help="seconds per row")
    e2e.add_argument("--limit", type=int, default=None, help="only the corpus's first N files")
    e2e.add_argument("--prep-files", type=int, default=60, help="files for the CPU preprocessing row")
    e2e.add_argument("--prep-target-rtfx", type=float, default=3000.0)
    e2e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                     help="shorthand for --backend (cpu: a dry run of the e2e section)")
    e2e.add_argument("--e2e-worker", choices=("prep", "ours", "hf"), help=argparse.SUPPRESS)
    e2e.add_argument("--e2e-batch", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.e2e and args.e2e_out is None:  # never a predictable name in a shared /tmp
        args.e2e_out = tempfile.mkdtemp(prefix="polyaccel-asr-e2e-")
        print(f"# transcripts in {args.e2e_out}", file=sys.stderr)
    if args.device != "auto":
        args.backend = args.device

    from polyaccel.core import select_backend

    backend = select_backend(args.backend)
    args.backend = backend.name
    device = "cuda" if backend.device_type == "cuda" else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32
    args.device = device
    if args.e2e_worker:
        e2e_worker(args)
        return 0
    emit(info="bench_asr", backend=backend.name, device=_device_name(), torch=torch.__version__,
         date=time.strftime("%Y-%m-%d"))
    if args.e2e:
        section_e2e(args)
        return 0
    sections = args.sections.split(",")
    if "exact" in sections:
        section_exact(args, device, dtype)
    if "ours" in sections:
        section_ours(args, device, dtype)
    if "hf" in sections:
        section_hf(args, device, dtype)
    if "runtime" in sections:
        section_runtime(args, device, dtype)
    if "kernels" in sections and device == "cuda":
        section_kernels(args, device, dtype)
    if "profile" in sections and device == "cuda":
        section_profile(args, device, dtype)
    if "fp8" in sections:
        section_fp8(args, device)
    if "lengths" in sections:
        section_lengths(args, device, dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
