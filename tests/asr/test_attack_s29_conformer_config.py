"""Session 29 attack pass: a ConformerAED ``config.json`` with a field of the wrong type or out
of range (``encoder_heads: 0``, ``d_model: "256"``, ``bos_token_id: null``, ``frame_buckets: 5``,
a negative token id or bucket, an unknown activation) is refused at load, one line naming the
field, exit 2, nothing written. Before, the first five stopped the run with a traceback
(ZeroDivisionError, TypeError), a negative batch bucket decoded, and a string
``layer_norm_eps`` or unknown activation failed every file at recognition (exit 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polyaccel.asr.conformer_config import ConformerAEDConfig, tiny

BAD = {
    "encoder_heads": 0, "d_model": "256", "conv_kernel_size": "9", "eos_token_id": "x", "bos_token_id": None,
    "pad_token_id": -1, "frame_buckets": 5, "batch_buckets": [-4], "layer_norm_eps": "x",
    "decoder_activation": "nope", "tie_word_embeddings": "no", "vocab_size": 2.5,
}


def _folder(tmp_path: Path, field: str) -> Path:
    folder = tmp_path / "conformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**tiny().to_dict(), field: BAD[field]}))
    return folder


@pytest.mark.parametrize("field", BAD)
def test_a_field_of_the_wrong_type_or_range_is_refused_naming_it(tmp_path: Path, field: str) -> None:
    with pytest.raises(ValueError, match=rf"config\.json: {field}=.* is not "):
        ConformerAEDConfig.load(_folder(tmp_path, field))


def test_the_presets_still_load(tmp_path: Path) -> None:
    """Control: a config as ``save`` writes it loads as it was."""
    tiny().save(tmp_path)
    assert ConformerAEDConfig.load(tmp_path) == tiny()


@pytest.mark.parametrize("field", ["encoder_heads", "bos_token_id"])
def test_the_cli_says_it_in_one_line(tmp_path: Path, asr_cli, capsys, field: str) -> None:
    folder = _folder(tmp_path, field)
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))  # never read: the config is refused first
    rc, err, out = asr_cli.run_with_model(tmp_path, folder, capsys)
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and f"{field}=" in err, err
    assert not out.exists()


@pytest.mark.parametrize("field, value", [("characters", 5), ("characters", ["ab", "c"]), ("special_tokens", [1, 2]),
                                          ("unk_token", None), ("lowercase", "yes")])
def test_a_tokenizer_field_of_the_wrong_type_is_refused_naming_it(tmp_path: Path, field: str, value: object) -> None:
    """``characters: 5`` was a TypeError traceback; ``characters: ["ab", "c"]`` loaded, each list
    item one "character" (a model decoding "ab" for one id)."""
    from polyaccel.asr.char_tokenizer import CharTokenizer

    CharTokenizer().save(tmp_path)
    tok = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**tok, field: value}))
    with pytest.raises(ValueError, match=rf"tokenizer\.json: {field}=.* is not "):
        CharTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert CharTokenizer.load(tmp_path).to_dict() == CharTokenizer().to_dict()  # control
