"""A LoRA run resumed onto another base model (``model.path`` changed since the checkpoint)
says so: its adapters were trained on the first one, and continue on the other silently before."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
LORA = REPO / "packages/moe/examples/lora_tiny_cpu.yaml"


def _run(tmp_path: Path, base: Path, steps: int) -> int:
    sets = [f"model.path={base}", "model.preset=null", f"checkpoint.dir={tmp_path / 'ck'}", "log.progress_bar=false",
            f"output_dir={tmp_path / 'out'}", "checkpoint.every_steps=1", f"train.max_steps={steps}"]
    return main(["finetune", str(LORA), *[a for s in sets for a in ("--set", s)]])


def test_a_lora_resume_on_another_base_model_warns_naming_both(tmp_path, saved, caplog, capsys):
    other = tmp_path / "other"
    shutil.copytree(saved, other)
    assert _run(tmp_path, saved, 1) == 0
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        assert _run(tmp_path, saved, 2) == 0  # the same base: no word
        assert "model.path changed on resume" not in caplog.text
        assert _run(tmp_path, other, 3) == 0
    assert f"trained on the base model {saved}, this run loads {other}" in caplog.text
