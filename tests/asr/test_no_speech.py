"""``no_speech_threshold``: Whisper's no-speech probability (its ``<|nocaptions|>`` /
``<|nospeech|>`` token right after the start token) read in the greedy loop, and windows above
the threshold given no text instead of what Whisper makes up for silence ("you"); real speech
is untouched. The real-model checks run Whisper tiny.en on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from polyaccel.asr import cli, samples
from polyaccel.asr.decoding import LogitsRules, greedy_decode

SR = 16000


def _fake_step(no_speech_id: int, probs: list[float], V: int = 8):
    """A decoder step whose logits after the first token give ``no_speech_id`` the
    probabilities ``probs`` (one per row), then choose eos (id 1)."""
    calls = []

    def step(tokens, position):
        calls.append(1)
        logits = torch.full((len(tokens), V), -30.0)
        if len(calls) == 1:
            p = torch.tensor(probs + [0.5] * (len(tokens) - len(probs)))  # padding rows: anything
            logits[:, no_speech_id] = torch.log(p)
            logits[:, 0] = torch.log(1 - p)  # the rest of the mass on one other token
        else:
            logits[:, 1] = 0.0
        return logits

    return step


def test_greedy_decode_reads_the_no_speech_probability_after_the_start_token():
    probs = [0.9, 0.05, 0.5]
    hyps = greedy_decode(_fake_step(5, probs), batch=4, num_real=3, prompt=[2, 3], eos_id=1, max_new_tokens=3,
                         rules=LogitsRules([], [], 1, 0), device="cpu", no_speech_id=5)
    assert [h.no_speech_prob for h in hyps] == pytest.approx(probs, abs=1e-5)
    hyps = greedy_decode(_fake_step(5, probs), batch=4, num_real=3, prompt=[2, 3], eos_id=1, max_new_tokens=3,
                         rules=LogitsRules([], [], 1, 0), device="cpu")
    assert [h.no_speech_prob for h in hyps] == [None] * 3
    with pytest.raises(ValueError, match="at least two tokens"):
        greedy_decode(_fake_step(5, probs), batch=4, num_real=3, prompt=[3], eos_id=1, max_new_tokens=3,
                      rules=LogitsRules([], [], 1, 0), device="cpu", no_speech_id=5)


@pytest.fixture(scope="module")
def tiny_en() -> str:
    from polyaccel.asr import weights

    try:
        return str(weights.resolve_model("whisper-tiny.en"))
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"whisper-tiny.en not available: {e}")


def _speech() -> np.ndarray:
    folder = samples.librivox_dir() or samples.DEBIAN_LIBRIVOX
    clips = sorted(Path(folder).glob("*.wav")) if folder and Path(folder).is_dir() else []
    if not clips:
        pytest.skip("the LibriVox clips of make setup are not installed")
    audio, sr = sf.read(clips[0], dtype="float32")
    assert sr == SR
    return audio


def test_silence_gets_no_text_and_speech_is_untouched(tiny_en):
    from polyaccel.asr.runner import ASRRunner
    from polyaccel.asr.whisper import WhisperASR

    model = WhisperASR.from_pretrained(tiny_en).eval()
    assert model.no_speech_id() == 50361  # <|nocaptions|> of the English-only vocabulary
    audio = [np.zeros(3 * SR, np.float32), _speech()]
    plain = ASRRunner(model, backend="cpu", batch_buckets=(2,), use_graphs=False).recognize(audio)
    assert plain[0].text  # what Whisper makes up for silence
    assert plain[0].no_speech_prob is None
    gated = ASRRunner(model, backend="cpu", batch_buckets=(2,), use_graphs=False,
                      no_speech_threshold=0.6).recognize(audio)
    assert gated[0].text == "" and gated[0].no_speech_prob > 0.6
    assert gated[1].text == plain[1].text and gated[1].no_speech_prob < 0.6


def test_the_cli_flag_gives_silence_no_text(tiny_en, tmp_path):
    silent, speech = tmp_path / "silent.wav", tmp_path / "speech.wav"
    sf.write(silent, np.zeros(3 * SR, np.float32), SR)
    sf.write(speech, _speech(), SR)
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(silent), str(speech), "-o", str(out), "--backend", "cpu", "-q",
                     "--no-speech-threshold", "0.6"]) == 0
    texts = {Path(r["path"]).name: r["text"] for r in map(json.loads, out.read_text().splitlines())}
    assert texts["silent.wav"] == "" and len(texts["speech.wav"].split()) > 5


@pytest.mark.parametrize("use_graphs", [False, True])
def test_timestamps_with_an_english_only_model_read_the_same_no_speech_probability(tiny_en, use_graphs):
    """tiny.en with timestamps has the start token as its whole prompt: every window failed
    ("no_speech_id needs a prompt of at least two tokens"); its no-speech probability is that
    of the logits after the start token, as without timestamps."""
    from polyaccel.asr.runner import ASRRunner
    from polyaccel.asr.whisper import WhisperASR

    model = WhisperASR.from_pretrained(tiny_en).eval()
    audio = [np.zeros(3 * SR, np.float32), _speech()]
    plain = ASRRunner(model, backend="cpu", batch_buckets=(2,), use_graphs=use_graphs, timestamps=True
                      ).recognize(audio)
    notimestamps = ASRRunner(model, backend="cpu", batch_buckets=(2,), use_graphs=use_graphs,
                             no_speech_threshold=0.6).recognize(audio)
    gated = ASRRunner(model, backend="cpu", batch_buckets=(2,), use_graphs=use_graphs, timestamps=True,
                      no_speech_threshold=0.6).recognize(audio)
    assert gated[0].text == "" and gated[0].segments == []
    assert [h.no_speech_prob for h in gated] == pytest.approx([h.no_speech_prob for h in notimestamps], abs=1e-4)
    assert gated[1].text == plain[1].text and gated[1].segments == plain[1].segments
    assert gated[1].tokens == plain[1].tokens
