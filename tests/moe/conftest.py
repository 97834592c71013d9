"""Fixtures shared by the MoE tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Imported here, before any test captures stderr: Transformers' log handler keeps the stream
# it first sees, and a test that imported it under capture left later tests writing to a
# closed stream ("--- Logging error ---", depending on the order tests run in).
import transformers  # noqa: F401


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE saved by ``save_pretrained`` (the example config's shape, 4 experts)."""
    from polyaccel.moe import AutoModelForCausalLM
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import preset

    path = tmp_path_factory.mktemp("saved") / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(resolve_model_config(preset("qwen3-moe-tiny").model)).save_pretrained(path)
    return path


@pytest.fixture
def with_tokenizer(tmp_path: Path, saved: Path):
    """``with_tokenizer(chat_template=None)``: a copy of the tiny saved model in ``tmp_path/base``
    with a tiny word-level tokenizer (and the chat template, if given) saved beside it."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def with_tokenizer(chat_template: str | None = None) -> Path:
        base = tmp_path / "base"
        shutil.copytree(saved, base)
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
        if chat_template is not None:
            fast.chat_template = chat_template
        fast.save_pretrained(base)
        return base

    return with_tokenizer


@pytest.fixture
def write_output(caplog):
    """``write_output(out, files, foreign=None)``: ``train._write_output`` of a save made of
    ``files`` (name -> bytes) into ``out`` with the tiny example config; returns the warnings
    it logged."""
    import logging

    from polyaccel.moe import train
    from polyaccel.moe.train_config import load_config

    tiny = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"

    def write_output(out: Path, files: dict[str, bytes], foreign: str | None = None) -> str:
        cfg = load_config(tiny, [f"output_dir={out}", "checkpoint.dir=null"])

        def write(staging: Path) -> None:
            for name, data in files.items():
                (staging / name).write_bytes(data)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
            train._write_output(cfg, write, foreign=foreign)
        return caplog.text

    return write_output


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(disk)``: every safetensors file written under ``disk`` fails from then on, as
    on a full disk (Transformers' ``save_pretrained`` path)."""
    import transformers.modeling_utils
    from safetensors import SafetensorError

    real = transformers.modeling_utils.safe_save_file
    disks: list[Path] = []

    def save(tensors, filename, *args, **kwargs):
        if any(Path(filename).resolve().is_relative_to(d.resolve()) for d in disks):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save)
    return disks.append
