"""A file the final save writes besides the weights (``generation_config.json``,
``chat_template.jinja``, the tokenizer's files, ``config.json``) that the user edited in
``output_dir`` after an earlier save there is not lost when a later save (a resumed run, a
rerun, the rewrite from the final checkpoint) writes that name again: it is renamed
``<name>.bak-<time>``, with a warning naming both, and the save's own takes its place (the
folder stays one consistent model). Files unchanged since the earlier save (by the hashes it
recorded in ``.polyaccel-saved.json``) are replaced silently. They used to be replaced
silently, edits and all."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from polyaccel.moe import train
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
GEN = b'{"temperature": 0.2, "top_p": 0.9}\n'
TEMPLATE = b"{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
WARNING = "were changed since the earlier save wrote them (edited?) and are kept, renamed: "


@pytest.fixture
def base(with_tokenizer) -> Path:
    """The tiny saved model with a tiny tokenizer and a chat template beside it."""
    return with_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def _run(tmp_path: Path, base: Path, caplog, *sets: str) -> str:
    """A tiny finetune from ``base`` into ``tmp_path/out`` (checkpoints in ``tmp_path/ck``); its warnings."""
    cfg = load_config(TINY, [f"model.path={base}", f"output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}",
                             "checkpoint.every_steps=1", "log.progress_bar=false", "train.seq_len=8",
                             "train.grad_accum=1", "train.max_steps=1", *sets])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        finetune(cfg)
    return caplog.text


def _aside(out: Path, name: str) -> list[Path]:
    return sorted(p for p in out.iterdir() if re.fullmatch(re.escape(name) + r"\.bak-\d{8}-\d{6}(-\d+)?", p.name))


def _loads(out: Path) -> None:
    from transformers import AutoTokenizer

    from polyaccel.moe import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[1, 2, 1]])).logits).all()
    assert AutoTokenizer.from_pretrained(out).eos_token == "</s>"


def test_edits_to_generation_config_and_chat_template_survive_a_resumed_run(tmp_path, base, caplog):
    assert WARNING not in _run(tmp_path, base, caplog)
    out = tmp_path / "out"
    before = {n: (out / n).read_bytes() for n in ("generation_config.json", "chat_template.jinja", "config.json",
                                                   "tokenizer.json")}
    (out / "generation_config.json").write_bytes(GEN)
    (out / "chat_template.jinja").write_bytes(TEMPLATE)
    text = _run(tmp_path, base, caplog, "train.max_steps=2")  # resumes from step 1, saves again
    gen, chat = _aside(out, "generation_config.json"), _aside(out, "chat_template.jinja")
    assert len(gen) == 1 and gen[0].read_bytes() == GEN
    assert len(chat) == 1 and chat[0].read_bytes() == TEMPLATE
    assert f"output_dir {out}: files this save writes or removes {WARNING}" in text
    assert f"chat_template.jinja -> {chat[0].name}, generation_config.json -> {gen[0].name}; " in text
    # the save's own in their places; the unedited ones replaced without a word or a backup
    assert all((out / n).read_bytes() == data for n, data in before.items())
    assert not _aside(out, "config.json") and not _aside(out, "tokenizer.json")
    _loads(out)


def test_files_unchanged_since_the_earlier_save_are_replaced_silently(tmp_path, base, caplog):
    _run(tmp_path, base, caplog, "checkpoint.dir=null")
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert train._RECORD in names and "generation_config.json" in names and "chat_template.jinja" in names
    weights = (out / "model.safetensors").read_bytes()
    text = _run(tmp_path, base, caplog, "checkpoint.dir=null", "train.seed=1")  # another run: its weights differ
    assert WARNING not in text and "model.safetensors; nothing else there is touched" in text
    [kept] = _aside(out, "model.safetensors")  # the other run's weights: kept; its other files: the same bytes
    assert kept.read_bytes() == weights and (out / "model.safetensors").read_bytes() != weights
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, kept.name])
    assert train._RECORD not in text  # the record is not named among the files kept aside
    _loads(out)


def test_an_edited_config_json_is_backed_up_and_the_new_one_matches_the_weights(tmp_path, base, caplog):
    _run(tmp_path, base, caplog)
    out = tmp_path / "out"
    original = (out / "config.json").read_text()
    mine = original.replace('"use_cache": true', '"use_cache": false')
    assert mine != original
    (out / "config.json").write_text(mine)
    text = _run(tmp_path, base, caplog, "train.max_steps=2")
    aside = _aside(out, "config.json")
    assert len(aside) == 1 and aside[0].read_text() == mine and f"config.json -> {aside[0].name}" in text
    assert (out / "config.json").read_text() == original
    _loads(out)


def test_rewriting_output_dir_from_the_final_checkpoint_keeps_an_edited_file(tmp_path, base, caplog):
    """A rerun of a finished run whose output_dir lacks the final weights copies the checkpoint's files in."""
    _run(tmp_path, base, caplog)
    out = tmp_path / "out"
    (out / "generation_config.json").write_bytes(GEN)
    weights = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(weights[:-8])
    text = _run(tmp_path, base, caplog)
    # weights no checkpoint of the run matches: the folder's model is kept aside whole, as another run's
    assert "does not hold the final model" in text and "the earlier model's files are kept, renamed: " in text
    assert (out / "model.safetensors").read_bytes() == weights
    [gen], [cut] = _aside(out, "generation_config.json"), _aside(out, "model.safetensors")
    assert gen.read_bytes() == GEN and cut.read_bytes() == weights[:-8]
    _loads(out)


