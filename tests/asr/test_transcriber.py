"""Transcriber: input order, per-item errors, long-audio windows and stitching (with a fake
recognizer whose "words" are written into the samples), then the real Whisper tiny.en on
LibriVox clips: 8 kHz stereo, a ~70 s concatenation, bad files mixed in."""

from __future__ import annotations

import glob
import os
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import samples, weights
from polyaccel.asr.manifest import InputItem
from polyaccel.asr.transcriber import CLOSED_ERROR, Transcriber
from polyaccel.asr.wer import wer

SR = 16000
LIBRIVOX = str(samples.librivox_dir() or samples.DEBIAN_LIBRIVOX)  # make setup installs them from PyPI


# ---- a fake model: one word per second of audio, read from the samples -----------------------


def _spoken(words: list[int]) -> np.ndarray:
    """One second per word; word k is the constant sample value k / 10000."""
    return np.repeat(np.asarray(words, np.float32) / 10000, SR)


def _fake_recognize(batch: list[np.ndarray]) -> list[str]:
    out = []
    for a in batch:
        if a[0] == np.float32(0.9999):
            raise RuntimeError("poisoned input")
        # Only whole seconds count; a window edge inside a second drops that word, like a
        # real model cutting a word in half.
        starts = range(0, len(a) - SR + 1, SR)
        out.append(" ".join(f"w{round(float(a[s]) * 10000)}" for s in starts))
    return out


def _fake(replicas: int = 2, batch_size: int = 3, calls: list | None = None) -> Transcriber:
    def factory(i: int):
        def recognize(batch):
            if calls is not None:
                calls.append((i, threading.current_thread().name, len(batch)))
                time.sleep(0.02)  # long enough that one replica cannot take every batch
            return _fake_recognize(batch)
        return recognize

    return Transcriber(factory, sample_rate=SR, max_audio_seconds=30.0, replicas=replicas,
                       batch_size=batch_size, overlap_s=3.0)


def test_close_from_another_thread_ends_a_running_call_cleanly() -> None:
    """close() while transcribe runs: what finished is returned, the rest of what was read
    says it was closed, nothing raises, and the transcriber works again afterwards."""
    reached, release = threading.Event(), threading.Event()

    def factory(i: int):
        def recognize(batch):
            if any(round(float(a[0]) * 10000) == 4 for a in batch):  # input 3: running when closed
                reached.set()
                release.wait(10)
            return _fake_recognize(batch)
        return recognize

    tr = Transcriber(factory, sample_rate=SR, replicas=1, batch_size=1, overlap_s=3.0)

    def close_while_input_3_runs() -> None:
        assert reached.wait(10)
        pool = tr._pool.pool
        closer = threading.Thread(target=tr.close)
        closer.start()
        while not pool.closed:
            time.sleep(0.001)
        release.set()  # the running batch finishes after the close began
        closer.join(10)

    helper = threading.Thread(target=close_while_input_3_runs)
    helper.start()
    results = list(tr.transcribe_iter(_spoken([i + 1]) for i in range(40)))
    helper.join(10)
    assert 8 <= len(results) < 40  # inputs not read yet stay unread
    assert [r.path for r in results] == [f"<array {i}>" for i in range(len(results))]
    assert results[3].ok and results[3].text == "w4"
    closed = [r for r in results if not r.ok]
    assert closed and all(r.error == CLOSED_ERROR and r.text == "" for r in closed)
    assert all(r.text == f"w{i + 1}" for i, r in enumerate(results) if r.ok)
    assert tr.last_metrics.failed == len(closed) and tr.last_metrics.items == len(results)
    assert [r.text for r in tr.transcribe([_spoken([7])])] == ["w7"]  # usable again
    tr.close()


