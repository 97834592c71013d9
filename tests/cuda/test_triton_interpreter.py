"""The cuda backend's Triton kernels on the CPU, through Triton's interpreter (see
``interpreted_kernels.py``): their indexing, masking and math are checked in CI, where there
is no GPU. Skipped when Triton is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_references_in_the_interpreter():
    script = Path(__file__).with_name("interpreted_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
