"""Session 29 attack pass: a Whisper folder whose config.json / generation_config.json holds
decoding fields that decoding cannot use (an eos id beyond the vocabulary, an empty eos list,
suppressed tokens that are not ids, a negative ``layer_norm_eps``, a multilingual checkpoint
without the language's token) is refused at load, one line, exit 2, nothing written. Before,
``eos_token_id: []`` and a missing ``<|en|>`` stopped the run with a traceback, and the other
values failed every file at recognition (exit 3) or decoded garbage with exit 0 (an eos id the
model never emits: the text ran to the length limit)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polyaccel.asr import cli
from polyaccel.asr.whisper import WhisperASR, WhisperConfig

TINY = {"model_type": "whisper", "num_mel_bins": 80, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
        "vocab_size": 8, "max_target_positions": 8, "max_source_positions": 1500, "decoder_start_token_id": 3,
        "eos_token_id": 2, "no_timestamps_token_id": None}

BAD = {
    "eos_token_id": ({}, {"eos_token_id": []}),
    "eos_token_id=1000": ({}, {"eos_token_id": 1000}),
    "eos_token_id='x'": ({}, {"eos_token_id": "x"}),
    "decoder_start_token_id": ({"decoder_start_token_id": -1}, {}),
    "no_timestamps_token_id": ({}, {"no_timestamps_token_id": 99}),
    "suppress_tokens": ({}, {"suppress_tokens": [1, 10**9]}),
    "suppress_tokens='ab'": ({}, {"suppress_tokens": "ab"}),
    "begin_suppress_tokens": ({}, {"begin_suppress_tokens": [True]}),
    "max_initial_timestamp_index": ({}, {"max_initial_timestamp_index": "a"}),
    "layer_norm_eps": ({"layer_norm_eps": -1}, {}),
    "layer_norm_eps='x'": ({"layer_norm_eps": "x"}, {}),
    "is_multilingual": ({}, {"is_multilingual": "yes"}),
    "lang_to_id": ({}, {"is_multilingual": True, "lang_to_id": [1, 2]}),
}


def _folder(tmp_path: Path, cfg: dict, gen: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**TINY, **cfg}))
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


@pytest.mark.parametrize("case", BAD)
def test_a_decoding_field_decoding_cannot_use_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    folder = _folder(tmp_path, *BAD[case])
    field = case.split("=")[0]
    with pytest.raises(ValueError, match=rf"generation_config\.json: {field}=.* is not "):
        WhisperConfig.from_pretrained(folder)


def test_the_real_fields_load(tmp_path: Path) -> None:
    """Control: Whisper's own values (eos as a list, suppressed ids, multilingual tables) load."""
    gen = {"eos_token_id": [2, 5], "suppress_tokens": [1, 4], "begin_suppress_tokens": [2],
           "max_initial_timestamp_index": 50, "is_multilingual": True,
           "lang_to_id": {"<|en|>": 6}, "task_to_id": {"transcribe": 7}}
    c = WhisperConfig.from_pretrained(_folder(tmp_path, {}, gen))
    assert (c.eos_token_id, c.suppress_tokens, c.lang_to_id) == (2, (1, 4), {"<|en|>": 6})


def test_a_small_vocabulary_without_a_notimestamps_id_gets_none(tmp_path: Path) -> None:
    """A checkpoint that names no ``<|notimestamps|>`` keeps loading when Whisper's default id
    (50362) is beyond its vocabulary: it has no such token (as ``timestamp_rules`` says)."""
    cfg = {k: v for k, v in TINY.items() if k != "no_timestamps_token_id"}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert WhisperConfig.from_pretrained(tmp_path / "m").no_timestamps_token_id is None


def _with_weights(folder: Path) -> Path:
    torch.manual_seed(0)
    model = WhisperASR(WhisperConfig.from_pretrained(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case", ["eos_token_id", "language"])
def test_the_cli_refuses_it_in_one_line_and_writes_nothing(tmp_path: Path, asr_cli, capsys, case: str) -> None:
    folder = _with_weights(_folder(tmp_path, {}, {}))  # weights that fit, then the bad field
    gen = {"eos_token_id": []} if case == "eos_token_id" else {"is_multilingual": True}  # no <|en|>
    (folder / "generation_config.json").write_text(json.dumps(gen))
    rc, err, out = asr_cli.run_with_model(tmp_path, folder, capsys)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert ("eos_token_id=[]" if case == "eos_token_id" else "language 'en'") in err
    assert not out.exists()


@pytest.fixture
def unstartable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that loads but whose replicas do not start (the factory raises)."""
    from polyaccel.asr.transcriber import Transcriber

    def factory(i: int):
        raise ValueError("this replica cannot start")

    def from_pretrained(name: str = "fake", *, batch_size: int | None = None, replicas: int | None = None, **kw):
        return Transcriber(factory, sample_rate=16000, max_audio_seconds=30.0, replicas=replicas or 1,
                           batch_size=batch_size or 8, model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(from_pretrained))


@pytest.mark.parametrize("command", ["transcribe", "bench"])
def test_a_replica_that_does_not_start_is_one_line_exit_2(tmp_path: Path, asr_cli, capsys, unstartable,
                                                          command: str) -> None:
    """Was a ``ReplicaStartError`` traceback (exit 1)."""
    wav, out = str(asr_cli.wav(tmp_path / "a.wav")), tmp_path / "out.jsonl"
    argv = ["transcribe", wav, "-o", str(out), "-q"] if command == "transcribe" else ["bench", wav, "--batch-sizes", "1"]
    capsys.readouterr()
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip() == f"polyaccel-asr {command}: error: the model does not start: ValueError: this replica cannot start"
    assert not out.exists()
