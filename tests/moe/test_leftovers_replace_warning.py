"""A final save over a saved model another run (or tool) wrote in ``output_dir`` keeps that
model: every earlier file the save would write over (unless it already holds the bytes the save
writes) or delete (earlier weight files) is renamed ``<name>.bak-<time>`` first, the warning
names them, and every other file is left as it is. (The save used to write over and delete
them, saying so in the warning; before that the warning also misnamed what it replaced.)"""

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


def _listed(text: str) -> list[str]:
    """The file names the foreign-model warning lists as kept aside."""
    m = re.search(r"are kept, renamed <name>\.bak-<time> \((.*?)(?:; nothing else| \(\d+ in all)", text)
    return [] if m is None else m.group(1).split(", ")


def _aside(out: Path) -> dict[str, bytes]:
    """Files renamed ``<name>.bak-<time>`` in ``out``: original name -> bytes."""
    found = {}
    for p in out.iterdir():
        if m := re.fullmatch(r"(.*)\.bak-\d{8}-\d{6}(-\d+)?", p.name):
            found[m.group(1)] = p.read_bytes()
    return found


EARLIER = {"config.json": b"old", "generation_config.json": b"old", "model-00001-of-00002.safetensors": b"old",
           "model-00002-of-00002.safetensors": b"old", "model.safetensors.index.json": b"old",
           "tokenizer.json": b"old", "tokenizer_config.json": b"old", "special_tokens_map.json": b"old",
           "model.fp16.safetensors": b"mine", "notes.txt": b"mine"}
NEW = {"config.json": b"new", "generation_config.json": b"new", "model.safetensors": b"new",
       "tokenizer.json": b"new", "tokenizer_config.json": b"new", "chat_template.jinja": b"new"}


def test_the_earlier_models_files_are_kept_aside_and_named_and_nothing_else_is_touched(tmp_path, write_output):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in EARLIER.items():
        (out / name).write_bytes(data)
    (out / "extra").mkdir()
    text = write_output(out, NEW, FOREIGN)
    assert f"{FOREIGN}; this run's final model takes its place" in text
    aside = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
             "tokenizer_config.json"]
    assert _listed(text) == aside and "Use another output_dir to keep the two apart" in text
    assert _aside(out) == {n: b"old" for n in aside}  # ... and that is what the save did
    assert all((out / n).read_bytes() == b"new" for n in NEW)
    assert not any((out / n).exists() for n in aside if n not in NEW)
    for name in ("model.fp16.safetensors", "notes.txt", "special_tokens_map.json"):
        assert (out / name).read_bytes() == EARLIER[name]  # not written by this save: left as it is
    assert (out / "extra").is_dir()


def test_no_warning_without_a_foreign_model_and_long_lists_are_cut(tmp_path, write_output):
    out = tmp_path / "out"
    shards = {f"model-{i:05d}-of-00012.safetensors": b"s" for i in range(1, 13)}
    assert write_output(out, {**shards, "config.json": b"c"}) == ""
    text = write_output(out, {"model.safetensors": b"w", "config.json": b"c"}, FOREIGN)
    assert _listed(text) == [*list(shards)[:8], "..."] and "... (12 in all)" in text  # config.json: same bytes
    assert _aside(out) == shards and (out / "config.json").read_bytes() == b"c"


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
            "checkpoint.dir); this run's final model takes its place") in text
    assert _listed(text) == ["model.safetensors"]  # the tokenizer files and configs: the same bytes again
    assert list(_aside(out)) == ["model.safetensors"] and (out / "notes.txt").read_text() == "mine"
