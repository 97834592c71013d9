"""Damaged inputs a fine-tuning run reads, each refused in one line with exit 2 before training
(no traceback): a tokenizer whose files parse but are not what Transformers or tokenizers
expect (raised as KeyError, TypeError, AttributeError or tokenizers' bare Exception, which
only ``output_dir``'s tokenizer check caught: with data to tokenize and no output_dir the run
died with a traceback, exit 1); and a ``step_N`` in ``checkpoint.dir`` that is a link to a
checkpoint kept elsewhere, which ``checkpoint.keep_last`` pruned by deleting the files of the
folder it points to (all but its manifest), outside ``checkpoint.dir``. LoRA runs: a
``lora.target_modules`` naming no module (a typo) or a module PEFT cannot adapt, and a
checkpoint's adapter files that cannot be loaded (one resumed unverified, without a manifest),
were PEFT tracebacks (exit 1); adapters on ``lm_head`` with the fused loss (the default) were
never trained, silently beside other targets, a backward error alone. Model configs of an odd
rotary head size (``head_dim: 7``, or ``hidden_size`` / heads odd) or an activation nobody
implements crashed at the first forward or while the model was built, with a traceback. A config
file setting one key twice (a second ``train:`` section) trained with the first one dropped,
silently: YAML keeps the last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
LORA = REPO / "packages/moe/examples/lora_tiny_cpu.yaml"


def _lora(tmp_path: Path, *sets: str) -> int:
    sets = ("log.progress_bar=false", "train.max_steps=1", "train.grad_accum=1", "checkpoint.every_steps=1",
            f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}", *sets)
    return main(["finetune", str(LORA), *[a for s in sets for a in ("--set", s)]])


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", {"version": "1.0", "model": {"type": "WordLevel"}}),  # no added_tokens: KeyError
    ("tokenizer.json", {"version": "1.0", "added_tokens": [], "model": {"type": "Nope"}}),  # tokenizers' Exception
    ("tokenizer_config.json", [1, 2]),  # not an object: TypeError
    ("tokenizer_config.json", {"added_tokens_decoder": 5}),  # AttributeError
])
def test_a_damaged_tokenizer_for_the_data_is_one_line_and_exit_2(tmp_path, with_tokenizer, capsys, name, content):
    base = with_tokenizer()
    (base / name).write_text(json.dumps(content))
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a a a"}\n')
    code = main(["finetune", str(TINY), "--set", f"model.path={base}", "--set", "model.preset=null",
                 "--set", f"data.jsonl={data}", "--set", "output_dir=null", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                 "--set", "log.progress_bar=false", "--set", "train.max_steps=1", "--set", "train.seq_len=8"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"polyaccel-moe: error: cannot load a tokenizer from {base}: " in err
    assert "Traceback" not in err and not (tmp_path / "ck").exists()


def test_pruning_a_linked_checkpoint_removes_the_link_never_the_files_it_points_to(tmp_path):
    root, kept = tmp_path / "ck", tmp_path / "archive" / "step_00000001"
    for d, step in ((kept, 1), (ckpt.step_dir(root, 2), 2), (ckpt.step_dir(root, 3), 3)):
        d.mkdir(parents=True)
        for name in ("config.json", "model.safetensors", ckpt.TRAINER_STATE):
            (d / name).write_bytes(name.encode() * step)
        ckpt.write_manifest(d, step)
    ckpt.step_dir(root, 1).symlink_to(kept, target_is_directory=True)
    before = sorted(p.name for p in kept.iterdir())
    ckpt._prune(root, ckpt.step_dir(root, 3), keep_last=1)
    assert sorted(p.name for p in kept.iterdir()) == before, "the archived checkpoint lost its files"
    assert ckpt.verify_checkpoint(kept) is None
    assert [p.name for p in root.iterdir()] == ["step_00000003"]


@pytest.mark.parametrize("targets, why", [
    ("[q_prj]", "lora: PEFT cannot place the adapters (NoMatchingPeftModuleError: Target modules {'q_prj'} not found"),
    ("[mlp]", "lora: PEFT cannot place the adapters (ValueError: Target module SparseMoeBlock is not supported."),
    ("[lm_head]", "lora.target_modules: adapters on lm_head are never trained with the fused loss"),
    ("[q_proj, lm_head]", "lora.target_modules: adapters on lm_head are never trained with the fused loss"),
])
def test_lora_targets_it_cannot_train_are_one_line_and_exit_2(tmp_path, capsys, targets, why):
    assert _lora(tmp_path, f"lora.target_modules={targets}", "lora.experts=false") == 2
    err = capsys.readouterr().err
    assert f"polyaccel-moe: error: {why}" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "ck").exists()


def test_lora_adapters_that_cannot_be_loaded_on_resume_are_one_line_and_exit_2(tmp_path, capsys):
    assert _lora(tmp_path) == 0
    step = ckpt.step_dir(tmp_path / "ck", 1)
    (step / ckpt.MANIFEST).unlink()  # as one written before manifests: resumed unverified when named
    adapters = step / "adapter_model.safetensors"
    adapters.write_bytes(adapters.read_bytes()[: adapters.stat().st_size // 2])
    capsys.readouterr()
    assert _lora(tmp_path, "train.max_steps=2", f"checkpoint.resume={step}") == 2
    err = capsys.readouterr().err
    assert (f"polyaccel-moe: error: checkpoint.resume: the LoRA adapters in {step} cannot be loaded (SafetensorError: "
            in err and "Traceback" not in err)


@pytest.mark.parametrize("sets, why", [
    (["model.config.head_dim=7"], "rotary head size is 7"),
    (["model.config.head_dim=null", "model.config.hidden_size=36"], "rotary head size is 9"),
    (["model.config.model_type=mixtral", "model.config.head_dim=null", "model.config.hidden_size=36"],
     "rotary head size is 9"),
    (["model.config.hidden_act=nope"], "hidden_act='nope' is not an activation polyaccel or Transformers knows"),
])
def test_model_configs_no_forward_can_run_are_one_line_and_exit_2(tmp_path, capsys, sets, why):
    args = ["log.progress_bar=false", "train.max_steps=1", f"checkpoint.dir={tmp_path / 'ck'}", "output_dir=null", *sets]
    assert main(["finetune", str(TINY), *[a for s in args for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert f"polyaccel-moe: error: the model config's {why}" in err and "Traceback" not in err
    assert not (tmp_path / "ck").exists()


def test_an_even_head_size_that_hidden_size_does_not_divide_into_still_trains(tmp_path, capsys):
    args = ["log.progress_bar=false", "train.max_steps=1", f"checkpoint.dir={tmp_path / 'ck'}", "output_dir=null",
            "model.config.head_dim=6"]
    assert main(["finetune", str(TINY), *[a for s in args for a in ("--set", s)]]) == 0


def test_a_config_that_sets_a_key_twice_is_refused_naming_both_lines(tmp_path, capsys):
    conf = tmp_path / "sft.yaml"
    conf.write_text(f"model:\n  preset: qwen3-moe-tiny\ndata:\n  synthetic: {{}}\ntrain:\n  seq_len: 16\n  device: cpu\n"
                    f"checkpoint:\n  dir: {tmp_path / 'ck'}\ntrain:\n  max_steps: 1\n")
    assert main(["finetune", str(conf), "--set", "log.progress_bar=false"]) == 2
    err = capsys.readouterr().err
    assert f"polyaccel-moe: error: {conf}: the key 'train' appears twice in one mapping (lines 5 and 10)" in err
    assert not (tmp_path / "ck").exists()
    assert main(["finetune", str(TINY), "--set", "train={lr: 1, lr: 2}"]) == 2
    assert "the key 'lr' appears twice" in capsys.readouterr().err


@pytest.mark.parametrize("sets", [["train.grad_accum=10000000000"], ["train.micro_batch=10000000000"]])
def test_a_step_whose_token_ids_could_not_fit_in_memory_is_refused_at_once(tmp_path, capsys, sets):
    """A typo'd ``grad_accum`` (10^10) built that many micro-batches before the first step:
    silent until the machine ran out of memory. It is refused before the model loads."""
    argv = ["finetune", str(TINY), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "output_dir=null",
            "--set", "log.progress_bar=false", *[a for s in sets for a in ("--set", s)]]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "GiB of token ids, over half of this machine's memory" in err and "Traceback" not in err
