"""Damaged inputs a fine-tuning run reads, each refused in one line with exit 2 before training
(no traceback): a tokenizer whose files parse but are not what Transformers or tokenizers
expect (raised as KeyError, TypeError, AttributeError or tokenizers' bare Exception, which
only ``output_dir``'s tokenizer check caught: with data to tokenize and no output_dir the run
died with a traceback, exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", {"version": "1.0", "model": {"type": "WordLevel"}}),  # no added_tokens: KeyError
    ("tokenizer.json", {"version": "1.0", "added_tokens": [], "model": {"type": "Nope"}}),  # tokenizers' Exception
    ("tokenizer_config.json", [1, 2]),  # not an object: TypeError
    ("tokenizer_config.json", {"added_tokens_decoder": 5}),  # AttributeError
])
def test_a_damaged_tokenizer_for_the_data_is_one_line_and_exit_2(tmp_path, with_tokenizer, capsys, name, content):
    base = with_tokenizer()
    (base / name).write_text(json.dumps(content))
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a a a"}\n')
    code = main(["finetune", str(TINY), "--set", f"model.path={base}", "--set", "model.preset=null",
                 "--set", f"data.jsonl={data}", "--set", "output_dir=null", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                 "--set", "log.progress_bar=false", "--set", "train.max_steps=1", "--set", "train.seq_len=8"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"polyaccel-moe: error: cannot load a tokenizer from {base}: " in err
    assert "Traceback" not in err and not (tmp_path / "ck").exists()
