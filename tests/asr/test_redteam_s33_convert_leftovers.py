"""``polyaccel-asr convert`` killed mid-conversion (``kill -9``, the OOM killer, a power cut)
left its hidden ``.OUT.<12 hex>`` folder beside OUT for good: a whole converted model (GBs for
large-v3) that no rerun ever removed. A rerun to the same OUT now removes those of its own that
nothing has touched for 30 minutes (real folders of this user, never through a link), as the
conversion cache does for its temporaries; a conversion still running (recent) is left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from polyaccel.asr import ct2_convert


def _aged(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    for p in [*path.iterdir(), path] if path.is_dir() and not path.is_symlink() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)
    return path


def _folder(path: Path, age: float) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"half a model")
    return _aged(path, age)


def test_a_rerun_removes_what_a_killed_convert_left_and_nothing_else(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_convert(src, out, *, assets_dir=None):
        (Path(out) / "model.safetensors").write_bytes(b"whole model")

    monkeypatch.setattr(ct2_convert, "convert_ct2_whisper", fake_convert)
    hour = 3600.0
    killed = _folder(tmp_path / ".hf.0123456789ab", hour)
    running = _folder(tmp_path / ".hf.aaaaaaaaaaaa", 10)
    other = _folder(tmp_path / ".hf2.0123456789ab", hour)
    precious = _folder(tmp_path / "precious", hour)
    link = tmp_path / ".hf.bbbbbbbbbbbb"
    link.symlink_to(precious, target_is_directory=True)
    _aged(link, hour)
    assert ct2_convert.main([str(tmp_path / "src"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == b"whole model"
    assert not killed.exists()
    assert running.is_dir() and other.is_dir() and link.is_symlink()
    assert (precious / "model.safetensors").read_bytes() == b"half a model"