def test_without_a_record_only_files_unlike_the_new_ones_are_kept_aside(tmp_path, write_output):
    """A folder an earlier version (or another tool) saved has no record: a file of the bytes the
    save writes is replaced silently, any other one, a link included, is kept aside."""
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "shared_template.jinja"
    target.write_bytes(TEMPLATE)
    (out / "chat_template.jinja").symlink_to(target)
    for name, data in {"config.json": b"c", "generation_config.json": b"mine", "model.safetensors": b"old"}.items():
        (out / name).write_bytes(data)
    new = {"config.json": b"c", "generation_config.json": b"g", "chat_template.jinja": b"t", "model.safetensors": b"w"}
    text = write_output(out, new)
    [gen], [chat] = _aside(out, "generation_config.json"), _aside(out, "chat_template.jinja")
    assert gen.read_bytes() == b"mine" and chat.is_symlink() and target.read_bytes() == TEMPLATE
    assert not _aside(out, "config.json") and not _aside(out, "model.safetensors") and WARNING in text
    assert all((out / n).read_bytes() == data and not (out / n).is_symlink() for n, data in new.items())
    # now recorded: the same save again replaces them without a word; a second edit gets its own backup
    assert write_output(out, new) == ""
    (out / "generation_config.json").write_bytes(b"mine again")
    write_output(out, new)
    assert [p.read_bytes() for p in _aside(out, "generation_config.json")] == [b"mine", b"mine again"]


def test_a_damaged_record_is_no_record(tmp_path, write_output):
    out = tmp_path / "out"
    new = {"config.json": b"c", "generation_config.json": b"g", "model.safetensors": b"w"}
    write_output(out, new)
    (out / "generation_config.json").write_bytes(b"mine")
    for record in (b'{"files": ["generation_config.json"]}', b"{cut off", b"[]"):
        (out / train._RECORD).write_bytes(record)
        write_output(out, new)
        assert (out / "generation_config.json").read_bytes() == b"g"
        (out / "generation_config.json").write_bytes(b"mine")
    assert [p.read_bytes() for p in _aside(out, "generation_config.json")] == [b"mine"] * 3


def test_an_edited_adapter_config_is_backed_up_by_a_lora_run_continuing(tmp_path, caplog):
    pytest.importorskip("peft")

    def run(steps: int) -> str:
        cfg = load_config(REPO / "packages/moe/examples/lora_tiny_cpu.yaml", [
            f"output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=1",
            "log.progress_bar=false", f"train.max_steps={steps}", "train.seq_len=8", "train.grad_accum=1"])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
            finetune(cfg)
        return caplog.text

    run(1)
    out = tmp_path / "out"
    mine = (out / "adapter_config.json").read_text().replace('"inference_mode": true', '"inference_mode": false')
    (out / "adapter_config.json").write_text(mine)
    (out / "README.md").write_text("mine")
    assert WARNING in run(2)
    [aside] = _aside(out, "adapter_config.json")
    assert aside.read_text() == mine and '"inference_mode": true' in (out / "adapter_config.json").read_text()
    assert (out / "README.md").read_text() == "mine" and not _aside(out, "README.md")


def test_weights_replaced_since_the_recorded_save_are_kept_aside(tmp_path, write_output):
    """The record also knows each weight file the save wrote (size and modification time): one
    the user replaced or rewrote since is renamed aside before a later save writes over it or
    removes it (an earlier save's shard); untouched ones are replaced or removed silently."""
    import os

    out = tmp_path / "out"
    shards = {"model-00001-of-00002.safetensors": b"s1", "model-00002-of-00002.safetensors": b"s2",
              "model.safetensors.index.json": b"{}"}
    assert write_output(out, {"config.json": b"c", **shards}) == ""
    (out / "model-00002-of-00002.safetensors").write_bytes(b"my shard")
    text = write_output(out, {"config.json": b"c", "model.safetensors": b"w1"})  # one file now: shards removed
    [kept] = _aside(out, "model-00002-of-00002.safetensors")
    assert kept.read_bytes() == b"my shard" and "model-00002-of-00002.safetensors -> " in text and WARNING in text
    assert not (out / "model-00001-of-00002.safetensors").exists() and not _aside(out, "model-00001-of-00002.safetensors")
    assert (out / "model.safetensors").read_bytes() == b"w1"
    # the same bytes, rewritten (a newer modification time), and then a save that writes over it
    st = (out / "model.safetensors").stat()
    (out / "model.safetensors").write_bytes(b"w1")
    os.utime(out / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    write_output(out, {"config.json": b"c", "model.safetensors": b"w2"})
    assert [p.read_bytes() for p in _aside(out, "model.safetensors")] == [b"w1"]
    assert (out / "model.safetensors").read_bytes() == b"w2"
    assert write_output(out, {"config.json": b"c", "model.safetensors": b"w3"}) == ""  # untouched: no copy
    assert len(_aside(out, "model.safetensors")) == 1
