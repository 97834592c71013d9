"""Mistakes a user makes, refused with one line and exit 2 before anything trains or is
written (no traceback): a metrics log kept in output_dir (a rerun must still resume) or
naming an output directory, model configs of zero or negative sizes, an override by another
name of a config field, a checkpoint shape mismatch from ``model.path``, expert tensors missing
from it, pickled weights, a
device or backend this machine lacks, a half-written checkpoint named for resume, and data
or tokenizer paths that are not what they should be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from polyaccel.moe import AutoModelForCausalLM
from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.cli import main
from polyaccel.moe.data import build_dataset, load_tokenizer
from polyaccel.moe.train import check_outputs, resolve_model_config
from polyaccel.moe.train_config import ConfigError, DataConfig, ModelConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(capsys, tmp_path: Path, *sets: str) -> tuple[int, str]:
    sets = ("log.progress_bar=false", "train.max_steps=1", f"checkpoint.dir={tmp_path / 'ck'}", *sets)
    code = main(["finetune", str(TINY), *[a for s in sets for a in ("--set", s)]])
    return code, capsys.readouterr().err


def test_a_metrics_log_inside_output_dir_does_not_stop_the_rerun_that_resumes(tmp_path):
    """output_dir=runs/x with log.metrics_jsonl=runs/x/metrics.jsonl: a run killed before its
    final save leaves only the metrics log there, and rerunning the same command must resume,
    not be refused for a 'folder of other files'. Another file there still is refused."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    cfg = load_config(TINY, [f"output_dir={out}", f"log.metrics_jsonl={out / 'metrics.jsonl'}",
                             f"checkpoint.dir={out / 'ck'}"])
    check_outputs(cfg)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"already holds files and no saved model \(notes.txt\)"):
        check_outputs(cfg)


@pytest.mark.parametrize("key", ["output_dir", "checkpoint.dir"])
def test_a_metrics_log_that_is_an_output_directory_is_refused_before_training(tmp_path, key):
    """Otherwise the metrics file is created there and the final save or the first checkpoint
    fails after training (exit 4)."""
    cfg = load_config(TINY, [f"output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}",
                             f"log.metrics_jsonl={tmp_path / ('out' if key == 'output_dir' else 'ck')}"])
    with pytest.raises(ConfigError, match=f"is {key}, a directory this run writes"):
        check_outputs(cfg)
    assert list(tmp_path.iterdir()) == []



@pytest.mark.parametrize("key", ["checkpoint.dir", "data.jsonl"])
def test_what_the_run_reads_or_keeps_inside_the_final_save_s_staging_folder_is_refused(tmp_path, key):
    """The final save starts by removing output_dir/.polyaccel-partial: checkpoints or a dataset
    kept there were deleted without a word (exit 0)."""
    staging = tmp_path / "out" / ".polyaccel-partial"
    staging.mkdir(parents=True)
    data = staging / "data.jsonl"
    data.write_text('{"text": "a b c"}\n')
    sets = [f"output_dir={tmp_path / 'out'}",
            f"checkpoint.dir={staging / 'ck' if key == 'checkpoint.dir' else tmp_path / 'ck'}"]
    if key == "data.jsonl":
        sets += ["data.synthetic=null", f"data.jsonl={data}"]
    cfg = load_config(TINY, sets)
    with pytest.raises(ConfigError, match=f"{key}: .* is inside .*polyaccel-partial, the folder the final save"):
        check_outputs(cfg)
    assert data.exists()


def test_a_metrics_log_inside_a_checkpoint_folder_is_refused(tmp_path):
    """Saving step N replaces checkpoint.dir/step_N and pruning removes old ones: a metrics
    log kept in one was deleted without a word. Directly in checkpoint.dir it is kept."""
    ck = tmp_path / "ck"
    cfg = load_config(TINY, [f"checkpoint.dir={ck}", f"log.metrics_jsonl={ck / 'step_00000004' / 'm.jsonl'}"])
    with pytest.raises(ConfigError, match="inside a folder of checkpoint.dir"):
        check_outputs(cfg)
    check_outputs(load_config(TINY, [f"checkpoint.dir={ck}", f"log.metrics_jsonl={ck / 'm.jsonl'}"]))

@pytest.mark.parametrize("sets, message", [
    (["model.config.num_hidden_layers=0"], "num_hidden_layers=0 must be at least 1"),
    (["model.config.num_hidden_layers=-3"], "num_hidden_layers=-3 must be at least 1"),
    (["model.config.num_attention_heads=0"], "num_attention_heads=0 must be at least 1"),
    (["model.config.vocab_size=0"], "vocab_size=0 must be at least 1"),
    (["model.config.hidden_size=0"], "hidden_size=0 must be at least 1"),
    (["model.config.moe_intermediate_size=0"], "moe_intermediate_size=0 must be at least 1"),
    (["model.config.num_attention_heads=3"], "num_attention_heads=3 is not a multiple of num_key_value_heads=2"),
])
def test_model_configs_that_cannot_train_are_refused_before_anything_is_written(capsys, tmp_path, sets, message):
    """0 or -3 layers trained and saved an empty decoder (exit 0); 0 heads, widths or vocab and
    heads not divisible into key/value groups crashed mid-run with a traceback. (An override of
    a field under another name of it replaces the preset's value: test_odd_inputs.)"""
    code, err = _finetune(capsys, tmp_path, f"output_dir={tmp_path / 'out'}", *sets)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_model_config_json_of_zero_layers_is_refused(saved, tmp_path, capsys, monkeypatch):
    model = shutil.copytree(saved, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("the model was built"))
    code, err = _finetune(capsys, tmp_path, f"model.path={model}", f"output_dir={tmp_path / 'out'}")
    assert code == 2 and "num_hidden_layers=0 must be at least 1" in err
    assert not (tmp_path / "out").exists()