def test_results_in_input_order_with_errors_in_place(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    inputs: list = []
    expected: list[str | None] = []
    for i in range(23):
        n = int(rng.integers(1, 9))
        words = list(range(100 * i, 100 * i + n))
        if i % 7 == 3:
            inputs.append(str(tmp_path / f"missing{i}.wav"))
            expected.append(None)
        elif i % 5 == 4:
            p = tmp_path / f"ok{i}.flac"
            sf.write(p, _spoken(words), SR, subtype="PCM_24")
            inputs.append(InputItem(str(p), ref="ref"))
            expected.append(" ".join(f"w{w}" for w in words))
        else:
            inputs.append(_spoken(words))
            expected.append(" ".join(f"w{w}" for w in words))
    calls: list = []
    tr = _fake(calls=calls)
    with tr:
        results = tr.transcribe(inputs)
    assert len(results) == len(inputs)
    for r, exp, inp in zip(results, expected, inputs):
        if exp is None:
            assert r.error == "missing file" and r.text == "" and r.path == inp
        else:
            assert r.ok and r.text == exp
    assert results[4].ref == "ref" and results[4].path.endswith("ok4.flac")
    assert {c[0] for c in calls} == {0, 1}, "both replicas should have worked"
    assert max(c[2] for c in calls) <= 3
    m = tr.last_metrics
    assert m.items == 23 and m.failed == sum(e is None for e in expected)
    assert m.audio_s == pytest.approx(sum(r.duration_s for r in results if r.ok))
    assert m.rtfx > 0 and m.features_included


def test_one_bad_item_does_not_fail_its_batch() -> None:
    good = [_spoken([1, 2]), _spoken([3]), _spoken([4, 5, 6])]
    bad = np.full(SR, 0.9999, np.float32)
    with _fake(replicas=1, batch_size=4) as tr:
        results = tr.transcribe([good[0], bad, good[1], good[2]])
    assert [r.text for r in results] == ["w1 w2", "", "w3", "w4 w5 w6"]
    assert results[1].error is not None and "poisoned input" in results[1].error


def test_long_audio_is_windowed_and_stitched_without_loss() -> None:
    words = list(range(1, 131))  # 130 s: five 30 s windows with 3 s overlaps
    with _fake(replicas=2, batch_size=2) as tr:
        (r,) = tr.transcribe([_spoken(words)])
    assert r.windows == 5
    assert r.text == " ".join(f"w{w}" for w in words)
    assert r.duration_s == pytest.approx(130.0)


def test_two_hours_in_bounded_memory_with_every_word_kept() -> None:
    """A 2 h waveform (460 MB) goes through windows that are views of it: no copy of the
    audio, no per-window buffers held, and the 7200 one-second "words" come out once each."""
    words = list(range(1, 7201))
    audio = _spoken(words)
    user_copy = audio[:10].copy()
    with _fake(replicas=2, batch_size=8) as tr:
        tr.transcribe([_spoken([1])])  # imports and threads first: trace only the job itself
        tracemalloc.start()
        try:
            (r,) = tr.transcribe([audio])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 0.25 * audio.nbytes, f"peak {peak / 2**20:.0f} MiB for {audio.nbytes / 2**20:.0f} MiB of audio"
    assert r.windows == 267 and r.duration_s == pytest.approx(7200.0)
    assert r.text == " ".join(f"w{w}" for w in words)
    np.testing.assert_array_equal(audio[:10], user_copy)  # the caller's array is not modified


def test_streaming_yields_before_the_input_ends() -> None:
    seen: list[int] = []

    def inputs():
        for i in range(40):
            seen.append(i)
            yield _spoken([i + 1])

    with _fake(replicas=1, batch_size=2) as tr:
        it = tr.transcribe_iter(inputs(), lookahead=4)
        first = next(it)
        assert first.text == "w1"
        assert len(seen) < 40, "transcribe_iter must not read the whole input first"
        rest = list(it)
    assert [r.text for r in rest] == [f"w{i + 1}" for i in range(1, 40)]


def test_arrays_at_other_rates_and_empty_input() -> None:
    with _fake(replicas=1) as tr:
        a8k = np.repeat(np.float32(0.0007), 8000 * 2)  # 2 s of "w7" at 8 kHz
        results = tr.transcribe([(a8k, 8000), np.zeros(0, np.float32)])
        assert results[0].text == "w7 w7" and results[0].duration_s == pytest.approx(2.0)
        assert results[1].error == "empty audio (0 samples)"
        assert tr.transcribe([]) == []


# ---- the real model ------------------------------------------------------------------------------


def _clips() -> dict[str, str]:
    files = sorted(glob.glob(f"{LIBRIVOX}/*.wav"))
    if not files:
        pytest.skip("LibriVox clips missing: apt-get install pocketsphinx-testdata")
    refs = {}
    for line in Path(LIBRIVOX, "transcription").read_text().splitlines():
        text, _, uid = line.rpartition("(")
        refs[uid.strip(" )")] = text.replace("<s>", "").replace("</s>", "").strip()
    return {f: refs[Path(f).stem] for f in files}




@pytest.fixture(scope="module")
def tiny(one_thread: None) -> Transcriber:
    try:
        tr = Transcriber.from_pretrained(os.environ.get("POLYACCEL_TEST_WHISPER_TINY", "whisper-tiny.en"),
                                         backend="cpu", replicas=1, batch_size=4)
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"whisper-tiny.en not available: {e}")
    yield tr
    tr.close()


