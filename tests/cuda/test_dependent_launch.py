"""When the decoder step's kernels are launched early (programmatic dependent launch): only
when asked for, and only on CUDA devices that have it; the GPU test that it changes no
token is in tests/asr/test_fused_decode.py."""

from __future__ import annotations

import torch

from polyaccel.cuda import _triton


def test_off_unless_asked_and_never_off_cuda(monkeypatch):
    monkeypatch.setattr(_triton, "_dependent_launch_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", False)
    assert _triton.dependent_launch(cuda) == {}
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", True)
    assert _triton.dependent_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert _triton.dependent_launch(torch.device("cpu")) == {}  # the interpreter: never
    monkeypatch.setattr(_triton, "_dependent_launch_capable", lambda index: False)  # pre-Hopper GPU
    assert _triton.dependent_launch(cuda) == {}
