"""``tools/bench_attention.py`` on CPU: its fp32 reference is causal GQA attention, its ``sdpa``
variant computes the same, and it refuses what it cannot run with one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyaccel.core import ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("bench_attention", ROOT / "tools" / "bench_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_and_sdpa_variant_are_causal_gqa_attention(tool) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 7, 4, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
    expected = ops.attention.reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                       scale=0.5).transpose(1, 2)
    torch.testing.assert_close(tool.reference(q, k, v, 0.5), expected)
    torch.testing.assert_close(tool.variant("sdpa")(q, k, v, 0.5), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_attention.py")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr


def test_an_unknown_variant_is_refused(tool) -> None:
    with pytest.raises(SystemExit, match="unknown variant 'nope'"):
        tool.variant("nope")
