"""A Whisper folder loads the weight files Transformers would load (``model.safetensors``, or
the shards its index names), never every ``*.safetensors`` beside them: a backup or variant
(``model_old.safetensors``, ``model.fp32.safetensors``) sorted after ``model.safetensors``
silently replaced the model's tensors. Without an index or ``model.safetensors``, a tensor in
two files is refused, naming both; an index naming a file outside the folder is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from polyaccel.asr.whisper import WhisperASR, WhisperConfig

TINY = {"model_type": "whisper", "num_mel_bins": 80, "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32,
        "vocab_size": 8, "max_target_positions": 8, "max_source_positions": 1500, "decoder_start_token_id": 3,
        "eos_token_id": 2, "no_timestamps_token_id": None}


def _folder(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    torch.manual_seed(0)
    state = {k: v.contiguous() for k, v in WhisperASR(WhisperConfig.from_pretrained(folder)).state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder, load_file(str(folder / "model.safetensors"))


def _zeros(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


@pytest.mark.parametrize("stray", ["model_old.safetensors", "model2.safetensors", "model.fp32.safetensors"])
def test_a_stray_safetensors_beside_the_model_is_not_loaded(tmp_path: Path, stray: str) -> None:
    folder, state = _folder(tmp_path)
    save_file(_zeros(state), str(folder / stray))
    loaded = WhisperASR.from_pretrained(folder).state_dict()
    assert torch.equal(loaded["encoder.conv1.weight"], state["encoder.conv1.weight"])


def test_without_model_safetensors_a_tensor_in_two_files_is_refused_naming_both(tmp_path: Path) -> None:
    folder, state = _folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    save_file(_zeros(state), str(folder / "b.safetensors"))
    with pytest.raises(ValueError, match=r"in both a\.safetensors and b\.safetensors"):
        WhisperASR.from_pretrained(folder)


def test_sharded_weights_load_the_files_the_index_names(tmp_path: Path) -> None:
    folder, state = _folder(tmp_path)
    keys = sorted(state)
    half = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
            "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, ks in half.items():
        save_file({k: state[k] for k in ks}, str(folder / name))
    (folder / "model.safetensors").rename(folder / "model_backup.safetensors")  # not named by the index
    save_file(_zeros(state), str(folder / "model_backup.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, ks in half.items() for k in ks}}))
    loaded = WhisperASR.from_pretrained(folder).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in keys)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path, shard: str) -> None:
    folder, state = _folder(tmp_path)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in state}}))
    with pytest.raises(ValueError, match="not a file in"):
        WhisperASR.from_pretrained(folder)


def test_the_recorded_weights_sha256_is_of_the_files_loaded_not_a_backup_beside_them(tmp_path: Path) -> None:
    """Each results line's weights_sha256 hashed every ``*.safetensors`` in the folder, also the
    backup the loader ignores: the line named weights it was not made with, and copying a backup
    in made a resume refuse the folder's earlier results as made by other weights."""
    import hashlib

    from polyaccel.asr.weights import weights_identity, weights_sha256

    folder, state = _folder(tmp_path)
    cache = tmp_path / "cache"
    before = weights_sha256(folder, cache=cache)
    assert before == hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    identity = weights_identity(folder)
    save_file(_zeros(state), str(folder / "model.fp32.safetensors"))
    assert weights_sha256(folder, cache=cache) == before
    assert weights_identity(folder) == identity
