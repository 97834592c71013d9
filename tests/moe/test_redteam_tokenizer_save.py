"""A tokenizer the final save copies into ``output_dir`` (from ``model.path`` or
``data.tokenizer``) is loaded before training: a damaged one is a config error (exit 2, nothing
trained). Before, pre-tokenized data never loaded it, so the run trained to the end, then the
save of output_dir and of every fallback folder failed on it: "the trained weights are lost".
A rescue now keeps the weights even if the tokenizer broke during the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from polyaccel.moe import train
from polyaccel.moe.cli import main


def _setup(tmp_path: Path, saved: Path) -> tuple[Path, Path]:
    base = tmp_path / "base"
    shutil.copytree(saved, base)
    (base / "tokenizer.json").write_text('{"version": "1.0", "trunc')  # cut off mid-write
    data = tmp_path / "tok.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 12))}) + "\n" for i in range(4)))
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"path": str(base)}, "data": {"jsonl": str(data)},
                                  "train": {"seq_len": 8, "micro_batch": 1, "grad_accum": 1, "max_steps": 1,
                                            "dtype": "fp32", "device": "cpu"},
                                  "log": {"progress_bar": False}, "output_dir": str(tmp_path / "final")}))
    return config, base


def test_a_damaged_tokenizer_to_save_is_refused_before_training(tmp_path: Path, saved: Path, capsys) -> None:
    config, base = _setup(tmp_path, saved)
    code = main(["finetune", str(config)])
    out, err = capsys.readouterr()
    assert code == 2, err
    assert f"the tokenizer in {base}, which cannot be loaded" in err and "before training" in err
    assert '"step"' not in out and not (tmp_path / "final").exists()


def test_a_rescue_keeps_the_weights_when_the_tokenizer_broke_during_the_run(tmp_path: Path, saved: Path, capsys,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = _setup(tmp_path, saved)
    monkeypatch.setattr(train, "_check_saved_tokenizer", lambda cfg: None)  # as if it broke after the check
    code = main(["finetune", str(config)])
    err = capsys.readouterr().err
    rescued = list(tmp_path.glob("polyaccel-moe-rescue-final-*"))
    assert code == 4 and len(rescued) == 1 and f"saved instead to {rescued[0]}" in err, err
    assert {"model.safetensors", "config.json"} <= {p.name for p in rescued[0].iterdir()}
    assert not (tmp_path / "final").exists()
