"""A final save into an ``output_dir`` holding a saved model another run wrote (allowed) keeps
that model's files, renamed ``<name>.bak-<time>``, and says so in a warning; the same command
rerun to continue its own run replaces its own model silently. (The earlier model's weights
used to be written over or deleted, with only the warning.)"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
WARNING = "holds a saved model (model.safetensors)"


def _cfg(tmp_path: Path, *sets: str):
    return load_config(TINY, [f"output_dir={tmp_path / 'out'}", "log.progress_bar=false", "train.max_steps=2",
                              "checkpoint.every_steps=1", "checkpoint.keep_last=1", *sets])


def _warnings(caplog, cfg) -> str:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        finetune(cfg)
    return caplog.text


@pytest.fixture
def earlier_run(tmp_path, caplog):
    """A finished run that saved its final model in tmp_path/out."""
    assert WARNING not in _warnings(caplog, _cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ck_a'}"))
    assert (tmp_path / "out/model.safetensors").is_file()
    return tmp_path


def _kept(out: Path, name: str) -> list[Path]:
    return sorted(p for p in out.iterdir() if re.fullmatch(re.escape(name) + r"\.bak-\d{8}-\d{6}(-\d+)?", p.name))


def test_another_run_replacing_the_saved_model_warns_and_keeps_it(earlier_run, caplog):
    before = (earlier_run / "out/model.safetensors").read_bytes()
    text = _warnings(caplog, _cfg(earlier_run, f"checkpoint.dir={earlier_run / 'ck_b'}", "train.seed=1"))
    assert f"output_dir {earlier_run / 'out'} {WARNING} that no checkpoint in this run's checkpoint.dir" in text
    assert "(another run's?); this run's final model takes its place" in text
    assert "the earlier model's files are kept, renamed: model.safetensors -> model.safetensors.bak-" in text
    [kept] = _kept(earlier_run / "out", "model.safetensors")
    assert kept.read_bytes() == before != (earlier_run / "out/model.safetensors").read_bytes()


def test_a_run_without_checkpoint_dir_replacing_the_saved_model_warns(earlier_run, caplog):
    text = _warnings(caplog, _cfg(earlier_run, "checkpoint.dir=null"))
    assert f"{WARNING} that this run did not write (it has no checkpoint.dir)" in text
    assert len(_kept(earlier_run / "out", "model.safetensors")) == 1


def test_the_same_command_continuing_its_run_does_not_warn(earlier_run, caplog):
    """Raising train.max_steps and rerunning resumes from the run's last checkpoint, whose
    weights output_dir holds: no warning (also after keep_last=1 pruned that checkpoint)."""
    before = (earlier_run / "out/model.safetensors").read_bytes()
    text = _warnings(caplog, _cfg(earlier_run, f"checkpoint.dir={earlier_run / 'ck_a'}", "train.max_steps=4"))
    assert WARNING not in text and "holds a saved model" not in text
    assert (earlier_run / "out/model.safetensors").read_bytes() != before  # replaced by step 4's model
    assert not _kept(earlier_run / "out", "model.safetensors")  # its own: nothing kept aside



def test_a_finished_run_rerun_into_another_run_s_output_warns(earlier_run, caplog):
    """The already-finished path writes output_dir from the final checkpoint (as the docs
    suggest, to write the model elsewhere): over another run's saved model it says so too."""
    other = earlier_run / "other"
    _warnings(caplog, load_config(TINY, [f"output_dir={other}", "log.progress_bar=false", "train.max_steps=2",
                                         "checkpoint.dir=null", "train.seed=9"]))
    text = _warnings(caplog, _cfg(earlier_run, f"checkpoint.dir={earlier_run / 'ck_a'}", f"output_dir={other}"))
    assert "run already finished" in text
    assert f"output_dir {other} {WARNING} that no checkpoint of this run matches (another run's?)" in text
    assert (other / "model.safetensors").read_bytes() == (earlier_run / "out/model.safetensors").read_bytes()
    assert len(_kept(other, "model.safetensors")) == 1
    assert WARNING not in _warnings(caplog, _cfg(earlier_run, f"checkpoint.dir={earlier_run / 'ck_a'}"))

@pytest.mark.parametrize("bar", [False, True])
def test_transformers_bars_follow_log_progress_bar_and_are_restored(tmp_path, monkeypatch, bar):
    """log.progress_bar=false also silences Transformers' loading and saving bars (they are
    on while the final model is written only when asked for); finetune() leaves the setting as
    it found it."""
    from transformers.utils import logging as hf_logging

    from polyaccel.moe import train

    seen, real = [], train.save_final
    monkeypatch.setattr(train, "save_final",
                        lambda *a, **k: seen.append(hf_logging.is_progress_bar_enabled()) or real(*a, **k))
    finetune(_cfg(tmp_path, "checkpoint.dir=null", f"log.progress_bar={str(bar).lower()}"))
    assert seen == [bar] and hf_logging.is_progress_bar_enabled()


def test_a_model_another_tool_saved_is_kept_whole_and_loads_again(tmp_path, caplog):
    """A model with no polyaccel record (another tool's: its own config, sharded weights and an
    index) in ``output_dir``: every file the save would write over or delete is kept aside,
    and renamed back into a folder of their own they load as that model again."""
    import json

    import torch

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig
    from polyaccel.moe.presets import tiny

    out = tmp_path / "out"
    config = tiny("qwen3_moe")
    config.hidden_size = 48
    theirs = AutoModelForCausalLM.from_config(config, backend=BackendConfig(backend="cpu"))
    theirs.save_pretrained(out, max_shard_size="200KB")
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and json.loads((out / "config.json").read_text())["hidden_size"] == 48
    text = _warnings(caplog, _cfg(tmp_path, "checkpoint.dir=null"))
    assert "that this run did not write" in text and "the earlier model's files are kept, renamed" in text
    back = tmp_path / "theirs"
    back.mkdir()
    for name in names:
        [kept] = _kept(out, name)
        kept.rename(back / name)
    again = AutoModelForCausalLM.from_pretrained(back, backend=BackendConfig(backend="cpu"))
    for (k, v), (_, w) in zip(theirs.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(v, w), k
