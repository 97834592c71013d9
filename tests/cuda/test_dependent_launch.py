"""When the decoder step's kernels are launched early (programmatic dependent launch): by
default, unless ``POLYACCEL_CUDA_PDL=0``, and only on CUDA devices that have it; the GPU test
that it changes no token is in tests/asr/test_fused_decode.py."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from polyaccel.cuda import _triton


def test_on_by_default_off_when_asked_and_never_off_cuda():
    code = "from polyaccel.cuda import _triton; print(_triton.DEPENDENT_LAUNCH)"
    for value, want in ((None, "True"), ("1", "True"), ("0", "False")):
        env = {k: v for k, v in os.environ.items() if k != "POLYACCEL_CUDA_PDL"}
        if value is not None:
            env["POLYACCEL_CUDA_PDL"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)


def test_applied_only_when_on_and_only_on_capable_cuda(monkeypatch):
    monkeypatch.setattr(_triton, "_dependent_launch_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", False)
    assert _triton.dependent_launch(cuda) == {}
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", True)
    assert _triton.dependent_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert _triton.dependent_launch(torch.device("cpu")) == {}  # the interpreter: never
    monkeypatch.setattr(_triton, "_dependent_launch_capable", lambda index: False)  # pre-Hopper GPU
    assert _triton.dependent_launch(cuda) == {}
