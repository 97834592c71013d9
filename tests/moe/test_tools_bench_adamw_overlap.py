"""``tools/bench_adamw_overlap.py`` on CPU (a dry run): the per-layer split of the AdamW pass
covers every parameter, gives the same update as the whole pass, and is reported."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_adamw_overlap.py"


@pytest.fixture
def bench() -> types.ModuleType:
    sys.path.insert(0, str(TOOL.parent))
    spec = importlib.util.spec_from_file_location("bench_adamw_overlap", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, capsys) -> tuple[int, dict]:  # noqa: ANN001
    rc = bench.main(["--shape", "qwen3-moe-tiny", "--device", "cpu", "--seq", "32", "--reps", "1"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_split_update_equals_the_whole_pass(bench, capsys):
    rc, rec = _run(bench, capsys)
    assert rc == 0 and rec["split_update_equal"] is True
    assert rec["params_covered"] <= rec["params"]
    assert all(rec[k] > 0 for k in ("adamw_ms", "micro_batch_ms", "sequential_ms", "overlapped_ms"))


def test_a_layer_left_out_of_the_split_is_caught(bench, capsys, monkeypatch):
    real = bench.layer_ranges
    monkeypatch.setattr(bench, "layer_ranges", lambda model, flat: real(model, flat)[:-1])
    rc, rec = _run(bench, capsys)
    assert rc == 1 and rec["split_update_equal"] is False
