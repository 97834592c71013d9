"""A ``README.md`` already in ``output_dir`` (the user's own, or an earlier save's model card
they edited) survives every save byte for byte: a LoRA save's PEFT model card used to be
written over it (the save of a run over another run's adapters, the same command continuing
its run, and the rewrite of ``output_dir`` from the final checkpoint alike). PEFT's card is
still written where there is no ``README.md``."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from polyaccel.moe import train
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import load_config

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
LORA = REPO / "packages/moe/examples/lora_tiny_cpu.yaml"
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
MINE = b"# My adapter\n\nTrained on our support tickets; see notes.txt.\n"


def _run(tmp_path: Path, *sets: str, checkpoints: bool = False):
    return finetune(load_config(LORA, [f"output_dir={tmp_path / 'out'}", "log.progress_bar=false",
                                       "train.max_steps=1", "train.seq_len=8", "train.grad_accum=1",
                                       f"checkpoint.dir={tmp_path / 'ck' if checkpoints else 'null'}",
                                       "checkpoint.every_steps=1", *sets]))


def test_a_lora_run_over_another_runs_adapters_keeps_the_users_readme(tmp_path, caplog):
    _run(tmp_path)
    out = tmp_path / "out"
    card = (out / "README.md").read_text()
    assert card.startswith("---") and "library_name: peft" in card  # PEFT's card, into a new output_dir
    (out / "README.md").write_bytes(MINE)
    adapter = (out / "adapter_model.safetensors").read_bytes()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        _run(tmp_path, "train.seed=1")
    assert (out / "README.md").read_bytes() == MINE
    assert (out / "adapter_model.safetensors").read_bytes() != adapter  # the adapters were replaced ...
    [kept] = [p for p in out.iterdir() if re.fullmatch(r"adapter_model\.safetensors\.bak-[\d-]+", p.name)]
    assert kept.read_bytes() == adapter  # ... and the other run's kept aside, named in the warning
    assert "that model's files it would write over or delete are kept, renamed <name>.bak-<time> " \
           "(adapter_model.safetensors; nothing else there is touched)" in caplog.text, caplog.text


def test_the_same_command_continuing_its_run_keeps_the_users_readme(tmp_path, caplog):
    _run(tmp_path, checkpoints=True)
    out = tmp_path / "out"
    (out / "README.md").write_bytes(MINE)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        assert _run(tmp_path, "train.max_steps=2", checkpoints=True).start_step == 1
    assert "holds a saved model" not in caplog.text  # this run's own output: no warning either
    assert (out / "README.md").read_bytes() == MINE


def test_rewriting_output_dir_from_the_final_checkpoint_keeps_the_users_readme(tmp_path):
    """A rerun of a finished run whose output_dir lacks the final weights (a kill during the
    final save) copies the checkpoint's files in; the checkpoint's README.md is PEFT's card."""
    _run(tmp_path, checkpoints=True)
    out = tmp_path / "out"
    assert (next((tmp_path / "ck").glob("step_*")) / "README.md").is_file()
    (out / "README.md").write_bytes(MINE)
    adapter = (out / "adapter_model.safetensors").read_bytes()
    (out / "adapter_model.safetensors").write_bytes(adapter[:-8])
    assert _run(tmp_path, checkpoints=True).note.startswith("run already finished at step 1")
    assert (out / "adapter_model.safetensors").read_bytes() == adapter
    assert (out / "README.md").read_bytes() == MINE


def test_any_save_keeps_a_readme_it_finds_and_writes_one_only_where_there_is_none(tmp_path):
    """The rule is the save's, not PEFT's: a full model's save that stages a README.md (a model
    card) keeps the user's, a link included (neither it nor where it leads is written)."""
    cfg = load_config(TINY, [f"output_dir={tmp_path / 'out'}", "checkpoint.dir=null"])

    def write(staging: Path) -> None:
        for name in ("config.json", "model.safetensors", "README.md"):
            (staging / name).write_bytes(b"new")

    train._write_output(cfg, write)
    out = tmp_path / "out"
    assert all((out / n).read_bytes() == b"new" for n in ("config.json", "model.safetensors", "README.md"))
    (out / "README.md").write_bytes(MINE)
    train._write_output(cfg, write)
    assert (out / "README.md").read_bytes() == MINE and (out / "config.json").read_bytes() == b"new"
    assert sorted(p.name for p in out.iterdir()) == [train._RECORD, "README.md", "config.json", "model.safetensors"]

    target = tmp_path / "notes.md"
    target.write_bytes(MINE)
    (out / "README.md").unlink()
    (out / "README.md").symlink_to(target)
    train._write_output(cfg, write)
    assert (out / "README.md").is_symlink() and target.read_bytes() == MINE
