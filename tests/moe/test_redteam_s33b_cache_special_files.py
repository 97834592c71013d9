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
