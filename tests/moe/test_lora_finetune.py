"""``polyaccel-moe finetune`` with a ``lora:`` section: trains only the adapters of a tiny
model, checkpoints and resumes them exactly, writes a PEFT adapter directory; and LoRA under
``transformers.Trainer``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import ConfigError, load_config

pytest.importorskip("peft")


def _cfg(root: Path, *overrides: str):
    return load_config(values={"model": {"preset": "qwen3-moe-tiny"}}, overrides=[
        "lora.r=4", "lora.alpha=8", "lora.router=true", "train.lr=1e-2", "train.max_steps=4",
        f"checkpoint.dir={root}/ck", "checkpoint.every_steps=2", f"output_dir={root}/out",
        "log.progress_bar=false", *overrides])


def _adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def test_finetune_lora_trains_adapters_and_resumes_exactly(tmp_path):
    straight = finetune(_cfg(tmp_path / "a"))
    assert straight.steps == 4
    out = tmp_path / "a/out"
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    weights = _adapter(out)
    assert any(".mlp.experts.lora_A" in k for k in weights) and any(".mlp.gate.lora_B" in k for k in weights)
    assert all("lora_" in k for k in weights)  # only adapters: the base stays frozen
    assert all(weights[k].abs().max() > 0 for k in weights if "lora_B" in k)  # B starts at zero: it trained

    first = finetune(_cfg(tmp_path / "b"), stop_after=2)
    second = finetune(_cfg(tmp_path / "b"))
    assert second.start_step == 2
    assert first.losses + second.losses == straight.losses
    resumed = _adapter(tmp_path / "b/out")
    assert resumed.keys() == weights.keys()
    for k in weights:
        assert torch.equal(resumed[k], weights[k]), k


def test_finetune_lora_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="dropout"):
        finetune(_cfg(tmp_path, "lora.dropout=0.1"))
    with pytest.raises(ConfigError, match="target_modules"):
        finetune(_cfg(tmp_path, "lora.target_modules=q_proj"))
    with pytest.raises(ConfigError, match="lora.recompute"):
        _cfg(tmp_path, "lora.recompute=full")


def test_lora_keeps_the_graphed_micro_step_unless_recomputing(caplog):
    """The LoRA finetune path keeps the loop's graphed micro-step (24-layer H200: 31,649 tokens/s
    graphed vs 20,098 eager, same losses); selective recomputation turns it off (logged), and
    asked for explicitly with it is an error. ``train.cuda_graph=True`` stands for what the
    loop's fast-path plan decides on a GPU."""
    import dataclasses

    from polyaccel.moe import AutoModelForCausalLM, presets
    from polyaccel.moe.lora import finetune_setup

    train = dataclasses.replace(_cfg(Path("/nonexistent")).train, cuda_graph=True, wgrad_window=4)
    for recompute, want in (("none", True), ("selective", False)):
        model = AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe"))
        section = dataclasses.replace(_cfg(Path("/nonexistent")).lora, recompute=recompute)
        _, t = finetune_setup(model, section, train, None)
        assert t.cuda_graph is want and t.wgrad_window == 1, recompute
    assert "lora.recompute=selective" in caplog.text
    with pytest.raises(ConfigError, match="cuda_graph=true"):
        finetune_setup(AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe")), section, train, None,
                       graph_asked=True)


def test_lora_under_transformers_trainer(tmp_path):
    import transformers

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, lora, presets

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe"), backend=BackendConfig())
    model = lora.apply_lora(model, lora.LoraSettings(r=4, alpha=8, recompute="selective"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(3, 97, (8, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any(".mlp.experts.lora_B" in n for n in changed)
