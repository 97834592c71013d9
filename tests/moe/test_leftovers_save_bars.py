"""``log.progress_bar: false`` keeps Transformers' "Writing model shards" bar (``save_pretrained``)
off stderr at every save of a run: the checkpoints, the final save to ``output_dir``, and the
rescue folder a failed final save writes instead; with ``true`` the bar is there (so these
tests can see it)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
BAR = "Writing model shards"


def _stderr(capfd, *sets: str) -> tuple[int, str]:
    code = main(["finetune", str(TINY), *[a for s in ("train.max_steps=1", *sets) for a in ("--set", s)]])
    return code, capfd.readouterr().err


@pytest.mark.parametrize("bar", [False, True])
def test_checkpoint_and_final_save_bars_follow_log_progress_bar(tmp_path, capfd, bar):
    code, err = _stderr(capfd, f"log.progress_bar={str(bar).lower()}", f"output_dir={tmp_path / 'out'}",
                        f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=1")
    assert code == 0, err
    assert (tmp_path / "out/model.safetensors").is_file() and (tmp_path / "ck/step_00000001").is_dir()
    assert err.count(BAR) >= 2 if bar else BAR not in err, err  # a checkpoint and output_dir


def test_no_bar_when_the_final_save_fails_and_the_weights_are_rescued(full_disk, tmp_path, capfd, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    full_disk(disk)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # what $TMPDIR sets: the rescue goes there
    code, err = _stderr(capfd, "log.progress_bar=false", f"output_dir={disk / 'out'}", "checkpoint.dir=null")
    rescued = list(tmp.glob("polyaccel-moe-rescue-out-*"))
    assert code == 4 and len(rescued) == 1 and (rescued[0] / "model.safetensors").is_file(), err
    assert f"saved instead to {rescued[0]}" in err and BAR not in err, err
