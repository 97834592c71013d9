"""What a user does with a Transformers checkpoint, per architecture: ``save_pretrained`` by plain
Transformers, ``polyaccel-moe finetune`` from it (full, or LoRA) or ``polyaccel.moe.Trainer`` on
it, then the result loaded back by plain Transformers (+ PEFT for adapters) gives our model's
logits (fp32)."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from polyaccel.moe import AutoModelForCausalLM, BackendConfig, lora
from polyaccel.moe.cli import main
from polyaccel.moe.presets import tiny

ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]


@pytest.fixture(scope="module", params=ARCHS)
def hf_base(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(request.param))
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):  # DeepSeek: zero at init; make it matter
            buf.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(path)
    (path.parent / "run.yaml").write_text("model: {}\ndata: {synthetic: {}}\n")
    return path


def _finetune(base, out, *sets: str) -> None:
    argv = ["finetune", str(base.parent / "run.yaml"), "--set", f"model.path={base}", "--set", f"output_dir={out}"]
    for s in ("train.seq_len=16", "train.micro_batch=2", "train.max_steps=2", "train.lr=1e-2", "train.dtype=fp32",
              "train.device=cpu", "log.progress_bar=false", *sets):
        argv += ["--set", s]
    assert main(argv) == 0


def _logits(model) -> torch.Tensor:
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _ours(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, backend=BackendConfig(backend="cpu"))


def test_a_finetuned_transformers_checkpoint_loads_back_in_plain_transformers(hf_base, tmp_path, capsys):
    _finetune(hf_base, tmp_path / "out")
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    before = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    assert type(plain) is type(before)
    got = _logits(plain)
    torch.testing.assert_close(got, _logits(_ours(tmp_path / "out")), rtol=0, atol=1e-5)
    assert (got - _logits(before)).abs().max() > 1e-2  # it did train


def test_finetuned_lora_adapters_load_in_plain_peft(hf_base, tmp_path, capsys):
    _finetune(hf_base, tmp_path / "adapter", "lora.r=4", "lora.alpha=8", "lora.router=true",
              "model.backend={loss: standard}")
    plain = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32), tmp_path / "adapter")
    got = _logits(plain)
    torch.testing.assert_close(got, _logits(lora.load_adapter(_ours(hf_base), str(tmp_path / "adapter"))),
                               rtol=0, atol=1e-5)
    assert (got - _logits(_ours(hf_base))).abs().max() > 1e-3  # the adapters trained


def test_a_model_trained_by_our_trainer_loads_back_in_plain_transformers(hf_base, tmp_path):
    from polyaccel.moe import Trainer

    model = _ours(hf_base)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 96, (8, 16), generator=g)]
    args = transformers.TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                                          learning_rate=1e-2, use_cpu=True, optim="adamw_torch", report_to=[],
                                          save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    got = _logits(plain)
    torch.testing.assert_close(got, _logits(model), rtol=0, atol=1e-5)
    assert (got - _logits(_ours(hf_base))).abs().max() > 1e-2  # it did train
