"""A FIFO or a link to an endless device planted in a token cache folder is damage (one
warning, rebuilt), never a start that blocks forever or reads a device into memory."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from .test_data_cache import _batches, _build, _data, _only_cache, _same, _tokenizer

PLANT = {
    "fifo at meta.json": lambda d: ((d / "meta.json").unlink(), os.mkfifo(d / "meta.json")),
    "meta.json a link to /dev/zero": lambda d: ((d / "meta.json").unlink(), (d / "meta.json").symlink_to("/dev/zero")),
    "fifo at tokens.bin": lambda d: ((d / "tokens.bin").unlink(), os.mkfifo(d / "tokens.bin")),
    "fifo at mask.bin": lambda d: ((d / "mask.bin").unlink(), os.mkfifo(d / "mask.bin")),
}


def _within(seconds: float, fn):
    """``fn()``'s result, failing the test where it has not returned within ``seconds``."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds} s (blocked on a planted file)")
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("plant", PLANT)
def test_a_special_file_planted_in_a_cache_is_damage_and_rebuilt(tmp_path, caplog, plant):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, None))
    _build(f, tok, tmp_path / "cache")
    PLANT[plant](_only_cache(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        got = _within(30, lambda: _batches(_build(f, tok, tmp_path / "cache")))
    assert _same(got, want)
    assert "rebuilding it" in caplog.text
    folder = _only_cache(tmp_path / "cache")
    assert all(Path(folder / n).is_file() and not Path(folder / n).is_symlink()
               for n in ("meta.json", "tokens.bin", "mask.bin", "offsets.bin"))


def test_a_fifo_planted_at_a_lock_file_does_not_block_the_start(tmp_path, monkeypatch):
    """A FIFO at ``<key>.lock`` or at the data file's hashing lock: opening it to write would
    wait for a reader forever; the run instead gets the same batches (tokenized in memory)."""
    from polyaccel.moe import data_cache

    monkeypatch.setattr(data_cache, "SETTLE_S", 0.0)  # the hashing lock is taken
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    cache = tmp_path / "ckpt" / ".data_cache"
    want = _batches(_build(f, tok, cache))
    key = _only_cache(cache).name
    _, source_lock = data_cache.memo_paths(cache, f)
    import shutil

    shutil.rmtree(cache)
    (cache / "sources").mkdir(parents=True)
    os.mkfifo(cache / f"{key}.lock")
    os.mkfifo(source_lock)
    assert _same(_within(30, lambda: _batches(_build(f, tok, cache))), want)


def test_a_damaged_cache_that_is_a_link_is_replaced_without_touching_where_it_points(tmp_path):
    """``<key>`` a symbolic link to a folder of the user's (holding a damaged cache, or anything):
    the rebuild moves the link aside and removes it; the folder it pointed to keeps every file."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, None))
    _build(f, tok, tmp_path / "cache")
    folder = _only_cache(tmp_path / "cache")
    mine = tmp_path / "mine"
    folder.rename(mine)
    (mine / "notes.txt").write_text("the user's notes\n")
    (mine / "meta.json").write_text("not a cache's")
    folder.symlink_to(mine, target_is_directory=True)
    before = {p.name: p.read_bytes() for p in mine.iterdir()}
    assert _same(_within(30, lambda: _batches(_build(f, tok, tmp_path / "cache"))), want)
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
    assert folder.is_dir() and not folder.is_symlink()
