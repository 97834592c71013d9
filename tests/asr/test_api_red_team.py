"""Red-team checks of the Python API and model loading: in-memory arrays in any layout and
integer PCM type, inputs that are not audio, a failing input iterable, and config.json sizes
that would allocate memory without bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr.audio import AudioError, waveform_from_array
from polyaccel.asr.conformer import ConformerAED
from polyaccel.asr.conformer_config import ConformerAEDConfig, tiny
from polyaccel.asr.transcriber import Transcriber
from polyaccel.asr.whisper import WhisperConfig


def _echo(i: int):
    """A replica that says how long each waveform is and its mean (rounded)."""
    return lambda batch: [f"{len(a)} {a.mean():.2f}" for a in batch]


def _sine(n: int = 16000) -> np.ndarray:
    return np.sin(2 * np.pi * 440 * np.arange(n) / 16000).astype(np.float32)


def test_channels_first_arrays_are_mixed_down_not_read_as_two_samples() -> None:
    """A [C, T] array (torch's and librosa's layout) used to become C samples: a 'transcript'
    of nothing, with no error."""
    s = _sine()
    with Transcriber(_echo, batch_size=4) as tr:
        out = tr.transcribe([np.stack([s, s]), (np.stack([s, s]), 16000), np.stack([s, s], axis=1), s])
    assert [r.text for r in out] == ["16000 0.00"] * 4
    assert [r.duration_s for r in out] == [1.0] * 4
    with pytest.raises(AudioError, match="ambiguous"):
        waveform_from_array(np.zeros((4, 4), np.float32), 16000)


def test_integer_pcm_arrays_scale_as_libsndfile_reads_them() -> None:
    """uint8 PCM is centred on 128 (it used to keep a +0.5 DC offset at half scale)."""
    s = _sine() * 0.5
    u8 = np.round(s * 128 + 128).astype(np.uint8)
    i16 = np.round(s * 32768).astype(np.int16)
    u16 = (i16.astype(np.int32) + 32768).astype(np.uint16)
    i32 = i16.astype(np.int32) << 16
    for arr, tol in ((u8, 1 / 128), (i16, 1 / 32768), (u16, 1 / 32768), (i32, 1 / 32768)):
        w = waveform_from_array(arr, 16000)
        assert w.dtype == np.float32 and abs(float(w.mean())) < 0.01, arr.dtype
        np.testing.assert_allclose(w, s, atol=tol)
    assert waveform_from_array(np.array([-32768, 16384], np.int16), 16000).tolist() == [-1.0, 0.5]
    with Transcriber(_echo, batch_size=4) as tr:  # the path a Transcriber input takes
        means = [float(r.text.split()[1]) for r in tr.transcribe([u8, (u16, 16000)])]
    assert max(abs(m) for m in means) < 0.01
    for bad in (s > 0, s.astype(np.complex64), np.array(["a"] * 10)):
        with pytest.raises(AudioError, match="real-valued"):
            waveform_from_array(bad, 16000)
    # 16-bit samples in numpy's default int64 would be scaled by 2**63 into silence: refused
    for wide in (i16.astype(np.int64), u16.astype(np.uint64)):
        with pytest.raises(AudioError, match="no PCM format.*astype"):
            waveform_from_array(wide, 16000)


def test_inputs_that_are_not_audio_are_per_item_errors() -> None:
    """A list, None or a number among the inputs used to raise TypeError out of transcribe()
    and lose every other item's result."""
    s = _sine()
    with Transcriber(_echo, batch_size=4) as tr:
        out = tr.transcribe([s, [0.0, 1.0], None, 3, (s, float("nan")), (s,), s])
    assert [r.ok for r in out] == [True, False, False, False, False, False, True]
    assert "unsupported input of type list" in out[1].error
    assert "whole number of Hz" in out[4].error and "(array, sample_rate)" in out[5].error


def test_a_failing_input_iterable_keeps_the_results_read_before_it() -> None:
    """The inputs a generator yielded before it raised used to vanish with the exception."""
    def inputs():
        for k in range(3):
            yield np.zeros(1000 * (k + 1), np.float32)
        raise RuntimeError("the source broke")

    got = []
    with Transcriber(_echo, batch_size=4) as tr:
        with pytest.raises(RuntimeError, match="the source broke"):
            for r in tr.transcribe_iter(inputs()):
                got.append(r.text)
        assert got == ["1000 0.00", "2000 0.00", "3000 0.00"]
        assert tr.last_metrics.items == 3
        assert [r.text for r in tr.transcribe([np.zeros(500, np.float32)])] == ["500 0.00"]  # still usable


@pytest.mark.parametrize("field, value", [
    ("d_model", 10**9), ("num_mel_bins", 10**9), ("n_fft", 10**9), ("encoder_layers", 10**7),
    ("vocab_size", 10**12), ("chunk_seconds", 10**6), ("hop_length", 0), ("d_model", "384"),
    ("encoder_attention_heads", 7), ("sample_rate", 8000),
])
def test_absurd_whisper_config_is_refused_before_allocation(tmp_path: Path, field: str, value: object) -> None:
    """num_mel_bins or n_fft of 10**9 used to allocate the mel filterbank (7-305 GiB) and
    encoder_layers=10**7 to build ten million layers, before the weights were looked at."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "whisper", field: value}))
    with pytest.raises(ValueError, match=f"{field}|window"):
        WhisperConfig.from_pretrained(tmp_path)


def test_absurd_conformer_config_is_refused_before_allocation(tmp_path: Path) -> None:
    """ConformerAED builds its modules on the real device from config.json: a d_model far
    over its weights used to be allocated first (tens of GB), then refused."""
    model = ConformerAED.from_config(tiny(), seed=0)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "d_model": 10**9}))
    with pytest.raises(ValueError, match="d_model"):
        ConformerAEDConfig.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "d_model": 8192, "encoder_ffn_dim": 32768}))
    with pytest.raises(ValueError, match="config and weights do not match"):
        ConformerAED.from_pretrained(tmp_path)
