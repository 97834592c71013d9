"""More inputs that must fail cleanly with nothing lost: an ``output_dir`` that is a training
checkpoint (another run's, or the one named by ``checkpoint.resume``) or a folder whose only
model-like file is a ``config.json`` (a project folder's own), a model folder whose
safetensors lack some of the model's weights (Transformers would start them from random
values), a data line holding an integer longer than Python converts, checkpoint RNG or
optimizer states that pass their manifest but cannot be restored,
``output_loading_info=True`` through the drop-in ``from_pretrained``, and model configs that
cannot be built (10^8 layers, top-0 routing), refused before building."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyaccel.moe import AutoModelForCausalLM, train
from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.cli import main
from polyaccel.moe.data import build_dataset
from polyaccel.moe.train import resolve_model_config
from polyaccel.moe.train_config import ConfigError, DataConfig, preset

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(tmp_path: Path, *sets: str) -> int:
    return main(["finetune", str(TINY), *[a for s in ("log.progress_bar=false", "train.max_steps=1",
                                                          f"checkpoint.dir={tmp_path / 'ck'}", *sets)
                                          for a in ("--set", s)]])


def test_an_output_dir_that_is_a_checkpoint_is_refused(saved, tmp_path, capsys, monkeypatch):
    """Saving the final model over a checkpoint's files would leave its manifest wrong: the
    checkpoint (another run's, or the one being resumed) could never be resumed from again."""
    step = ckpt.step_dir(tmp_path / "other", 4)
    shutil.copytree(saved, step)
    torch.save({"step": 4, "optimizer": None}, step / ckpt.TRAINER_STATE)
    ckpt.write_manifest(step, 4)
    monkeypatch.setattr(train, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _finetune(tmp_path, f"output_dir={step}") == 2
    assert "is a training checkpoint" in capsys.readouterr().err
    assert ckpt.verify_checkpoint(step) is None and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("marker", ["trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                                    "rng_state_3.pth", "scaler.pt"])
def test_a_transformers_trainer_checkpoint_as_output_dir_is_refused(saved, tmp_path, capsys, monkeypatch, marker):
    """A Transformers ``Trainer`` checkpoint (``checkpoint-N``: weights beside the optimizer's,
    scheduler's and RNG state) was taken for a saved model and had its weights replaced: a
    resume from it then paired new weights with the old optimizer state, with no error."""
    step = tmp_path / "trn" / "checkpoint-2"
    shutil.copytree(saved, step)
    (step / marker).write_bytes(b"state")
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    monkeypatch.setattr(train, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _finetune(tmp_path, f"output_dir={step}") == 2
    assert "is a training checkpoint" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before


def test_a_saved_model_with_the_trainers_training_args_may_be_saved_over(saved, tmp_path):
    """The other side: ``Trainer.save_model``'s final folder (weights, config and its
    ``training_args.bin``) is a saved model, not a checkpoint; the CLI may save over it."""
    out = tmp_path / "final"
    shutil.copytree(saved, out)
    (out / "training_args.bin").write_bytes(b"args")
    assert _finetune(tmp_path, f"output_dir={out}") == 0
    assert (out / "training_args.bin").read_bytes() == b"args"


def test_an_output_dir_holding_a_config_json_but_no_model_is_refused(tmp_path, capsys, monkeypatch):
    """A project folder's own config.json is not a saved model: it would be overwritten."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "config.json").write_text('{"mine": true}')
    (folder / "README.md").write_text("mine")
    monkeypatch.setattr(train, "_load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert _finetune(tmp_path, f"output_dir={folder}") == 2
    assert "already holds files and no saved model (README.md, config.json)" in capsys.readouterr().err
    assert (folder / "config.json").read_text() == '{"mine": true}' and len(list(folder.iterdir())) == 2


def test_a_model_folder_lacking_weights_is_refused_not_trained_from_random_values(saved, tmp_path, capsys):
    model = shutil.copytree(saved, tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    assert _finetune(tmp_path, f"model.path={model}", f"output_dir={tmp_path / 'out'}") == 2
    err = capsys.readouterr().err
    assert "lacks 1 weights of the model (model.norm.weight)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()


def test_a_data_line_with_an_integer_too_long_to_convert_is_a_config_error(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [' + "1" * 5000 + "]}\n")
    with pytest.raises(ConfigError, match=rf"{data.name}:2: not valid JSON"):
        build_dataset(DataConfig(jsonl=str(data)), seq_len=4, vocab_size=128)


def test_from_pretrained_with_output_loading_info_returns_the_model_and_the_info(saved):
    model, info = AutoModelForCausalLM.from_pretrained(saved, output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.backend_config is not None
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("damage", ["rng", "optimizer"])
def test_a_checkpoint_state_that_passes_its_manifest_but_cannot_be_restored_is_a_checkpoint_error(saved, tmp_path,
                                                                                                  damage):
    """Rewritten files with a matching manifest (tampered, or not written by polyaccel): the
    resume names the file (exit 2), no raw KeyError/RuntimeError traceback."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    optimizer = torch.optim.AdamW(model.parameters())
    step = ckpt.save_checkpoint(tmp_path / "ck", 1, model, optimizer, {})
    if damage == "rng":
        name = "rng_rank0.pt"
        torch.save({}, step / name)
    else:
        name = ckpt.TRAINER_STATE
        torch.save({"step": 1, "optimizer": {"state": "x", "param_groups": 5}}, step / name)
    ckpt.write_manifest(step, 1)
    with pytest.raises(ckpt.CheckpointError, match=f"{name}: its .* cannot be restored"):
        ckpt.load_trainer_state(step, model, optimizer)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), MemoryError(),
                                   torch.distributed.DistBackendError("NCCL error")])
def test_running_out_of_memory_while_restoring_is_not_blamed_on_the_checkpoint(saved, tmp_path, monkeypatch, error):
    """A restore that runs out of memory (or loses a peer) says so; calling the checkpoint one
    that "cannot be restored" would send the user to delete a good checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    optimizer = torch.optim.AdamW(model.parameters())
    step = ckpt.save_checkpoint(tmp_path / "ck", 1, model, optimizer, {})

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(optimizer, "load_state_dict", fail)
    with pytest.raises(type(error)):
        ckpt.load_trainer_state(step, model, optimizer)


@pytest.mark.parametrize("edit, why", [
    ({"num_hidden_layers": 100_000_000}, "take at least"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
])
def test_a_model_config_json_that_cannot_be_built_is_refused_before_building(saved, tmp_path, capsys, monkeypatch,
                                                                             edit, why):
    """A config.json of 10^8 layers would build modules until the host runs out of memory,
    before the exact count on the meta device; top-0 routing fails only at the first forward.
    Both are refused (exit 2) before any model is built or anything written."""
    import json

    model = shutil.copytree(saved, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("the model was built"))
    assert _finetune(tmp_path, f"model.path={model}", f"output_dir={tmp_path / 'out'}") == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()


def test_the_layer_floor_is_checked_where_the_model_is_built_not_on_a_driver(monkeypatch):
    """A Ray driver validates the run but builds nothing: a DeepSeek-V3-sized config passes
    validate() on a driver with 1 GiB free, and is refused only where it would be built."""
    from polyaccel.moe.train_config import load_config

    monkeypatch.setattr(train, "available_memory", lambda device: 2**30)
    cfg = load_config(TINY, [])
    big = resolve_model_config(preset("qwen3-moe-tiny").model)
    big.num_hidden_layers, big.hidden_size = 61, 7168
    train.validate(cfg, big)
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="take at least"):
        train.build_model(cfg.model, big, dtype=torch.bfloat16, device=torch.device("cpu"))


@pytest.mark.parametrize("override", ["decoder_sparse_step=0", "pad_token_id=1000", "pad_token_id=-2",
                                      "initializer_range=-1.0", "rope_parameters.rope_theta=abc",
                                      "rope_parameters.rope_theta=0", "dtype=abc"])
def test_odd_model_config_values_are_one_line_before_the_model_is_built(tmp_path, capsys, monkeypatch, override):
    """Each of these raised a traceback (ZeroDivisionError in a layer's constructor, an assertion
    in the embedding, ``normal_`` with a negative std, a TypeError in the rotary frequencies,
    an AttributeError from Transformers' config) with exit 1; now exit 2 naming the field."""
    monkeypatch.setattr(train, "_load_model", lambda *a, **k: pytest.fail("the model was built"))
    assert _finetune(tmp_path, f"output_dir={tmp_path / 'out'}", f"model.config.{override}") == 2
    err = capsys.readouterr().err
    named = "model.config: module 'torch' has no attribute 'abc'" if override == "dtype=abc" else \
        override.split("=")[0].split(".")[-1]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and named in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields,message", [({"n_group": 3}, "not a multiple of n_group"),
                                            ({"n_group": 0}, "n_group=0 must be at least 1"),
                                            ({"n_group": 2, "topk_group": 5}, "topk_group=5 is more than n_group=2"),
                                            ({"v_head_dim": 0}, "v_head_dim=0 must be at least 1")])
def test_deepseek_v3_router_groups_that_cannot_route_are_refused(fields, message):
    """DeepSeek-V3's grouped router reshapes the experts into n_group groups and keeps the best
    topk_group: a count that does not divide them, or more groups kept than exist, failed at
    the first forward with a shape error."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{"n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2,
                                 **fields})
    with pytest.raises(ConfigError, match=message):
        train._check_model_sizes(config)
