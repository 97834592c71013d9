"""The conversion cache (``weights.convert_cached``) follows its sources: a replaced
``model.bin``, an upgraded weights package or an entry with another stamp is converted again (and
its ``weights_sha256`` changes with it); temporary folders left by killed conversions are
removed when they are old and ours, never through a symlink.

The converter is replaced by a fake that copies the ``model.bin`` bytes into
``model.safetensors``, so the tests run in milliseconds and the hash shows what was converted."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from polyaccel.asr import weights
from polyaccel.asr.ct2_convert import _model_bin_parts


def _fake_convert(src, out, *, assets_dir=None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text('{"model_type": "whisper"}')
    (out / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in _model_bin_parts(src)))
    return out


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []

    def convert(src, out, *, assets_dir=None):
        calls.append(src)
        return _fake_convert(src, out, assets_dir=assets_dir)

    monkeypatch.setattr(weights, "convert_ct2_whisper", convert)
    return calls


def _ct2_dir(root: Path, data: bytes) -> Path:
    d = root / "faster-whisper-x"
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.bin").write_bytes(data)
    (d / "tokenizer.json").write_text("{}")
    (d / "config.json").write_text("{}")
    return d


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` over ``path`` by rename, as a package upgrade does; mtime moved on by 1 s."""
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    st = os.stat(path)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    os.replace(new, path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_replaced_model_bin_in_the_same_folder_is_converted_again(tmp_path: Path, fake_convert: list) -> None:
    cache = tmp_path / "cache"
    src = _ct2_dir(tmp_path, b"A" * 100)
    first = weights.resolve(src, cache=cache)
    assert weights.weights_sha256(first.path, cache=cache) == _sha(b"A" * 100)
    assert weights.resolve(src, cache=cache).path == first.path and len(fake_convert) == 1  # cached
    _replace(src / "model.bin", b"B" * 100)  # same size, same folder: the same cache key
    again = weights.resolve(src, cache=cache)
    assert again.path == first.path and len(fake_convert) == 2
    assert weights.weights_sha256(again.path, cache=cache) == _sha(b"B" * 100)
    assert weights.model_provenance(src, cache=cache)["weights_sha256"] == _sha(b"B" * 100)
    assert sorted(p.name for p in (cache / "models").iterdir()) == [first.path.name]  # nothing left over


def test_upgraded_weights_package_is_converted_again(tmp_path: Path, fake_convert: list) -> None:
    pkg = tmp_path / "site-packages" / "some_weights"
    part = _ct2_dir(pkg.parent, b"v1") / "model.bin"
    assets = part.parent
    out = weights.convert_cached("whisper-x", [part], assets, cache=tmp_path)
    assert (out / "model.safetensors").read_bytes() == b"v1"
    assert weights.convert_cached("whisper-x", [part], assets, cache=tmp_path) == out and len(fake_convert) == 1
    _replace(part, b"v2")
    assert weights.convert_cached("whisper-x", [part], assets, cache=tmp_path) == out and len(fake_convert) == 2
    assert (out / "model.safetensors").read_bytes() == b"v2"
    _replace(assets / "tokenizer.json", b'{"new": 1}')  # a new tokenizer is a new conversion too
    weights.convert_cached("whisper-x", [part], assets, cache=tmp_path)
    assert len(fake_convert) == 3


def test_an_entry_without_a_matching_stamp_is_not_trusted(tmp_path: Path, fake_convert: list) -> None:
    src = _ct2_dir(tmp_path, b"new weights")
    stale = weights.cache_dir(tmp_path) / "m"
    _fake_convert(_ct2_dir(tmp_path / "old", b"old weights"), stale)  # written before stamps existed
    with pytest.raises(ValueError, match="not a conversion polyaccel made"):  # or a user's own folder: kept
        weights.convert_cached("m", src, cache=tmp_path)
    assert (stale / "model.safetensors").read_bytes() == b"old weights" and not fake_convert
    (stale / weights.SOURCES_STAMP).write_text("[]")  # a stamp of other sources
    out = weights.convert_cached("m", src, cache=tmp_path)
    assert out == stale and (out / "model.safetensors").read_bytes() == b"new weights"
    (out / weights.SOURCES_STAMP).write_text("[]")
    weights.convert_cached("m", src, cache=tmp_path)
    assert len(fake_convert) == 2


def _aged(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    for p in [*path.iterdir(), path] if path.is_dir() and not path.is_symlink() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)
    return path


def test_old_temp_folders_of_killed_conversions_are_removed(tmp_path: Path, fake_convert: list,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    models = weights.cache_dir(tmp_path)
    models.mkdir(parents=True)
    hour = 3600.0

    def temp(name: str, age: float) -> Path:
        d = models / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
        return _aged(d, age)

    killed, swap = temp(".m.a1b2c3d4", hour), temp(".m.old.zz_9yy8x", hour)
    running = temp(".m.q1w2e3r4", 10)  # a conversion in progress right now
    other_model = temp(".mm.a1b2c3d4", hour)
    elsewhere = tmp_path / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    _aged(elsewhere, hour)
    link = models / ".m.l1n2k3s4"
    link.symlink_to(elsewhere, target_is_directory=True)
    weights.convert_cached("m", _ct2_dir(tmp_path, b"w"), cache=tmp_path)
    assert not killed.exists() and not swap.exists()
    assert running.is_dir() and other_model.is_dir() and link.is_symlink()
    assert (elsewhere / "keep.txt").read_text() == "keep"
    # someone else's folder is never removed
    monkeypatch.setattr(weights.os, "getuid", lambda: os.stat(running).st_uid + 1)
    assert weights.remove_stale_temps(models, "m", older_than_s=0) == []
    assert running.is_dir()


def test_weights_replaced_while_loading_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash each record carries must be of the weights loaded, not of a newer conversion."""
    from types import SimpleNamespace

    from polyaccel.asr import transcriber
    from polyaccel.asr.transcriber import Transcriber

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "whisper"}')
    (model / "model.safetensors").write_bytes(b"old")
    monkeypatch.setenv("POLYACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transcriber, "_resolve_model", lambda p: weights.ResolvedModel("m", model, "directory"))

    def load(path, device, dtype):
        _replace(model / "model.safetensors", b"new")  # another process renames a new conversion in
        return SimpleNamespace(sample_rate=16000, max_audio_seconds=lambda: 30.0)

    monkeypatch.setattr(transcriber, "_load_model", load)
    with pytest.raises(RuntimeError, match="replaced while it loaded"):
        Transcriber.from_pretrained("m", backend="cpu", replicas=1, batch_size=1)


@pytest.mark.parametrize("what", ["entry", "file", "models"])
def test_a_cached_conversion_others_can_write_is_refused(tmp_path: Path, fake_convert: list, what: str) -> None:
    """A shared POLYACCEL_CACHE: a cached conversion whose folder, one of its files, or the
    folder holding it (not sticky) others may write is refused (its weights may be theirs),
    naming it; the same folder sticky, like /tmp, is fine."""
    src = _ct2_dir(tmp_path, b"weights")
    out = weights.convert_cached("m", src, cache=tmp_path)
    path = {"entry": out, "file": out / "model.safetensors", "models": out.parent}[what]
    path.chmod(path.stat().st_mode | 0o002)
    with pytest.raises(ValueError, match=f"{path} is writable by others"):
        weights.convert_cached("m", src, cache=tmp_path)
    if what == "models":
        path.chmod(path.stat().st_mode | 0o1000)  # sticky: others cannot rename or remove the entry
        assert weights.convert_cached("m", src, cache=tmp_path) == out
    assert len(fake_convert) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cached_conversion_owned_by_another_user_is_refused(tmp_path: Path, fake_convert: list) -> None:
    src = _ct2_dir(tmp_path, b"weights")
    out = weights.convert_cached("m", src, cache=tmp_path)
    os.chown(out / "model.safetensors", 65534, -1)
    with pytest.raises(ValueError, match="model.safetensors is owned by another user"):
        weights.convert_cached("m", src, cache=tmp_path)


def test_a_conversion_made_under_umask_0_is_used_again(tmp_path: Path, fake_convert: list) -> None:
    """Under ``umask 0`` (some containers) a conversion's folder and files are still made so
    that others cannot write them, so the next run uses it instead of refusing it."""
    src = _ct2_dir(tmp_path, b"weights")
    old = os.umask(0)
    try:
        out = weights.convert_cached("m", src, cache=tmp_path / "fresh")
        assert weights.convert_cached("m", src, cache=tmp_path / "fresh") == out
    finally:
        os.umask(old)
    assert len(fake_convert) == 1
