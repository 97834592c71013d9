"""docs/asr.md's example results line has the fields, in the order, of a line a run writes
today (it predated ``dtype``, ``overlap_s``, ``no_speech_threshold``), and the field table has a
row for every field a line can carry (``Transcriber.made_with()``'s included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import cli
from polyaccel.asr.transcriber import Transcriber

DOC = Path(__file__).resolve().parents[2] / "docs/asr.md"
SR = 16000


def _output_section() -> str:
    text = DOC.read_text()
    return text[text.index("\n## Output\n"):text.index("\n### Per-file errors\n")]


def _example() -> dict:
    (block,) = re.findall(r"```json\n(.*?)```", _output_section(), re.S)
    return json.loads(block)


def _table_fields() -> set[str]:
    return {name for row in re.findall(r"^\| (`.*?`) \|", _output_section(), re.M)
            for name in re.findall(r"`(\w+)`", row)}


def test_the_example_line_has_the_fields_of_a_line_written_now(tmp_path: Path) -> None:
    clip = tmp_path / "clips/0880.wav"
    clip.parent.mkdir()
    t = np.arange(int(SR * 1.0)) / SR
    sf.write(clip, (0.1 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), SR)
    refs = tmp_path / "refs.jsonl"
    refs.write_text(json.dumps({"path": str(clip), "text": "He was not an ill-disposed young man."}) + "\n")
    out = tmp_path / "out.jsonl"
    code = cli.main(["transcribe", str(clip), "-o", str(out), "--refs", str(refs), "--backend", "cpu", "-q"])
    if code == 2 and not out.exists():
        pytest.skip("the default model (whisper-tiny.en) is not installed")
    assert code == 0
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    example = _example()
    assert list(example) == list(rec)  # the same fields, in the same order
    assert {k: type(v) for k, v in example.items() if v is not None} == \
        {k: type(v) for k, v in rec.items() if example[k] is not None}
    assert (example["model"], example["dtype"], example["overlap_s"]) == (rec["model"], rec["dtype"], rec["overlap_s"])


def test_every_field_a_line_can_carry_has_a_row() -> None:
    tr = Transcriber(lambda i: (lambda batch: ["" for _ in batch]), sample_rate=SR, max_audio_seconds=30.0,
                     model_name="fake")
    tr.dtype_name, tr.no_speech_threshold, tr.fp8_encoder, tr.batch_invariant = "float32", 0.6, True, True
    made = set(tr.made_with())
    assert {"weights_sha256", "dtype", "overlap_s", "no_speech_threshold", "encoder_gemms", "batch_invariant"} <= made
    example = set(_example())
    missing = (made | example | {"path_bytes", "segments", "warnings", "actor"}) - _table_fields()
    assert not missing, f"docs/asr.md: no row for {sorted(missing)}"
