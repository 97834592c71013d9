"""``polyaccel-moe`` CLI and config loading: precedence, clear errors, presets, an in-process
fine-tune whose output loads in plain Transformers, and ``bench``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from polyaccel.moe.cli import main
from polyaccel.moe.train_config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "packages/moe/examples"


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_precedence_cli_over_file_over_preset(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    cfg_file = _write(tmp_path / "conf/c.yaml", {"model": {"preset": "qwen3-moe-tiny"},
                                                 "train": {"lr": "2e-4", "max_steps": 7},
                                                 "checkpoint": {"dir": "ck"}, "data": {"tokenizer": "tok"}})
    monkeypatch.chdir(tmp_path)
    cfg = load_config(cfg_file, ["train.max_steps=9", "model.config.num_hidden_layers=1"])
    assert cfg.train.max_steps == 9  # --set wins over the file
    assert cfg.train.lr == 2e-4  # the file wins over the preset (YAML's "2e-4" string accepted)
    assert cfg.train.seq_len == 32 and cfg.model.config["hidden_size"] == 32  # preset defaults
    assert cfg.model.config["num_hidden_layers"] == 1  # nested mappings merge key by key
    assert cfg.data.tokenizer == str(tmp_path / "conf/tok")  # inputs: relative to the config file
    assert cfg.checkpoint.dir == str(tmp_path / "ck")  # outputs: relative to the working directory
    # A file naming another data source replaces the preset's synthetic data.
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    assert load_config(values={"model": {"preset": "qwen3-moe-tiny"}, "data": {"jsonl": str(data)}}).data.synthetic is None


@pytest.mark.parametrize("raw, message", [
    ({"train": {"lrr": 1.0}}, "unknown config key 'train.lrr' (did you mean 'lr'?)"),
    ({"trian": {}}, "unknown config key 'trian' (did you mean 'train'?)"),
    ({"train": {"micro_batch": "two"}}, "train.micro_batch: expected an integer, got 'two'"),
    ({"train": {"dtype": "fp16"}}, "train.dtype: 'fp16' is not one of 'bf16', 'fp32'"),
    ({"train": {"betas": [0.9]}}, "train.betas: expected a list of 2 values"),
    ({"train": {"optimizer": "adam"}}, "train.optimizer: 'adam' is not one of 'auto', 'adamw', 'flat_adamw'"),
    ({"train": {"activation_checkpointing": "yes"}}, "expected true/false"),
    ({"model": {"preset": "qwen3-tiny"}}, "unknown preset 'qwen3-tiny' (did you mean 'qwen3-moe-tiny'?)"),
])
def test_config_errors_are_clear(raw, message):
    with pytest.raises(ConfigError) as e:
        load_config(values=raw)
    assert message in str(e.value)


def test_bad_set_syntax():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(overrides=["train.lr"])


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("sets, message", [
    (["data.jsonl=missing.jsonl"], "missing.jsonl does not exist"),
    (["train.seq_len=1000"], "train.seq_len=1000 exceeds the model's max_position_embeddings=256"),
    (["parallel.ep=2"], "ep=2 must divide the number of ranks"),
    (["parallel.dense=replicate", "parallel.dp_replicate=2"], "parallel.dp_replicate is an FSDP (HSDP) setting"),
    (["parallel.dense=shard"], "parallel.dense"),
    (["data.synthetic.vocab=1000"], "data.synthetic.vocab=1000 exceeds the model's vocab_size=128"),
    (["model.backend.expert=eager"], "unknown config key 'model.backend.expert' (did you mean 'experts'?)"),
])
def test_finetune_refuses_bad_configs_with_exit_2(capsys, tmp_path, sets, message):
    args = [a for s in sets for a in ("--set", s)]
    code, _, err = _run(capsys, "finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"),
                        "--set", f"checkpoint.dir={tmp_path}/ck", *args)
    assert code == 2
    assert message in err


@pytest.mark.parametrize("sets, message", [
    (["train.lr=-1"], "train.lr must be a finite number >= 0, got -1.0"),
    (["train.lr=nan"], "train.lr must be a finite number >= 0, got nan"),
    (["train.weight_decay=-0.1"], "train.weight_decay must be a finite number >= 0"),
    (["train.eps=0"], "train.eps must be > 0 (AdamW divides by sqrt(v) + eps"),
    (["train.betas=[0.9,1.0]"], "train.betas must each be in [0, 1)"),
    (["train.grad_clip=-1"], "train.grad_clip must be a finite number >= 0 (0 or null: no clipping), got -1.0"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio must be in [0, 1]"),
    (["train.warmup_steps=-3"], "train.warmup_steps must be >= 0"),
    (["log.peak_tflops=-5"], "log.peak_tflops must be a number > 0"),
    (["data.synthetic.vocab=-5"], "data.synthetic.vocab must be >= 1"),
    (["lora.alpha=-2"], "lora: lora.alpha=-2.0 must be a number > 0"),
    (["lora.r=0"], "lora: lora.r=0 must be a positive integer"),
    (["model.config.num_experts_per_tok=9"], "routes each token to num_experts_per_tok=9 experts of 4"),
    (["model.config.hidden_size=abc"], "model.config: Validation error for field 'hidden_size'"),
])
def test_bad_numbers_are_refused_before_anything_is_written(capsys, tmp_path, sets, message):
    """Values that would train backwards (a negative clip or decay), stop later (a NaN lr) or
    crash mid-run are configuration errors: exit 2, nothing created."""
    args = [a for s in sets for a in ("--set", s)]
    code, _, err = _run(capsys, "finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"),
                        "--set", f"checkpoint.dir={tmp_path}/ck", "--set", f"output_dir={tmp_path}/out", *args)
    assert code == 2 and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["bench", "--preset", "qwen3-moe-tiny", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["bench", "--preset", "qwen3-moe-tiny", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    (["bench", "--preset", "qwen3-moe-tiny", "--peak-tflops", "0"], "argument --peak-tflops: must be a number > 0"),
    (["finetune", "c.yaml", "--ray", "--workers", "0"], "argument --workers: must be >= 1, got 0"),
])
def test_bad_counts_on_the_command_line_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_model_whose_weights_cannot_fit_is_refused_before_it_is_built(capsys, tmp_path, monkeypatch):
    from polyaccel.moe import train

    built = []
    monkeypatch.setattr(train, "available_memory", lambda device: 50_000)  # above the layer floor, below the weights
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: built.append(self) or self)
    code, _, err = _run(capsys, "finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"),
                        "--set", f"checkpoint.dir={tmp_path}/ck", "--set", f"output_dir={tmp_path}/out")
    assert code == 2 and "the model's weights alone take" in err and "cpu has 0.0 GiB free" in err
    assert not built and not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="Linux only")
def test_host_memory_counts_what_the_kernel_can_reclaim():
    """MemAvailable (page cache included), not MemFree: a machine whose RAM is mostly cache
    must not refuse a model that fits."""
    from polyaccel.moe.train import available_memory

    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()}
    assert available_memory(torch.device("cpu")) == pytest.approx(info["MemAvailable"], rel=0.1)


def test_unreadable_model_config_and_data_are_config_errors(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text("{not json")
    code, _, err = _run(capsys, "finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"),
                        "--set", f"model.path={tmp_path / 'model'}")
    assert code == 2 and "model.path: cannot read" in err and "config.json" in err
    from polyaccel.moe.data import build_dataset
    from polyaccel.moe.train_config import DataConfig

    for name, data, text, message in [("a.jsonl", b'{"input_ids": [1]}\n\xff\xfe\n', None, "a.jsonl:2: not UTF-8 text"),
                                      ("b.txt", b"\xff\xfe", True, "b.txt:1: not UTF-8 text"),
                                      ("c.jsonl", b'{"text": 5}\n', None, "c.jsonl:1: 'text' must be a string"),
                                      ("d.jsonl", b'{"prompt": "a", "completion": [1]}\n', None,
                                       "d.jsonl:1: 'completion' must be a string"),
                                      # valid JSON, no text: the tokenizer raised a TypeError traceback
                                      ("e.jsonl", b'{"text": "\\ud800 cat"}\n', None,
                                       "e.jsonl:1: 'text' is not valid Unicode"),
                                      ("f.jsonl", b'{"prompt": "a\\udfff", "completion": "b"}\n', None,
                                       "f.jsonl:1: 'prompt' is not valid Unicode")]:
        (tmp_path / name).write_bytes(data)
        cfg = DataConfig(text=str(tmp_path / name)) if text else DataConfig(jsonl=str(tmp_path / name))
        with pytest.raises(ConfigError, match=message):
            build_dataset(cfg, seq_len=4, vocab_size=128, tokenizer_path=str(tmp_path / "no-tokenizer"))


def test_presets_and_help(capsys):
    code, out, _ = _run(capsys, "presets")
    assert code == 0
    assert "qwen3-moe-tiny" in out and "qwen3-30b-a3b-L8" in out and "5.4 GFLOP/token" in out
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    assert "torchrun --nproc-per-node" in capsys.readouterr().out


@pytest.mark.parametrize("name, full, billions, layers", [
    ("moonlight-16b-a3b-L8", "moonlight_16b_a3b", 15.96, 8),   # DeepSeek-V3 architecture (MLA, shared experts)
    ("qwen3-235b-a22b-L2", "qwen3_235b_a22b", 235.09, 2),
    ("mixtral-8x7b-L4", "mixtral_8x7b", 46.70, 4),
])
def test_benchmark_presets_have_the_published_sizes_and_get_our_layers(name, full, billions, layers):
    """Each benchmark preset's full model has its published parameter count (counted on the meta
    device by Transformers' own class), and the preset builds our model class with the same
    parameters as Transformers' at the preset's depth."""
    import transformers

    from polyaccel.moe import AutoModelForCausalLM, presets
    from polyaccel.moe.models.base import MoeForCausalLM
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import preset

    with torch.device("meta"):
        whole = transformers.AutoModelForCausalLM.from_config(getattr(presets, full)())
        hf = transformers.AutoModelForCausalLM.from_config(resolve_model_config(preset(name).model))
        ours = AutoModelForCausalLM.from_config(resolve_model_config(preset(name).model))
    assert sum(p.numel() for p in whole.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert isinstance(ours, MoeForCausalLM) and ours.config.num_hidden_layers == layers
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_example_configs_load(tmp_path):
    for example in sorted(EXAMPLES.glob("*.yaml")):
        cfg = load_config(example)
        assert cfg.train.max_steps > 0, example


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_runs_as_its_finetune_command_says(capsys, example, monkeypatch):
    """Each example's comment says ``polyaccel-moe finetune <it>``: the command must reach
    training, not stop at "neither output_dir nor checkpoint.dir" (the L8 bench example did)."""
    def reached(cfg):
        raise ConfigError("reached training")

    monkeypatch.setattr("polyaccel.moe.train.finetune", reached)
    assert f"finetune packages/moe/examples/{example}" in (EXAMPLES / example).read_text()
    code, _, err = _run(capsys, "finetune", str(EXAMPLES / example))
    assert code == 2 and "reached training" in err, err


def test_finetune_in_process_writes_a_transformers_checkpoint(capsys, tmp_path):
    code, out, _ = _run(capsys, "finetune", str(EXAMPLES / "tiny_synthetic_cpu.yaml"),
                        "--set", f"checkpoint.dir={tmp_path}/ck", "--set", f"output_dir={tmp_path}/out",
                        "--set", "train.max_steps=3", "--set", "log.progress_bar=false",
                        "--set", "train.activation_checkpointing=true")
    assert code == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["world_size"] == 1 and summary["mfu"] is None
    assert summary["tokens_per_step"] == 2 * 2 * 32 and summary["tokens_per_s_per_device"] > 0
    assert summary["last_checkpoint"].endswith("step_00000003")

    import torch
    import transformers

    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert plain.config.num_hidden_layers == 2
    ids = torch.randint(0, 128, (1, 16))
    assert torch.isfinite(plain(input_ids=ids, labels=ids).loss)
    # The weights are as readable as the config (safetensors writes 0600 on its own).
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir() if p.is_file()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_bench_reports_throughput(capsys):
    code, out, _ = _run(capsys, "bench", "--preset", "qwen3-moe-tiny", "--steps", "2", "--warmup", "1",
                        "--peak-tflops", "1")
    assert code == 0
    row = json.loads(out.strip().splitlines()[-1])
    assert row["preset"] == "qwen3-moe-tiny" and row["steps"] == 2
    assert row["tokens_per_s_per_device"] > 0 and 0 < row["mfu"] < 1
    assert row["flops_per_token"] == pytest.approx(112128.0)


@pytest.mark.parametrize("where", ["flag", "env"])
def test_ray_address_auto_is_a_config_error_before_training(tmp_path, capsys, monkeypatch, where):
    """'auto' (the flag, or RAY_ADDRESS) would join whatever cluster a local user advertises:
    exit 2 naming --address, before any cluster is joined or model built."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    extra = ["--address", "auto"] if where == "flag" else []
    if where == "env":
        monkeypatch.setenv("RAY_ADDRESS", "auto")
    cfg = _write(tmp_path / "c.yaml", {"model": {"preset": "qwen3-moe-tiny"}, "output_dir": str(tmp_path / "out")})
    assert main(["finetune", str(cfg), "--ray", "--workers", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert "--address" in err and "'auto'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
