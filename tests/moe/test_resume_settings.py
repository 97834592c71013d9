"""Settings changed on resume: the LoRA adapters' settings and the model's shape cannot change
mid-run (exit 2, the key and both values named); ``train.lr`` and the schedule can (the new
values apply from the resumed step), where the checkpoint's used to win silently."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from polyaccel.moe.cli import main
from polyaccel.moe.train import finetune, lr_factor
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
LORA = REPO / "packages/moe/examples/lora_tiny_cpu.yaml"


def _sets(root: Path, *extra: str) -> list[str]:
    return [f"checkpoint.dir={root / 'ck'}", f"output_dir={root / 'out'}", f"log.metrics_jsonl={root / 'm.jsonl'}",
            "log.progress_bar=false", "train.max_steps=4", "checkpoint.every_steps=2", *extra]


def _cli(capsys, example: Path, root: Path, *extra: str) -> tuple[int, str]:
    code = main(["finetune", str(example), *[a for s in _sets(root, *extra) for a in ("--set", s)]])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def lora_half(tmp_path_factory) -> Path:
    """A LoRA run (r 8, alpha 16, q/k/v/o + experts) stopped after checkpoint 2 of 4."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    finetune(load_config(LORA, _sets(root)), stop_after=2)
    return root


@pytest.fixture(scope="module")
def full_half(tmp_path_factory) -> Path:
    """A full fine-tuning run (lr 1e-3) stopped after checkpoint 2 of 4."""
    root = tmp_path_factory.mktemp("full")
    finetune(load_config(TINY, _sets(root)), stop_after=2)
    return root


def _copy(half: Path, tmp_path: Path) -> Path:
    shutil.copytree(half, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("change, message", [
    ("lora.r=4", "written with lora.r=8, this run has 4"),
    ("lora.alpha=32", "written with lora.alpha=16.0, this run has 32.0"),
    ("lora.target_modules=[q_proj,v_proj]", 'lora.target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], this run '
                                            'has ["q_proj", "v_proj"]'),
    ("lora.experts=false", "written with lora.experts=True, this run has False"),
    ("lora.router=true", "written with lora.router=False, this run has True"),
    ("model.config.num_hidden_layers=1", "written with the model's num_hidden_layers=2, this run has 1"),
])
def test_lora_resume_with_other_adapter_settings_or_model_shape_exits_2(lora_half, tmp_path, capsys, change, message):
    """The checkpoint's adapters were loaded as they were, whatever the new lora section said."""
    root = _copy(lora_half, tmp_path)
    code, err = _cli(capsys, LORA, root, change)
    assert code == 2 and "Traceback" not in err, err
    assert message in err and "cannot change mid-run" in err and "train.lr" in err
    assert not (root / "out").exists() and not (root / "ck/step_00000004").exists()


def test_lora_resume_with_the_same_settings_in_another_order_runs(lora_half, tmp_path, capsys):
    root = _copy(lora_half, tmp_path)
    code, err = _cli(capsys, LORA, root, "lora.target_modules=[o_proj,v_proj,k_proj,q_proj]", "lora.recompute=none")
    assert code == 0, err
    assert (root / "out/adapter_config.json").is_file()


def test_full_resume_with_another_layer_count_exits_2(full_half, tmp_path, capsys):
    """Fewer layers loaded from the checkpoint without a shape error (the rest ignored)."""
    root = _copy(full_half, tmp_path)
    code, err = _cli(capsys, TINY, root, "model.config.num_hidden_layers=1")
    assert code == 2 and "written with the model's num_hidden_layers=2, this run has 1" in err, err
    assert not (root / "out").exists()


def _lrs(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, metrics.read_text().splitlines())}


def test_a_new_peak_lr_applies_from_the_resumed_step(full_half, tmp_path, capsys, caplog):
    """The scheduler restored the checkpoint's peak lr (1e-3), ignoring train.lr=5e-4."""
    root = _copy(full_half, tmp_path)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, err = _cli(capsys, TINY, root, "train.lr=5e-4")
    assert code == 0, err
    assert "train.lr changed on resume: the checkpoint's run used 0.001, this run 0.0005" in caplog.text
    cfg = load_config(TINY, _sets(root, "train.lr=5e-4"))
    factor = lr_factor(cfg.train)
    lrs = _lrs(root / "m.jsonl")
    assert lrs[1] == pytest.approx(1e-3 * factor(0)) and lrs[2] == pytest.approx(1e-3 * factor(1))  # first run
    assert lrs[3] == pytest.approx(5e-4 * factor(2)) and lrs[4] == pytest.approx(5e-4 * factor(3))