def test_tiny_en_on_librivox_clips_and_bad_files(tiny: Transcriber, tmp_path: Path) -> None:
    clips = _clips()
    files = [f for f in clips if f.endswith(("0880.wav", "0930.wav"))]  # the two shortest
    truncated = tmp_path / "truncated.wav"
    truncated.write_bytes(Path(files[0]).read_bytes()[:30000])
    text_wav = tmp_path / "notes.wav"
    text_wav.write_text("not audio")
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    inputs = [files[0], str(truncated), str(text_wav), str(empty), files[1], str(tmp_path / "missing.wav")]
    results = tiny.transcribe(inputs)
    assert [r.path for r in results] == inputs
    errors = {Path(r.path).name: r.error for r in results if not r.ok}
    assert set(errors) == {"truncated.wav", "notes.wav", "empty.wav", "missing.wav"}
    assert "truncated" in errors["truncated.wav"] and "not an audio file" in errors["notes.wav"]
    good = [r for r in results if r.ok]
    assert wer([clips[r.path] for r in good], [r.text for r in good]) < 0.15


def test_tiny_en_8khz_stereo_matches_16khz_mono(tiny: Transcriber, tmp_path: Path) -> None:
    import soxr

    clips = _clips()
    f = sorted(clips)[1]  # "he was not an ill disposed young man"
    x, rate = sf.read(f, dtype="float32")
    x8 = soxr.resample(x, rate, 8000)
    stereo = tmp_path / "stereo8k.wav"
    sf.write(stereo, np.stack([x8, 0.8 * x8], 1), 8000)
    (st,) = tiny.transcribe([str(stereo)])
    assert st.ok and st.duration_s == pytest.approx(len(x) / rate, abs=1e-3)
    assert wer([clips[f]], [st.text]) <= 0.13, st.text  # at most one word of eight


def test_tiny_en_long_file_is_chunked_and_stitched(tiny: Transcriber, tmp_path: Path) -> None:
    """~46 s made of the five clips and three of them again, with silences: two 30 s windows
    sharing ~13 s, every word kept once (the repeated sentences must not confuse the seam)."""
    clips = _clips()
    pieces, ref_words = [], []
    for f in list(clips) + list(clips)[:3]:
        pieces += [sf.read(f, dtype="float32")[0], np.zeros(int(0.8 * SR), np.float32)]
        ref_words.append(clips[f])
    long = np.concatenate(pieces)
    path = tmp_path / "long.flac"
    sf.write(path, long, SR)
    (r,) = tiny.transcribe([str(path)])
    assert r.ok and r.windows == 2 and r.duration_s == pytest.approx(len(long) / SR)
    assert wer([" ".join(ref_words)], [r.text]) < 0.12, r.text


