"""Finetune configs and model folders an attacker could hand a user: a model folder whose
``config.json`` names its own Python (``auto_map``) is refused, never run, even when stdin
answers Transformers' "run the custom code? [y/N]" prompt with "y"; YAML aliases that expand
to billions of values (a "billion laughs" config) or into themselves are refused at once,
while ordinary anchors and merge keys still load."""

from __future__ import annotations

import io
import json
import time

import pytest

from polyaccel.moe.train import resolve_model_config
from polyaccel.moe.train_config import ConfigError, ModelConfig, load_config


def test_a_model_folder_with_its_own_code_is_refused_not_run(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"model_type": "custom_moe", "auto_map": {"AutoConfig": "custom.CustomConfig"}}))
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'custom_moe'\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 10))
    with pytest.raises(ConfigError, match="custom code"):
        resolve_model_config(ModelConfig(path=str(folder)))
    assert not marker.exists()


def _laughs(levels: int) -> str:
    lines = ["l0: &l0 {a: 1}"]
    for i in range(1, levels + 1):
        refs = ", ".join(f"k{j}: *l{i - 1}" for j in range(10))
        lines.append(f"l{i}: &l{i} {{{refs}}}")
    return "\n".join(lines) + "\n"


def test_yaml_aliases_that_expand_to_billions_of_values_are_refused_at_once(tmp_path):
    bomb = tmp_path / "laughs.yaml"
    bomb.write_text(_laughs(6))  # 10**6 values from 500 bytes (each level more: x10)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="aliases expand to over"):
        load_config(bomb)
    items = ["&l0 [0, 0, 0, 0, 0, 0, 0, 0, 0, 0]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 7)]
    with pytest.raises(ConfigError, match="aliases expand to over"):  # the same through --set
        load_config(None, [f"train.lr=[{', '.join(items)}]"])
    assert time.monotonic() - start < 5


def test_a_yaml_alias_inside_itself_is_refused(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("model: &m {preset: qwen3-moe-tiny, again: *m}\n")
    with pytest.raises(ConfigError, match="contains it"):
        load_config(loop)


def test_ordinary_anchors_and_merge_keys_still_load(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("model: {preset: qwen3-moe-tiny}\n"
                   "train: &t {steps: 3, lr: 0.001}\n"
                   "eval_like: &e\n  <<: *t\n  steps: 1\n")
    with pytest.raises(ConfigError, match="eval_like"):  # an unknown top-level key, read as a mapping
        load_config(cfg)
    cfg.write_text("model: {preset: qwen3-moe-tiny}\n"
                   "train:\n  <<: &base {max_steps: 3, lr: 0.001}\n  max_steps: 2\n")
    loaded = load_config(cfg)
    assert loaded.train.max_steps == 2 and loaded.train.lr == 0.001


def test_a_model_config_nested_too_deeply_is_a_clean_error(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 200_000)
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_model_config(ModelConfig(path=str(folder)))


@pytest.mark.parametrize("value", ["2024-13-45", "9" * 5000], ids=["impossible date", "5000 digits"])
def test_a_value_yaml_reads_but_python_cannot_build_is_a_config_error(tmp_path, value):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model: {{preset: qwen3-moe-tiny}}\ntrain: {{max_steps: {value}}}\n")
    with pytest.raises(ConfigError, match="cfg.yaml"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="--set"):
        load_config(None, [f"train.max_steps={value}"])


def test_a_config_that_is_not_a_regular_file_is_refused_unread():
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config("/dev/zero")
