"""``rows_to_fp8`` (``polyaccel.cuda.fp8_rows``) on the GPU against core's reference, on fresh
random inputs: the shapes of Whisper's encoder (1,280 and 5,120 wide), bf16 and fp16, a zero
row, strided rows. The interpreter runs the same comparison in CI (``interpreted_kernels.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location("e4m3_check", Path(__file__).with_name("e4m3_check.py"))
e4m3_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e4m3_check)
check_rows_to_fp8 = e4m3_check.check_rows_to_fp8

pytestmark = pytest.mark.gpu


@pytest.fixture
def kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    from polyaccel.cuda.fp8_rows import rows_to_fp8

    return rows_to_fp8


@pytest.mark.parametrize("rows,k", [(1500, 1280), (3001, 5120), (7, 40), (64, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rows_to_fp8_matches_the_reference(kernel, rows, k, dtype):
    x = (4 * torch.randn(rows, k, device="cuda")).to(dtype)
    x[1] = 0
    w = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(k, device="cuda")).to(dtype)
    print(check_rows_to_fp8(kernel, x, "none", exact=True, max_moved=0))
    # the kernel's GELU is the tanh form: within 4.8e-4 of the erf GELU, which moves many values
    # near -1..-3 by a step; what the rows stand for is as close to the erf GELU as the reference's
    print(check_rows_to_fp8(kernel, x, "gelu", exact=False, max_moved=0.3, scale_rtol=1e-3, abs_tol=6e-4))
    print(check_rows_to_fp8(kernel, x, "layer_norm", exact=False, max_moved=0.002, ln_weight=w, ln_bias=b))


def test_rows_to_fp8_reads_strided_rows(kernel):
    x = torch.randn(300, 2 * 1280, device="cuda", dtype=torch.bfloat16)[:, 1280:]
    print(check_rows_to_fp8(kernel, x, "none", exact=True, max_moved=0))