@pytest.mark.gpu
def test_real_weights_on_cuda_replicas_match_cpu(one_thread: None) -> None:
    """Two replicas sharing one GPU's weights give the CPU reference's transcripts. The GPU
    machine has no pinned weight packages: ``$POLYACCEL_TEST_WHISPER_TINY`` names a tiny.en
    folder carried there, else the first of ``$POLYACCEL_TEST_WHISPER`` (the folders the
    exactness tests take); the CPU reference loads the same folder."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    carried = os.environ.get("POLYACCEL_TEST_WHISPER", "").split(",")[0]
    model = os.environ.get("POLYACCEL_TEST_WHISPER_TINY") or carried or "whisper-tiny.en"
    files = sorted(_clips())
    try:
        ref = Transcriber.from_pretrained(model, backend="cpu", replicas=1, batch_size=4)
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"{model} not available: {e}")
    with ref:
        cpu = ref.transcribe(files)
    with Transcriber.from_pretrained(model, backend="cuda", replicas=2, batch_size=4,
                                     dtype=torch.float32) as tr:
        gpu = tr.transcribe(files * 4)
        assert tr.last_metrics.rtfx > 0 and tr.last_metrics.failed == 0
    assert all(r.ok and r.text for r in cpu)
    assert wer([r.text for r in cpu] * 4, [r.text for r in gpu]) <= 0.02


def test_default_replicas_and_batch_size_come_from_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``replicas``: the backend's ``default_replicas()`` (device count x replicas per device;
    CUDA puts two on each GPU); no ``batch_size``: its ``default_batch_size`` (64 on a GPU)."""
    from polyaccel.core import select_backend
    from polyaccel.cuda.plugin import CudaBackend

    assert CudaBackend.replicas_per_device == 2 and CudaBackend.default_batch_size == 64
    cpu = type(select_backend("cpu"))
    assert cpu().default_replicas() == 1 and cpu.default_batch_size == 8
    monkeypatch.setattr(cpu, "replicas_per_device", 3)
    monkeypatch.setattr(cpu, "default_batch_size", 5)
    try:
        tr = Transcriber.from_pretrained("whisper-tiny.en", backend="cpu")
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"whisper-tiny.en not available: {e}")
    with tr:
        assert tr.replicas == 3 and tr.batch_size == 5
    with Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", batch_size=2) as tr:
        assert tr.batch_size == 2


@pytest.mark.parametrize("kw", [{"replicas": 0}, {"replicas": -2}, {"batch_size": 0}, {"batch_size": -1},
                                {"batch_size": 2.5}, {"overlap_s": -1.0}, {"overlap_s": float("nan")}])
def test_bad_sizes_are_refused_before_the_model_loads(kw: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``replicas=0`` is not the default, and a negative overlap would skip audio between windows."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("polyaccel.asr.transcriber._resolve_model", no_load)
    with pytest.raises(ValueError, match=next(iter(kw))):
        Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", **kw)
    if "overlap_s" in kw:
        with pytest.raises(ValueError, match="overlap_s"):
            Transcriber(lambda i: lambda batch: [""] * len(batch), **kw)


def test_replicas_that_fit_the_decoder_state() -> None:
    from polyaccel.asr.transcriber import replicas_that_fit

    gib = 2**30
    assert replicas_that_fit(2, 135 * gib, 5 * gib) == 2          # turbo at batch 128: both fit
    assert replicas_that_fit(2, 135 * gib, 41 * gib) == 1         # large-v3 at batch 128: one
    assert replicas_that_fit(2, 1 * gib, 41 * gib) == 1           # never fewer than one
    assert replicas_that_fit(8, 100 * gib, 3 * gib) == 7
    assert replicas_that_fit(2, 1 * gib, 0) == 2                  # a model that cannot say


@pytest.mark.parametrize("kind", ["whisper", "conformer"])
def test_decode_state_bytes_is_what_a_runner_allocates(kind: str) -> None:
    """The estimate equals the decoder-state tensors a runner's slots hold for one batch size:
    Whisper one state; ConformerAED one self-attention cache shared by its frame buckets and
    cross-attention K/V per frame bucket."""
    import torch

    from polyaccel.asr.interface import DecoderState
    from polyaccel.asr.runner import ASRRunner

    if kind == "whisper":
        from polyaccel.asr.whisper import WhisperASR, WhisperConfig

        model = WhisperASR(WhisperConfig(num_mel_bins=16, d_model=32, encoder_layers=1, encoder_attention_heads=4,
                                         encoder_ffn_dim=64, decoder_layers=2, decoder_attention_heads=4,
                                         decoder_ffn_dim=64, vocab_size=120, max_source_positions=1500,
                                         max_target_positions=24, decoder_start_token_id=100, eos_token_id=99,
                                         no_timestamps_token_id=None)).eval()
    else:
        from polyaccel.asr.conformer import ConformerAED
        from polyaccel.asr.conformer_config import tiny

        model = ConformerAED.from_config(tiny(), seed=0).eval()
    model = model.to(torch.bfloat16)
    runner = ASRRunner(model, backend="cpu", batch_buckets=(3,), use_graphs=False)
    frames = getattr(model.config, "frame_buckets", [None])
    for f in frames:
        runner._slot({"batch": 3, **({"frames": f} if f else {})})
    held = {t.data_ptr(): t.nbytes for s in runner._slots.values() for t in DecoderState.tensors(s.state)[:4]}
    assert model.decode_state_bytes(3) == sum(held.values())
