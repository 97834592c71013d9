"""``model.implementation: transformers`` (the baseline) with an ``attn_implementation``
Transformers refuses (an unknown name, or ``flash_attention_2`` copied from a GPU config onto a
machine without ``flash-attn``) is one line, exit 2, before anything is written: it was a
``ValueError``/``ImportError`` traceback, exit 1, once the data had been read."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import transformers  # noqa: F401  (at collection: its log handler binds the sys.stderr of its first import, not a test's capsys)

from polyaccel.moe.cli import main

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


@pytest.mark.parametrize("attn", ["nope", "flash_attention_2"])
def test_an_attention_transformers_refuses_is_one_line_exit_2(tmp_path, capsys, attn):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    sets = ("model.implementation=transformers", f"model.attn_implementation={attn}", "log.progress_bar=false",
            f"output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}")
    code = main(["finetune", str(TINY), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"polyaccel-moe: error: model.attn_implementation={attn!r}: ")
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_supported_attention_still_trains(tmp_path, capsys):
    sets = ("model.implementation=transformers", "model.attn_implementation=eager", "log.progress_bar=false",
            "train.max_steps=1", f"output_dir={tmp_path / 'out'}", "checkpoint.dir=null")
    assert main(["finetune", str(TINY), *[a for s in sets for a in ("--set", s)]]) == 0, capsys.readouterr().err
