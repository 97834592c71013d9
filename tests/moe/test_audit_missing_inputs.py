"""A ``model.path`` that does not exist says so (it said "no config.json", as of a folder
without one), and a ``data.tokenizer`` that names the tokenizer's file instead of its folder
says that (it said "no such directory" of a file that is there)."""

from __future__ import annotations

import pytest

from polyaccel.moe.data import load_tokenizer
from polyaccel.moe.train import resolve_model_config
from polyaccel.moe.train_config import ConfigError, ModelConfig


@pytest.mark.parametrize("kind, why", [("missing", "it does not exist"), ("file", "it is a file"),
                                       ("folder", "no config.json")])
def test_a_model_path_that_is_no_checkpoint_says_why(tmp_path, kind, why):
    path = tmp_path / "model"
    if kind == "file":
        path.write_text("{}")
    elif kind == "folder":
        path.mkdir()
    with pytest.raises(ConfigError, match=f"model.path {path} is not a Hugging Face checkpoint \\({why}\\)"):
        resolve_model_config(ModelConfig(path=str(path)))


def test_a_tokenizer_file_for_its_folder_says_so(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    with pytest.raises(ConfigError, match=f"{tok}: a file, not the tokenizer's folder"):
        load_tokenizer(str(tok))
