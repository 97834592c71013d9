"""The warning of a final save over a saved model another run wrote in ``output_dir`` says
exactly what the save does to its files: every file the save writes (weights, ``config.json``,
``generation_config.json``, the tokenizer's files) overwrites the earlier one of that name,
earlier weight files it does not write are deleted, and only the others are kept. (It used to
say "its weight files and config; other files are kept" while the tokenizer files and
``generation_config.json`` were replaced too.)"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from polyaccel.moe import train
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
FOREIGN = "output_dir X holds a saved model (model.safetensors) that this run did not write"


def _listed(text: str, verb: str) -> list[str]:
    """The file names the warning lists after ``verb`` (``overwrites``, ``deletes``, ``keeps``)."""
    m = re.search(rf"\b{verb} (.*?) \((?:files|earlier)", text)
    return [] if m is None else m.group(1).split(", ")


EARLIER = {"config.json": b"old", "generation_config.json": b"old", "model-00001-of-00002.safetensors": b"old",
           "model-00002-of-00002.safetensors": b"old", "model.safetensors.index.json": b"old",
           "tokenizer.json": b"old", "tokenizer_config.json": b"old", "special_tokens_map.json": b"old",
           "model.fp16.safetensors": b"mine", "notes.txt": b"mine"}
NEW = {"config.json": b"new", "generation_config.json": b"new", "model.safetensors": b"new",
       "tokenizer.json": b"new", "tokenizer_config.json": b"new", "chat_template.jinja": b"new"}


def test_the_warning_names_what_is_overwritten_deleted_and_kept_and_that_is_what_happens(tmp_path, write_output):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    (out / "extra").mkdir()
    text = write_output(out, NEW, FOREIGN)
    assert f"{FOREIGN}; this run's final model replaces it: overwrites " in text
    overwritten, deleted, kept = (_listed(text, v) for v in ("overwrites", "deletes", "keeps"))
    assert overwritten == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert deleted == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "model.safetensors.index.json"]
    assert kept == ["extra/", "model.fp16.safetensors", "notes.txt", "special_tokens_map.json"]
    assert "Use another output_dir to keep both" in text
    # ... and it says what the save did.
    assert all((out / n).read_bytes() == b"new" for n in overwritten)
    assert not any((out / n).exists() for n in deleted)
    assert all((out / n.rstrip("/")).exists() for n in kept)
    assert (out / "special_tokens_map.json").read_bytes() == b"old"  # not written by this save: kept


def test_no_warning_without_a_foreign_model_and_long_lists_are_cut(tmp_path, write_output):
    out = tmp_path / "out"
    assert write_output(out, NEW) == ""
    for i in range(6):
        (out / f"u{i}.txt").write_text("mine")
    shards = {f"model-{i:05d}-of-00012.safetensors": b"s" for i in range(1, 13)}
    text = write_output(out, {**shards, "config.json": b"c"}, FOREIGN)
    assert "overwrites config.json (files of the names it writes)" in text
    assert "deletes model.safetensors (earlier weight files it does not write)" in text
    kept = _listed(text, "keeps")  # 4 files of the earlier save and 6 of the user's: 8 named, then the count
    assert kept[:5] == ["chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "u0.txt"] and kept[8:] == ["... (10 in all)"]


@pytest.fixture
def tokenizer_model(with_tokenizer) -> Path:
    """The tiny saved model with a tiny tokenizer beside it (the final save copies it)."""
    return with_tokenizer()


def test_a_run_over_another_runs_model_says_its_tokenizer_files_are_replaced(tmp_path, tokenizer_model, caplog):
    def run(*sets: str) -> str:
        cfg = load_config(TINY, [f"model.path={tokenizer_model}", f"output_dir={tmp_path / 'out'}",
                                 "checkpoint.dir=null", "log.progress_bar=false", "train.max_steps=1", *sets])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
            finetune(cfg)
        return caplog.text

    assert "holds a saved model" not in run()
    out = tmp_path / "out"
    saved = sorted(p.name for p in out.iterdir() if p.name != train._RECORD)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(saved)
    (out / "notes.txt").write_text("mine")
    text = run("train.seed=1")
    assert (f"output_dir {out} holds a saved model (model.safetensors) that this run did not write (it has no "
            "checkpoint.dir); this run's final model replaces it: overwrites ") in text
    assert _listed(text, "overwrites") == saved  # the tokenizer files and generation_config.json too
    assert _listed(text, "keeps") == ["notes.txt"] and _listed(text, "deletes") == []
    assert (out / "notes.txt").read_text() == "mine"
