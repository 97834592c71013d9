"""Inputs that must not reach outside their folder or destroy what is already there: weight
indexes naming shards outside the checkpoint, a metrics file that is someone else's file,
checkpoints of an earlier run under ``resume: none`` or an older named checkpoint, LoRA and
full-model outputs and checkpoints mixed up, and resuming with another data seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, train
from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.cli import main
from polyaccel.moe.ep_checkpoint import checkpoint_files
from polyaccel.moe.train import finetune, resolve_model_config
from polyaccel.moe.train_config import ConfigError, load_config, preset

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
LORA = REPO / "packages/moe/examples/lora_tiny_cpu.yaml"


class Reached(Exception):
    """Raised instead of loading the model: every check before it passed."""


def _no_model_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise Reached
    monkeypatch.setattr(train, "_load_model", refuse)


def _cfg(root: Path, *extra: str, example: Path = TINY):
    return load_config(example, [f"checkpoint.dir={root / 'ck'}", f"output_dir={root / 'out'}",
                                 "log.progress_bar=false", "train.max_steps=4", *extra])


def _fake_checkpoint(root: Path, step: int, *files: str) -> Path:
    """A complete checkpoint directory (manifest over a trainer state and ``files``)."""
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    torch.save({"step": step, "optimizer": None}, d / ckpt.TRAINER_STATE)
    for name in files:
        (d / name).write_text("{}")
    ckpt.write_manifest(d, step)
    return d


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# Weight index naming shards outside the checkpoint folder
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE saved in several safetensors shards."""
    path = tmp_path_factory.mktemp("sharded") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(resolve_model_config(preset("qwen3-moe-tiny").model)).save_pretrained(
        path, max_shard_size="40KB")
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_weight_index_naming_shards_outside_the_folder_is_refused(sharded, tmp_path, capsys, where):
    """A model folder whose ``model.safetensors.index.json`` points a shard at ``../...`` or an
    absolute path would make the loader read any safetensors file on the machine into the model
    (and from there into output_dir). Refused before anything is read or written."""
    model = shutil.copytree(sharded, tmp_path / "model")
    outside = tmp_path / "elsewhere" / "private.safetensors"
    outside.parent.mkdir()
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (model / first).rename(outside)
    name = "../elsewhere/private.safetensors" if where == "relative" else str(outside)
    index["weight_map"] = {k: (name if v == first else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))

    with pytest.raises(ValueError, match="outside .* so it is refused"):
        AutoModelForCausalLM.from_pretrained(model)
    with pytest.raises(ValueError, match="outside"):
        checkpoint_files(model)  # the expert-parallel loader's reader
    code = main(["finetune", str(TINY), "--set", f"model.path={model}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                 "--set", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "model.path:" in err and repr(name) in err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "out").exists()
    assert len(AutoModelForCausalLM.from_pretrained(sharded).lm_head.weight) > 0  # plain shard names still load


# --------------------------------------------------------------------------------------------
# The metrics file
# --------------------------------------------------------------------------------------------

def test_a_metrics_file_that_is_not_a_metrics_log_is_never_rewritten(tmp_path, capsys, monkeypatch):
    """``log.metrics_jsonl`` pointed at an existing file of other records (the training data,
    a config) must not be rewritten keeping only step records, i.e. emptied."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n{"text": "world"}\n')
    before = data.read_bytes()
    code = main(["finetune", str(TINY), "--set", f"log.metrics_jsonl={data}", "--set", "checkpoint.dir=null",
                 "--set", f"output_dir={tmp_path / 'out'}", "--set", "train.max_steps=1"])
    assert code == 2 and "is not a metrics log (line 1" in capsys.readouterr().err
    assert data.read_bytes() == before and not (tmp_path / "out").exists()

    # A metrics log of an earlier run, with a last line cut by a kill, is still accepted.
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 4.8}\n\n{"step": 2, "lo')
    _no_model_load(monkeypatch)
    with pytest.raises(Reached):
        finetune(_cfg(tmp_path, f"log.metrics_jsonl={log}"))


# --------------------------------------------------------------------------------------------
# Checkpoints past the step a run starts from
# --------------------------------------------------------------------------------------------

def test_resume_none_or_an_older_checkpoint_never_overwrites_later_checkpoints(tmp_path, monkeypatch):
    """``resume: none`` in a checkpoint.dir of an earlier run overwrote its step_N with the new
    run's and left the rest to be mixed with it (``resume: auto`` later picked the old run's
    newer one); naming an older checkpoint overwrote the intact newer ones."""
    _fake_checkpoint(tmp_path / "ck", 2)
    step4 = _fake_checkpoint(tmp_path / "ck", 4)
    (_fake_checkpoint(tmp_path / "ck", 6) / ckpt.MANIFEST).unlink()  # written before manifests existed
    (tmp_path / "ck/step_00000008.tmp").mkdir()  # a save a kill cut short: not a checkpoint
    before = _tree(tmp_path / "ck")
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"holds checkpoints past .*\(step_00000002, step_00000004, step_00000006\)"
                                          r".*resume=none starts over"):
        finetune(_cfg(tmp_path, "checkpoint.resume=none"))
    older = tmp_path / "ck/step_00000002"
    with pytest.raises(ConfigError, match=r"past the step this run starts from \(step_00000004, step_00000006\)"):
        finetune(_cfg(tmp_path, f"checkpoint.resume={older}"))
    assert _tree(tmp_path / "ck") == before

    # A damaged newer checkpoint may be written over (what resume: auto does too).
    (step4 / ckpt.TRAINER_STATE).write_bytes(b"")
    shutil.rmtree(tmp_path / "ck/step_00000006")
    with pytest.raises(Reached):
        finetune(_cfg(tmp_path, f"checkpoint.resume={older}"))
    with pytest.raises(Reached):  # a new directory starts over
        finetune(_cfg(tmp_path, "checkpoint.resume=none", f"checkpoint.dir={tmp_path / 'new'}"))


def test_resuming_with_another_data_seed_exits_2_naming_it(tmp_path, capsys):
    finetune(_cfg(tmp_path, "train.max_steps=1", "output_dir=null"))
    code = main(["finetune", str(TINY), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "train.max_steps=2",
                 "--set", "train.seed=5", "--set", "log.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and "used seed 0, this run seed 5" in err and "Traceback" not in err


# --------------------------------------------------------------------------------------------
# LoRA adapters and full models
# --------------------------------------------------------------------------------------------

def test_lora_and_full_outputs_never_replace_each_other(tmp_path, monkeypatch):
    """A LoRA run into an output_dir holding a fine-tuned full model deleted its
    model.safetensors (an earlier save's weight file) and left config.json beside the adapter;
    a full run into an adapter folder deleted the adapter and kept adapter_config.json."""
    full, adapter = tmp_path / "full", tmp_path / "adapter"
    full.mkdir()
    adapter.mkdir()
    for name in ("config.json", "model.safetensors"):
        (full / name).write_text("{}")
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
        (adapter / name).write_text("{}")
    before = _tree(tmp_path)
    _no_model_load(monkeypatch)
    with pytest.raises(ConfigError, match=r"holds a full model \(model.safetensors\); this run saves LoRA adapters"):
        finetune(_cfg(tmp_path, f"output_dir={full}", example=LORA))
    with pytest.raises(ConfigError, match=r"holds LoRA adapters \(adapter_config.json, adapter_model.safetensors\)"):
        finetune(_cfg(tmp_path, f"output_dir={adapter}"))
    assert _tree(tmp_path) == before
    with pytest.raises(Reached):  # each kind may replace its own kind
        finetune(_cfg(tmp_path, f"output_dir={adapter}", example=LORA))
    with pytest.raises(Reached):
        finetune(_cfg(tmp_path, f"output_dir={full}"))


def test_lora_and_full_checkpoints_are_not_resumed_by_the_other_kind(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "full/ck", 2, "config.json")
    _fake_checkpoint(tmp_path / "lora/ck", 2, "adapter_config.json")
    code = main(["finetune", str(LORA), "--set", f"checkpoint.dir={tmp_path / 'full/ck'}", "--set", "output_dir=null"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a full model, no LoRA adapters, and this run is LoRA" in err
    code = main(["finetune", str(TINY), "--set", f"checkpoint.dir={tmp_path / 'lora/ck'}", "--set", "output_dir=null"])
    err = capsys.readouterr().err
    assert code == 2 and "holds LoRA adapters, and this run is full fine-tuning" in err


def test_bench_stopped_by_a_nonfinite_step_exits_3(capsys, monkeypatch):
    """``bench`` let NonFiniteError escape as a traceback (exit 1) where finetune exits 3."""
    monkeypatch.setattr(train, "_scaled_loss", lambda out, *args: out.loss * float("nan"))
    code = main(["bench", "--preset", "qwen3-moe-tiny", "--steps", "1", "--warmup", "0"])
    out, err = capsys.readouterr()
    assert code == 3 and "step 1: non-finite loss (nan)" in err and out == ""
