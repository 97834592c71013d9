"""Small robustness fixes of ``polyaccel-asr``: a broken symlink found in a folder is said the
same way in the log and in its results line; a FIFO (or socket, device) in a folder is a
per-file error, as when given directly, never skipped silently; JSON nested deeper than
Python's parser recurses, in a model's ``config.json`` (Whisper, ConformerAED, CTranslate2)
or in the converted-model cache's hash index, is the usual clean error naming the file (or,
for the index, ignored), never a ``RecursionError`` traceback."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import cli, weights
from polyaccel.asr.transcriber import Transcriber

SR = 16000
DEEP = "[" * 200_000  # beyond the json module's recursion limit


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_from_pretrained(path_or_name="fake", *, batch_size=None, replicas=None, **kw):
        def factory(i):
            return lambda batch: [f"{len(a)} samples" for a in batch]
        return Transcriber(factory, sample_rate=SR, max_audio_seconds=30.0, replicas=replicas or 1,
                           batch_size=batch_size or 8, model_name=str(path_or_name))
    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_from_pretrained))


def _errors(out: Path) -> dict[str, str | None]:
    return {Path(r["path"]).name: r["error"] for r in map(json.loads, out.read_text().splitlines())}


# ---- 1. a broken symlink in a folder: the same words on stderr and in the results ----------------


def test_a_broken_symlink_in_a_folder_is_logged_as_its_results_line_says(
        fake: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "clips"
    folder.mkdir()
    sf.write(folder / "a.wav", np.full(SR // 10, 0.1, np.float32), SR)
    (folder / "b.wav").symlink_to(tmp_path / "gone.wav")
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.WARNING):
        assert cli.main(["transcribe", str(folder), "-o", str(out), "-q"]) == cli.EXIT_SOME_FAILED
    said = f"broken symbolic link (to {tmp_path / 'gone.wav'})"
    assert _errors(out) == {"a.wav": None, "b.wav": said}
    logged = caplog.text + capsys.readouterr().err
    assert f"{folder / 'b.wav'}: {said}" in logged
    assert "missing file" not in logged


# ---- 2. a FIFO, a socket in a folder: reported as when given directly ----------------------------


def test_a_fifo_or_socket_in_a_folder_is_a_per_file_error_not_skipped(
        fake: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "clips"
    (folder / "sub").mkdir(parents=True)
    sf.write(folder / "a.wav", np.full(SR // 10, 0.1, np.float32), SR)
    os.mkfifo(folder / "live.wav")  # opening it would block: it must only be stat'ed
    (folder / "notes.txt").write_text("not audio")  # no audio extension: still not an input
    (folder / "dir.flac").mkdir()  # a folder named like audio is searched, not an input
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(folder / "sub" / "s.wav"))
        out = tmp_path / "out.jsonl"
        status = cli.main(["transcribe", str(folder), "-o", str(out)])
    finally:
        sock.close()
    assert status == cli.EXIT_SOME_FAILED
    assert _errors(out) == {"a.wav": None, "live.wav": "not a regular file (a FIFO)",
                            "s.wav": "not a regular file (a socket)"}
    err = capsys.readouterr().err
    assert "1 ok, 2 failed, 0 skipped" in err
    assert f"failed: {folder / 'live.wav'}: not a regular file (a FIFO)" in err


def test_a_folder_holding_only_a_fifo_has_nothing_transcribed(fake: None, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "clips"
    folder.mkdir()
    os.mkfifo(folder / "live.wav")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(folder), "-o", str(out)]) == cli.EXIT_NOTHING_DONE
    assert _errors(out) == {"live.wav": "not a regular file (a FIFO)"}
    assert "no audio files found" not in capsys.readouterr().err


# ---- 4. JSON nested too deeply -------------------------------------------------------------------


def test_a_hash_index_nested_too_deeply_is_ignored_and_rewritten(tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # the cache root: converted models in models/, the index beside them
    index = cache / "weights_sha256.json"
    cache.mkdir()
    index.write_text(DEEP)
    assert weights._read_index(index) == {}
    blob = tmp_path / "model.safetensors"
    blob.write_bytes(b"weights")
    assert weights.file_sha256(blob, cache=cache) == hashlib.sha256(b"weights").hexdigest()
    assert os.path.realpath(blob) in json.loads(index.read_text())


def _whisper_dir(tmp_path: Path, config: str, generation: str | None = None) -> Path:
    model = tmp_path / "whisper"
    model.mkdir()
    (model / "config.json").write_text(config)
    if generation is not None:
        (model / "generation_config.json").write_text(generation)
    (model / "model.safetensors").write_bytes(b"not loaded")
    return model


@pytest.mark.parametrize("config, generation", [(DEEP, None), ('{"model_type": "whisper"}', DEEP)])
def test_a_whisper_config_nested_too_deeply_is_a_value_error_naming_it(tmp_path: Path, config: str,
                                                                       generation: str | None) -> None:
    from polyaccel.asr.whisper import WhisperConfig

    model = _whisper_dir(tmp_path, config, generation)
    bad = "config.json" if generation is None else "generation_config.json"
    with pytest.raises(ValueError, match=rf"whisper/{bad}: not valid JSON \(nested too deeply\)"):
        WhisperConfig.from_pretrained(model)


@pytest.mark.parametrize("config", [DEEP, '{"model_type": "whisper",'])
def test_a_model_config_nested_too_deeply_is_a_usage_error_naming_it(tmp_path: Path, config: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    model = _whisper_dir(tmp_path, config)
    sf.write(tmp_path / "a.wav", np.full(SR // 10, 0.1, np.float32), SR)
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(tmp_path / "a.wav"), "-o", str(out), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"{model / 'config.json'}: not valid JSON" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("bad", ["config.json", "tokenizer.json"])
def test_a_conformer_config_nested_too_deeply_is_a_value_error_naming_it(tmp_path: Path, bad: str) -> None:
    from polyaccel.asr.char_tokenizer import CharTokenizer
    from polyaccel.asr.conformer_config import ConformerAEDConfig, tiny

    tiny().save(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"type": "char", "characters": "ab",
                                                         "special_tokens": ["<pad>"], "unk_token": "<pad>"}))
    (tmp_path / bad).write_text(DEEP)
    load = ConformerAEDConfig.load if bad == "config.json" else CharTokenizer.load
    with pytest.raises(ValueError, match=rf"{bad}: not valid JSON \(nested too deeply\)"):
        load(tmp_path)


def test_a_ct2_config_nested_too_deeply_is_a_clean_convert_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    from polyaccel.asr.ct2_convert import main as convert_main

    src = tmp_path / "ct2"
    src.mkdir()
    (src / "model.bin").write_bytes(b"\x06\x00\x00\x00")  # never read: its config.json is refused first
    (src / "tokenizer.json").write_text('{"added_tokens": []}')
    (src / "config.json").write_text(DEEP)
    assert convert_main([str(src), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert f"error: {src / 'config.json'}: not valid JSON (nested too deeply)" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_a_ct2_tokenizer_nested_too_deeply_is_a_format_error_naming_it(tmp_path: Path) -> None:
    from polyaccel.asr.ct2_convert import CT2FormatError, _SpecialTokens

    (tmp_path / "tokenizer.json").write_text(DEEP)
    with pytest.raises(CT2FormatError, match=r"tokenizer\.json: not valid JSON \(nested too deeply\)"):
        _SpecialTokens.from_tokenizer_json(tmp_path / "tokenizer.json")
