"""``tools/bench_adamw_overlap.py`` on CPU (a dry run): the step a forward applies equals the
step applied in line, and the timings are reported; a split that leaves a part out is caught."""

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


def test_overlapped_step_equals_the_step_in_line(bench, capsys):
    rc, rec = _run(bench, capsys)
    assert rc == 0 and rec["overlapped_weights_equal"] is True and rec["params"] > 0
    assert all(rec[k] > 0 for k in ("adamw_ms", "micro_batch_ms", "sequential_ms", "overlapped_ms"))


def test_a_part_left_out_of_the_forward_is_caught(bench, capsys, monkeypatch):
    from polyaccel.moe.deferred_step import DeferredStep

    real = DeferredStep._launch

    def launch_but_skip_the_last_module(self, side_stream):
        if side_stream:  # the forward's launch, not flush()'s
            self.parts = [*self.parts[:-1], []]
        real(self, side_stream)

    monkeypatch.setattr(DeferredStep, "_launch", launch_but_skip_the_last_module)
    rc, rec = _run(bench, capsys)
    assert rc == 1 and rec["overlapped_weights_equal"] is False
