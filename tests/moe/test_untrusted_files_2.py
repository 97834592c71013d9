"""Files someone else hands the fine-tuning code that must not run code, reach outside their
folder or crash a run: a tokenizer folder that ships its own Python (refused even when stdin
answers Transformers' "run the custom code?" prompt with y), a checkpoint manifest listing
files outside the checkpoint, and JSON nested deeper than Python's parser recurses (a damaged
manifest, a weight index, a data line) that must be a clean error, not a ``RecursionError``."""

from __future__ import annotations

import builtins
import hashlib
import json
from pathlib import Path

import pytest
import torch

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.data import build_dataset, load_tokenizer
from polyaccel.moe.ep_checkpoint import index_escape
from polyaccel.moe.train_config import ConfigError, DataConfig

DEEP = "[" * 200_000  # beyond the json module's recursion limit


def _checkpoint(root: Path, step: int) -> Path:
    """A minimal intact checkpoint ``root/step_N`` (trainer state + manifest)."""
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    torch.save({"step": step, "optimizer": None}, d / ckpt.TRAINER_STATE)
    ckpt.write_manifest(d, step)
    return d


def test_a_tokenizer_folder_with_its_own_code_is_refused_even_when_stdin_says_yes(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    auto_map = {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}}
    (tok / "tokenizer_config.json").write_text(json.dumps(auto_map))
    (tok / "config.json").write_text(json.dumps({"model_type": "evil", **auto_map}))
    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")  # `yes | polyaccel-moe finetune ...`
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tok))
    assert not marker.exists()


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_manifest_listing_files_outside_the_checkpoint_is_not_trusted(tmp_path, where):
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's\n")
    d = _checkpoint(tmp_path / "ck", 1)
    manifest = json.loads((d / ckpt.MANIFEST).read_text())
    name = "../../secret.txt" if where == "relative" else str(secret)
    manifest["files"][name] = {"size": secret.stat().st_size,
                               "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    (d / ckpt.MANIFEST).write_text(json.dumps(manifest))
    why = ckpt.verify_checkpoint(d)
    assert why is not None and "outside" in why and name in why
    with pytest.raises(ckpt.CheckpointError, match="outside"):
        ckpt.find_resume(tmp_path / "ck", str(d))


def test_a_manifest_nested_too_deeply_is_skipped_by_auto_resume(tmp_path, caplog):
    root = tmp_path / "ck"
    older = _checkpoint(root, 1)
    newer = _checkpoint(root, 2)
    (newer / ckpt.MANIFEST).write_text(DEEP)
    assert "unreadable" in ckpt.verify_checkpoint(newer)
    assert ckpt.checkpoint_step(newer) == 2  # from its name
    assert ckpt.find_resume(root, "auto") == older


def test_a_weight_index_nested_too_deeply_is_a_reason_not_a_crash(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(DEEP)
    why = index_escape(tmp_path)
    assert why is not None and "cannot be read" in why


def test_a_data_line_nested_too_deeply_is_a_config_error_naming_the_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n' + DEEP + "\n")
    with pytest.raises(ConfigError, match=rf"{data.name}:2: not valid JSON"):
        build_dataset(DataConfig(jsonl=str(data)), seq_len=4, vocab_size=128)
