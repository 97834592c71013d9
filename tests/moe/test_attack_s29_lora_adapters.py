"""Attack pass, session 29: LoRA checkpoints whose adapter files are not this run's adapters.

A LoRA resume read the checkpoint's ``adapter_config.json`` and ``adapter_model.*`` through
PEFT, which leaves an adapter the file lacks at its fresh initialisation and drops tensors the
model has no place for (a warning at most), builds the adapters the file's config names (another
``lora_alpha`` or ``target_modules`` than the run's ``lora`` section) and falls back to a
pickled ``adapter_model.bin``. Each of those resumed without an error (the losses changed);
each is now one line, exit 2, before any step. The manifest is rewritten after each edit, as
for a checkpoint whose files were all written that way (another tool, an old copy).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.cli import main

pytest.importorskip("peft")

SETS = ["model.preset=qwen3-moe-tiny", "data.synthetic={}", "lora.r=4", "lora.alpha=8", "train.seq_len=16",
        "train.micro_batch=1", "train.grad_accum=1", "train.dtype=fp32", "train.device=cpu", "log.progress_bar=false",
        "checkpoint.every_steps=1"]
WEIGHTS = "adapter_model.safetensors"


def _finetune(root: Path, *sets: str) -> int:
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.yaml").write_text("lora: {}\n")
    args = [*SETS, f"checkpoint.dir={root / 'ck'}", f"output_dir={root / 'out'}", *sets]
    return main(["finetune", str(root / "run.yaml"), *[a for s in args for a in ("--set", s)]])


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory) -> Path:
    """Step 1 of a tiny LoRA run (r=4, alpha=8, q/k/v/o + experts)."""
    root = tmp_path_factory.mktemp("lora")
    assert _finetune(root, "train.max_steps=1") == 0
    return ckpt.step_dir(root / "ck", 1)


def _edit_weights(d: Path, edit) -> None:
    weights = load_file(d / WEIGHTS)
    edit(weights)
    save_file(weights, d / WEIGHTS)


def _edit_config(d: Path, **fields) -> None:
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, **fields}))


def _drop_layer_1(weights: dict[str, torch.Tensor]) -> None:
    for k in [k for k in weights if ".layers.1." in k]:
        del weights[k]


def _add_layer_7(weights: dict[str, torch.Tensor]) -> None:  # an adapter of a deeper model
    weights["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)


def _pickled(d: Path) -> None:
    torch.save(load_file(d / WEIGHTS), d / "adapter_model.bin")
    (d / WEIGHTS).unlink()


DAMAGE = {
    "adapters missing": (lambda d: _edit_weights(d, _drop_layer_1), "adapter tensors are missing"),
    "adapters of another model": (lambda d: _edit_weights(d, _add_layer_7), "for modules this model lacks"),
    "another alpha": (lambda d: _edit_config(d, lora_alpha=64), "has lora_alpha=64, this run's lora section gives 8"),
    "fewer target modules": (lambda d: _edit_config(d, target_modules=["q_proj"]), "has target_modules=['q_proj']"),
    "another rank": (lambda d: _edit_config(d, r=8), "has r=8, this run's lora section gives 4"),
    "pickled weights": (_pickled, "adapter_model.safetensors is missing (weights are read from safetensors only"),
    "not a JSON object": (lambda d: (d / "adapter_config.json").write_text("[]"), "is not a JSON object"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_lora_checkpoint_whose_adapters_are_not_the_runs_is_refused_in_one_line(lora_checkpoint, tmp_path, capsys,
                                                                                 damage):
    edit, message = DAMAGE[damage]
    src = tmp_path / "src"
    shutil.copytree(lora_checkpoint, src)
    edit(src)
    ckpt.write_manifest(src, 1)
    run = tmp_path / "run"
    assert _finetune(run, "train.max_steps=2", f"checkpoint.resume={src}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("polyaccel-moe: error:") == 1
    assert f"the LoRA adapters in {src} cannot be loaded" in err and message in err, err
    assert not (run / "out").exists() and not ckpt.complete_checkpoints(run / "ck")


def test_the_intact_lora_checkpoint_resumes(lora_checkpoint, tmp_path):
    """The control: the same copy, rewritten manifest and all, resumes."""
    src = tmp_path / "src"
    shutil.copytree(lora_checkpoint, src)
    ckpt.write_manifest(src, 1)
    assert _finetune(tmp_path / "run", "train.max_steps=2", f"checkpoint.resume={src}") == 0


def test_load_adapter_refuses_an_adapter_file_that_lacks_or_adds_tensors(lora_checkpoint, tmp_path):
    from polyaccel.moe import AutoModelForCausalLM, lora
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import preset

    def tiny():  # the run's model (the preset's 4 experts)
        return AutoModelForCausalLM.from_config(resolve_model_config(preset("qwen3-moe-tiny").model))

    for name, edit, message in (("lacks", _drop_layer_1, "adapter tensors are missing"),
                                ("adds", _add_layer_7, "for modules this model lacks")):
        src = tmp_path / name
        shutil.copytree(lora_checkpoint, src)
        _edit_weights(src, edit)
        with pytest.raises(ValueError, match=message):
            lora.load_adapter(tiny(), str(src))
    model = lora.load_adapter(tiny(), str(lora_checkpoint))
    assert any("lora_B" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("sets", [["lora.experts=false", "lora.dropout=0.1"], ["lora.target_modules=[]"]],
                         ids=["attention only", "experts only"])
def test_lora_sections_whose_saved_config_leaves_a_list_empty_resume(tmp_path, sets):
    """PEFT writes an unset list field as [] (``target_parameters`` with no expert or router
    adapters) where the run's config has None: the same adapters, not a mismatch."""
    assert _finetune(tmp_path, "train.max_steps=1", *sets) == 0
    assert _finetune(tmp_path, "train.max_steps=2", *sets) == 0
    assert ckpt.find_resume(tmp_path / "ck", "auto") == ckpt.step_dir(tmp_path / "ck", 2)
