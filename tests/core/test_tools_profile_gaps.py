"""``tools/profile_gaps.py``: the GPU's busy time in a profiled call is the union of its
kernels' intervals (overlapping kernels counted once), and each idle stretch is a gap."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from profile_gaps import gpu_busy  # noqa: E402


def _kernels(*spans_us):
    return [SimpleNamespace(time_range=SimpleNamespace(start=s, end=e)) for s, e in spans_us]


def test_overlapping_kernels_count_once_and_idle_stretches_are_gaps():
    got = gpu_busy(_kernels((500, 600), (0, 100), (50, 200), (610, 700), (702, 800), (900, 1000)))
    assert got["span_ms"] == 1.0
    assert got["busy_ms"] == 0.59  # 0-200, 500-600, 610-700, 702-800, 900-1000
    assert got["longest_gaps_ms"][:2] == [(0.2, 0.3), (0.8, 0.1)]
    assert got["gaps"] == {"<5us": [1, 0.002], "5-20us": [1, 0.01], "20-50us": [0, 0], "50-200us": [1, 0.1],
                           ">=200us": [1, 0.3]}


def test_no_kernels_no_numbers():
    assert gpu_busy([]) == {}