def test_an_override_under_another_name_of_a_field_reaches_the_checkpoint_config(saved):
    """Qwen3-MoE's config.json says num_local_experts; num_experts is its alias. The override
    was dropped (the checkpoint's 4 experts trained while the user asked for 8)."""
    config = resolve_model_config(ModelConfig(path=str(saved), config={"num_experts": 8}))
    assert config.num_local_experts == 8


def test_weights_of_another_shape_in_model_path_are_named(saved, tmp_path, capsys):
    """The differing tensors are named for model.path too, not only for resumed checkpoints
    (the shapes were computed by loading the very weights whose load had failed)."""
    code, err = _finetune(capsys, tmp_path, f"model.path={saved}", "model.config.num_experts=8",
                          f"output_dir={tmp_path / 'out'}")
    assert code == 2 and f"{saved} holds weights of another model shape" in err, err
    assert "model.layers.0.mlp.gate.weight: checkpoint (4, 32), model (8, 32)" in err


@pytest.mark.parametrize("dropped", [["model.layers.0.mlp.experts.2.up_proj.weight"],
                                     [f"model.layers.1.mlp.experts.3.{p}.weight" for p in ("down_proj", "gate_proj",
                                                                                          "up_proj")]])
def test_a_checkpoint_missing_expert_tensors_names_them(saved, tmp_path, capsys, dropped):
    """One expert's projection, or the whole last expert, gone from a per-expert checkpoint:
    the missing tensors are named (not Transformers' report of a failed concatenation)."""
    from safetensors.torch import save_file

    copy = tmp_path / "model"
    shutil.copytree(saved, copy)
    tensors = load_file(copy / "model.safetensors")
    assert all(k in tensors for k in dropped)
    save_file({k: v for k, v in tensors.items() if k not in dropped}, str(copy / "model.safetensors"),
              metadata={"format": "pt"})
    code, err = _finetune(capsys, tmp_path, f"model.path={copy}", f"output_dir={tmp_path / 'out'}")
    assert code == 2, err
    assert f"{copy} lacks {len(dropped)} expert weight tensor" in err and ", ".join(dropped) in err, err
    assert not (tmp_path / "out").exists()


def test_pickled_weights_are_never_read_even_ones_torch_would_load(saved, tmp_path, capsys, monkeypatch):
    """A pytorch_model.bin of plain tensors was loaded (through torch.load) although the error
    for a malicious one says pickled weights are never read."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(saved / "config.json", model / "config.json")
    torch.save(load_file(saved / "model.safetensors"), model / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was read"))
    code, err = _finetune(capsys, tmp_path, f"model.path={model}", f"output_dir={tmp_path / 'out'}")
    assert code == 2 and f"{model} has no model.safetensors" in err and "safetensors checkpoints only" in err, err
    assert "index.json cannot be read" not in err and not (tmp_path / "out").exists()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("sets, message, present", [
    (["train.device=cuda"], "train.device is 'cuda' but CUDA is not available here", torch.cuda.is_available()),
    (["model.backend.linear=te"], "model.backend: BackendConfig(attn='auto', linear='te') needs NVIDIA "
                                  "TransformerEngine", _has("transformer_engine")),
    (["model.backend.backend=cuda"], "model.backend.backend: backend 'cuda' is not available here",
     torch.cuda.is_available()),
])
def test_a_device_or_library_this_machine_lacks_is_a_config_error(capsys, tmp_path, sets, message, present):
    if present:
        pytest.skip("this machine has it")
    code, err = _finetune(capsys, tmp_path, f"output_dir={tmp_path / 'out'}", *sets)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_half_written_checkpoint_named_for_resume_is_refused(tmp_path):
    """A step_N.tmp holds what a killed save had written (its trainer state included, but cut
    or unsynced files possibly): it was resumed from 'unverified', as if it predated manifests."""
    partial = tmp_path / "ck/step_00000002.tmp"
    partial.mkdir(parents=True)
    torch.save({"step": 2, "optimizer": None}, partial / ckpt.TRAINER_STATE)
    with pytest.raises(ckpt.CheckpointError, match="is not a complete checkpoint: its save did not finish"):
        ckpt.find_resume(tmp_path / "ck", str(partial))


def test_data_and_tokenizer_paths_say_what_is_wrong_with_them(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for path, why in [(folder, "is a directory"), (Path("/dev/null"), "is not a regular file"),
                      (tmp_path / "nope.jsonl", "does not exist")]:
        with pytest.raises(ConfigError, match=f"data.jsonl: file {path} {why}"):
            build_dataset(DataConfig(jsonl=str(path)), seq_len=8, vocab_size=128)
    with pytest.raises(ConfigError, match=f"cannot load a tokenizer from {tmp_path / 'tok'}: no such directory"):
        load_tokenizer(str(tmp_path / "tok"))


def test_set_model_path_null_unsets_the_file_path_under_a_preset(tmp_path):
    """--set outranks the file: with the file's model.path unset, the preset's model config
    applies (it was dropped as if the checkpoint were still named)."""
    conf = tmp_path / "c.yaml"
    conf.write_text(yaml.safe_dump({"model": {"preset": "qwen3-moe-tiny", "path": str(tmp_path)}}))
    cfg = load_config(conf, ["model.path=null"])
    assert cfg.model.path is None and cfg.model.config["model_type"] == "qwen3_moe"
