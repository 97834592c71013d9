"""``--set`` of a path or name key to text that YAML reads as a number or a date (a run folder
named ``20241204`` or ``2024-12-04``) takes the text typed: it was refused, "expected a string,
got datetime.date(2024, 12, 4)", with no way to quote it through the shell that works as typed."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyaccel.moe.train_config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


@pytest.mark.parametrize("text", ["20241204", "2024-12-04", "1.5", "0x10", "2024-12-04 10:00:00"])
def test_a_folder_named_like_a_number_or_a_date_is_that_folder(tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, [f"output_dir={text}", f"checkpoint.dir={text}", f"log.metrics_jsonl={text}",
                             f"data.field={text}"])
    assert cfg.output_dir == cfg.checkpoint.dir == cfg.log.metrics_jsonl == str(tmp_path / text)
    assert cfg.data.field == text


def test_numbers_stay_numbers_and_other_values_keep_their_meaning():
    cfg = load_config(TINY, ["train.seq_len=16", "train.lr=3", "model.config.hidden_size=8", "output_dir=false",
                             "checkpoint.dir=null"])
    assert (cfg.train.seq_len, cfg.train.lr, cfg.model.config["hidden_size"]) == (16, 3.0, 8)
    assert cfg.output_dir is None and cfg.checkpoint.dir is None
    with pytest.raises(ConfigError, match="train.dtype: 16 is not one of"):
        load_config(TINY, ["train.dtype=16"])
