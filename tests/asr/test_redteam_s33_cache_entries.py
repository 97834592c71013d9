"""The conversion cache replaces only its own entries. A folder at ``$POLYACCEL_CACHE/models/<name>``
that no conversion wrote (a user who keeps models in ``~/ml/models`` and sets
``POLYACCEL_CACHE=~/ml``: their own ``whisper-tiny.en`` folder) was deleted without a word and
the conversion put in its place, exit 0. It is now kept as it is and refused, naming it (a
``ValueError``: exit 2 from the CLI)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from polyaccel.asr import cli, weights
from polyaccel.asr.ct2_convert import _model_bin_parts


def _fake_convert(src, out, *, assets_dir=None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text('{"model_type": "whisper"}')
    (out / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in _model_bin_parts(src)))
    return out


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "convert_ct2_whisper", _fake_convert)


def _ct2_dir(root: Path) -> Path:
    d = root / "faster-whisper-x"
    d.mkdir(parents=True)
    (d / "model.bin").write_bytes(b"weights")
    (d / "tokenizer.json").write_text("{}")
    (d / "config.json").write_text("{}")
    return d


def _users_model(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "whisper"}', "model.safetensors": b"my fine-tuned weights",
             "notes.txt": b"trained on the 2026 meetings\n"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize("kind", ["folder", "file", "link"])
def test_a_users_entry_in_the_cache_is_kept_and_refused(tmp_path: Path, fake_convert: None, kind: str) -> None:
    target = weights.cache_dir(tmp_path) / "whisper-x"
    mine = tmp_path / "mine"
    files = _users_model(mine)
    target.parent.mkdir(parents=True)
    if kind == "folder":
        mine.rename(target)
        mine = target
    elif kind == "file":
        target.write_bytes(b"a file of mine")
    else:
        target.symlink_to(mine, target_is_directory=True)
    what = {"folder": "a folder without polyaccel-sources.json", "file": "a file", "link": "a link"}[kind]
    with pytest.raises(ValueError, match=f"{target} is {what}, not a conversion polyaccel made"):
        weights.convert_cached("whisper-x", _ct2_dir(tmp_path / "src"), cache=tmp_path)
    assert _contents(mine) == files
    if kind == "file":
        assert target.read_bytes() == b"a file of mine"
    assert kind != "link" or target.is_symlink()
    assert [p.name for p in target.parent.iterdir()] == ["whisper-x"]  # no temporary left either


def test_an_empty_folder_and_an_earlier_conversion_are_replaced(tmp_path: Path, fake_convert: None) -> None:
    target = weights.cache_dir(tmp_path) / "whisper-x"
    target.mkdir(parents=True)
    out = weights.convert_cached("whisper-x", _ct2_dir(tmp_path / "a"), cache=tmp_path)
    assert out == target and (out / weights.SOURCES_STAMP).is_file()
    (tmp_path / "a" / "faster-whisper-x" / "model.bin").write_bytes(b"new weights")
    weights.convert_cached("whisper-x", _ct2_dir(tmp_path / "b"), cache=tmp_path)  # other sources: converted again
    assert (target / "model.safetensors").read_bytes() == b"weights"


def test_the_cli_says_so_exit_2_and_the_folder_is_kept(tmp_path: Path, fake_convert: None, capsys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYACCEL_CACHE", str(tmp_path / "ml"))
    src = _ct2_dir(tmp_path / "src")
    digest = hashlib.sha1(str(src.resolve()).encode()).hexdigest()[:10]
    target = weights.cache_dir(tmp_path / "ml") / f"{src.name}-ct2-{digest}"
    files = _users_model(target)
    wav = tmp_path / "a.wav"
    wav.write_bytes(b"")
    rc = cli.main(["transcribe", str(wav), "--model", str(src), "-o", str(tmp_path / "out.jsonl"), "-q",
                   "--backend", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "not a conversion polyaccel made" in err and len(err.strip().splitlines()) == 1
    assert _contents(target) == files
