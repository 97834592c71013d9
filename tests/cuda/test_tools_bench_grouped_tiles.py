"""``tools/bench_grouped_tiles.py``'s dry run on CPU (``torch._grouped_mm`` has a CPU kernel
with the same rules): the view that steers CUTLASS to its small tile gives the same bits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no _grouped_mm", allow_module_level=True)


def test_dry_run_checks_both_tiles_give_the_same_bits() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_grouped_tiles.py"), "--device", "cpu",
                           "--scale", "64", "--reps", "1", "--cases", "qwen3-down,olmoe-gate_up"],
                          capture_output=True, text=True, timeout=300, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [(r["case"], r["routing"]) for r in rows] == [
        (case, routing) for case in ("qwen3-down", "olmoe-gate_up") for routing in ("balanced", "mild", "learned")]
    for r in rows:
        assert r["fwd_equal"] is True and r["dgrad_equal"] is True, r
        assert r["rows"] // r["groups_small_tile"] <= 128 < r["rows"] // r["experts"], r
    assert rows[2]["empty_experts"] > 0 and rows[0]["empty_experts"] == 0


def test_unknown_case_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_grouped_tiles.py"), "--device", "cpu",
                           "--cases", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "unknown case 'nope'" in proc.stderr
