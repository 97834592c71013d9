"""A token cache rewritten consistently (its CRCs and ``stat`` in ``meta.json`` recomputed) to
hold ids the model has no embedding for is refused with one line naming the cache, never
handed to the model (an index error deep in the embedding, a device assert on a GPU)."""

from __future__ import annotations

import json
import logging
import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from polyaccel.moe import data_cache
from polyaccel.moe.train_config import ConfigError

from .test_data_cache import _build, _data, _only_cache, _tokenizer


def _rewrite(folder: Path, tokens: np.ndarray | None = None, **meta_changes) -> None:
    """Replace ``tokens.bin`` and/or fields of ``meta.json``, keeping the CRCs and identities right."""
    meta = json.loads((folder / "meta.json").read_text())
    if tokens is not None:
        (folder / "tokens.bin").write_bytes(tokens.tobytes())
        meta["crc32"]["tokens.bin"] = zlib.crc32(tokens.tobytes())
    meta["stat"] = {name: data_cache.identity(os.stat(folder / name)) for name in data_cache.FILES}
    (folder / "meta.json").write_text(json.dumps(meta | meta_changes))


def test_a_cache_with_token_ids_outside_the_vocabulary_is_refused_naming_it(tmp_path):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    _build(f, tok, tmp_path / "cache")
    folder = _only_cache(tmp_path / "cache")
    tokens = np.fromfile(folder / "tokens.bin", dtype=np.uint16)
    tokens[3] = 40  # vocab_size is 32
    _rewrite(folder, tokens)
    mapped = _build(f, tok, tmp_path / "cache")
    with pytest.raises(ConfigError, match=rf"{folder}.*token id 40 .*\[0, 32\)") as e:
        [mapped.sample(i) for i in range(len(mapped))]
    assert "\n" not in str(e.value)


def test_a_cache_whose_pad_id_is_outside_the_vocabulary_is_rebuilt(tmp_path, caplog):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _build(f, tok, None)
    _build(f, tok, tmp_path / "cache")
    _rewrite(_only_cache(tmp_path / "cache"), pad_id=1000)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        mapped = _build(f, tok, tmp_path / "cache")
    assert "pad_id 1000" in caplog.text and "rebuilding it" in caplog.text
    assert mapped.cache.pad_id < 32
    assert all((mapped.sample(i)[0] == want.sample(i)[0]).all() for i in range(len(want)))


def test_the_notes_a_cache_repeats_cannot_drive_the_terminal(tmp_path, caplog):
    """``meta.json``'s notes (repeated as warnings at each start) with control characters are
    logged escaped; notes that are not text make the cache damaged (rebuilt)."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    _build(f, tok, tmp_path / "cache")
    _rewrite(_only_cache(tmp_path / "cache"), notes=["\x1b]0;owned\x07 title set"])
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        _build(f, tok, tmp_path / "cache")
    assert "\x1b" not in caplog.text and "\x07" not in caplog.text and "\\x1b]0;owned\\x07 title set" in caplog.text
    caplog.clear()
    _rewrite(_only_cache(tmp_path / "cache"), notes=[{"a": 1}])
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        _build(f, tok, tmp_path / "cache")
    assert "has_target or notes" in caplog.text and "rebuilding it" in caplog.text


def test_finetune_on_a_cache_with_an_id_outside_the_vocabulary_is_one_line_and_exit_2(tmp_path, capsys):
    from polyaccel.moe import cli

    from .test_data_cache import TINY

    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    sets = [f"data.tokenizer={tok}", f"data.jsonl={f}", f"checkpoint.dir={tmp_path / 'ck'}",
            "log.progress_bar=false", "log.every_steps=1000", "train.seq_len=8"]
    argv = ["finetune", str(TINY), *[a for s in sets for a in ("--set", s)]]
    assert cli.main([*argv, "--set", f"output_dir={tmp_path / 'out'}", "--set", "train.max_steps=1"]) == 0
    folder = _only_cache(tmp_path / "ck" / ".data_cache")
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.fromfile(folder / "tokens.bin", dtype=meta["dtype"])
    tokens[:] = np.iinfo(tokens.dtype).max  # beyond any tiny model's vocabulary
    _rewrite(folder, tokens)
    capsys.readouterr()
    code = cli.main([*argv, "--set", f"output_dir={tmp_path / 'out2'}", "--set", "train.max_steps=3"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"data cache {folder}" in err
    assert not (tmp_path / "out2").exists()
