"""Kernels launched by one Whisper ``decode_step`` (bf16, batch 1), plain and fused, counted
with torch.profiler in a process of its own: run in the pytest process, the profiler's CUPTI
state broke later tests' CUDA-graph captures there. Run by
``tests/asr/test_fused_decode.py``; prints one JSON line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from polyaccel.core import select_backend


def main() -> None:
    spec = importlib.util.spec_from_file_location("fused_decode_tests", Path(__file__).with_name("test_fused_decode.py"))
    tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tests)
    select_backend("cuda")
    model = tests._cuda_whisper(torch.bfloat16)
    enc = torch.randn(1, 1500, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(1, 1500, dtype=torch.bool, device="cuda")
    tok, pos = torch.tensor([500], device="cuda"), torch.tensor([0], device="cuda")
    counts, logits = {}, {}
    with torch.inference_mode():
        for fused in (False, True):
            model.fused_decode = fused
            state = model.new_decoder_state(enc, mask, model.max_decode_len)
            model.decode_step(tok, pos, state)  # warm: Triton compiles, cuBLAS picks
            state = model.new_decoder_state(enc, mask, model.max_decode_len)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                logits[fused] = model.decode_step(tok, pos, state).float()
                torch.cuda.synchronize()
            counts[fused] = sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    close = torch.allclose(logits[True], logits[False], rtol=0.05, atol=0.05)
    print(json.dumps({"plain": counts[False], "fused": counts[True], "logits_close": close,
                      "max_diff": (logits[True] - logits[False]).abs().max().item()}))


if __name__ == "__main__":
    main()
