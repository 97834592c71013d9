"""The final save into ``output_dir`` meets what a user (or an attacker sharing the folder) may
have put there: a FIFO or a link to an endless device under the name of a file the save reads
(its record, a config it checks for edits) never blocks nor fills memory, a folder under the
name of a file it writes is refused before training (and, if made later, before the save
moves anything), and a save a kill cut between its moves is redone without keeping its own
half-moved weights aside as the user's edits (which doubled the disk the weights take)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from polyaccel.moe import train
from polyaccel.moe.train import check_outputs
from polyaccel.moe.train_config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
SAVE = {"config.json": b"c", "generation_config.json": b"g", "model.safetensors": b"w"}


def _aside(out: Path, name: str) -> list[Path]:
    return sorted(p for p in out.iterdir() if re.fullmatch(re.escape(name) + r"\.bak-\d{8}-\d{6}(-\d+)?", p.name))


def _finishes(fn, fifo: Path, seconds: float = 20) -> bool:
    """Whether ``fn()`` returns within ``seconds``; a reader left blocked on ``fifo`` is then
    released (a writer opens it), so that a failing test does not hang the suite."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    finished = done.wait(seconds)
    if not finished:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.wait(10)
    if errors:
        raise errors[0]
    return finished


@pytest.mark.parametrize("name", ["generation_config.json", train._RECORD])
def test_a_fifo_under_a_name_the_save_reads_neither_blocks_it_nor_is_lost(tmp_path, write_output, name):
    out = tmp_path / "out"
    write_output(out, SAVE)
    (out / name).unlink()
    os.mkfifo(out / name)
    assert _finishes(lambda: write_output(out, SAVE), out / name), f"the save blocked reading the FIFO {name}"
    assert all((out / n).read_bytes() == data for n, data in SAVE.items())
    if name != train._RECORD:  # the user's: renamed aside, with the warning
        [kept] = _aside(out, name)
        assert kept.is_fifo()


def test_a_record_that_links_to_an_endless_device_is_no_record(tmp_path, write_output):
    out = tmp_path / "out"
    write_output(out, SAVE)
    (out / "generation_config.json").write_bytes(b"mine")
    (out / train._RECORD).unlink()
    (out / train._RECORD).symlink_to("/dev/zero")
    write_output(out, SAVE)
    assert [p.read_bytes() for p in _aside(out, "generation_config.json")] == [b"mine"]
    assert not (out / train._RECORD).is_symlink()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", train._RECORD])
def test_a_folder_named_like_a_saved_file_is_refused_before_training(tmp_path, name):
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    (out / name / "notes").write_text("mine")
    cfg = load_config(TINY, [f"output_dir={out}", "checkpoint.dir=null"])
    with pytest.raises(ConfigError, match=re.escape(f"output_dir: {out / name} is a folder where the final save "
                                                    "writes a file of that name")):
        check_outputs(cfg)
    (out / "subfolder").mkdir()  # other folders are not in the way
    (out / name / "notes").unlink()
    (out / name).rmdir()
    check_outputs(cfg)


def test_a_folder_made_during_training_stops_the_save_before_it_moves_anything(tmp_path, write_output):
    out = tmp_path / "out"
    write_output(out, SAVE)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "generation_config.json").unlink()
    (out / "generation_config.json").mkdir()
    del before["generation_config.json"]
    with pytest.raises(IsADirectoryError, match="a folder has the name of a file the save writes"):
        write_output(out, {**SAVE, "model.safetensors": b"new"})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not (out / train._STAGING).exists()


def test_redoing_a_save_cut_between_its_moves_keeps_no_copy_of_its_own_weights(tmp_path, write_output, monkeypatch):
    out = tmp_path / "out"
    write_output(out, SAVE)  # the earlier save, recorded
    real = os.replace

    def killed_after_the_weights(src, dst):
        real(src, dst)
        if Path(dst).name == "model.safetensors":
            raise KeyboardInterrupt

    monkeypatch.setattr(train.os, "replace", killed_after_the_weights)
    with pytest.raises(KeyboardInterrupt):
        write_output(out, {**SAVE, "model.safetensors": b"new"})
    monkeypatch.setattr(train.os, "replace", real)
    assert (out / "model.safetensors").read_bytes() == b"new" and (out / train._STAGING).is_dir()
    text = write_output(out, {**SAVE, "model.safetensors": b"new"})  # the rerun redoes it
    assert text == "" and not _aside(out, "model.safetensors")
    assert (out / "model.safetensors").read_bytes() == b"new" and not (out / train._STAGING).exists()
    # a user's edit made after the cut save is still kept
    (out / "model.safetensors").write_bytes(b"mine")
    write_output(out, {**SAVE, "model.safetensors": b"newer"})
    assert [p.read_bytes() for p in _aside(out, "model.safetensors")] == [b"mine"]


@pytest.mark.parametrize("kind", ["fifo", "link to a folder", "link to a device", "file"])
def test_a_staging_name_taken_by_something_else_is_refused_and_never_opened(tmp_path, write_output, kind):
    """``.polyaccel-partial`` beside a saved model passed for a cut-off save: a FIFO there hung
    the final save (its removal opened it), anything else failed it after training."""
    out = tmp_path / "out"
    write_output(out, SAVE)
    staging = out / train._STAGING
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes").write_text("mine")
    {"fifo": lambda: os.mkfifo(staging), "link to a folder": lambda: staging.symlink_to(mine),
     "link to a device": lambda: staging.symlink_to("/dev/zero"), "file": lambda: staging.write_text("x")}[kind]()
    cfg = load_config(TINY, [f"output_dir={out}", "checkpoint.dir=null"])
    with pytest.raises(ConfigError, match=re.escape(f"output_dir: {staging} is not a folder")):
        check_outputs(cfg)

    def save() -> None:
        with pytest.raises(FileExistsError, match="the name of the save's staging folder is taken"):
            write_output(out, {**SAVE, "model.safetensors": b"new"})

    assert _finishes(save, staging) if kind == "fifo" else save() is None
    assert os.path.lexists(staging) and (mine / "notes").read_text() == "mine"
    assert (out / "model.safetensors").read_bytes() == b"w"
