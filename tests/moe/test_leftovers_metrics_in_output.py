"""A ``log.metrics_jsonl`` inside ``output_dir`` at a name the final save writes or deletes
(``config.json``, ``model.safetensors``, a tokenizer file, anything in its staging folder...)
is refused before anything loads (exit 2, naming both keys): the final save used to overwrite
or delete the run's metrics log. Another name in ``output_dir`` (``metrics.jsonl``) still runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyaccel.moe.cli import main
from polyaccel.moe.train import check_outputs
from polyaccel.moe.train_config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _cfg(out: Path, metrics: Path):
    return load_config(TINY, [f"output_dir={out}", f"log.metrics_jsonl={metrics}", "checkpoint.dir=null"])


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                                  "tokenizer_config.json", "special_tokens_map.json", "adapter_model.safetensors",
                                  "model-00001-of-00002.safetensors", "pytorch_model.bin", "README.md",
                                  ".polyaccel-partial/metrics.jsonl"])
def test_a_metrics_log_the_final_save_would_overwrite_is_refused(tmp_path, name):
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as e:
        check_outputs(_cfg(out, out / name))
    assert e.value.key == "log.metrics_jsonl"
    assert (f"log.metrics_jsonl: {out / name} is {name} in output_dir {out}, a file the final save writes"
            in str(e.value))
    assert f"Name another file for log.metrics_jsonl (e.g. {out / 'metrics.jsonl'})" in str(e.value)
    assert not out.exists()


def test_through_a_link_to_output_dir_too(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "link").symlink_to(out)
    with pytest.raises(ConfigError, match="is config.json in output_dir"):
        check_outputs(_cfg(out, tmp_path / "link/config.json"))


@pytest.mark.parametrize("name", ["metrics.jsonl", "model.fp16.safetensors", "sub/config.json"])
def test_other_names_in_output_dir_are_fine(tmp_path, name):
    out = tmp_path / "out"
    check_outputs(_cfg(out, out / name))


def test_the_cli_exits_2_before_training(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["finetune", str(TINY), "--set", f"output_dir={out}", "--set", f"log.metrics_jsonl={out}/config.json",
                 "--set", "log.progress_bar=false", "--set", "train.max_steps=1", "--set", "checkpoint.dir=null"])
    std = capsys.readouterr()
    assert code == 2 and '"step"' not in std.out, std.err
    assert std.err.startswith(f"polyaccel-moe: error: log.metrics_jsonl: {out}/config.json is config.json in "
                              f"output_dir {out}"), std.err
    assert not out.exists()
