"""Text from a data file never reaches the terminal raw. A JSONL record without a text field
is refused naming its keys, and ``polyaccel-moe`` printed them as they were: a key holding
escape sequences (a dataset from the internet) retitled or cleared the user's terminal, and a
newline in it printed lines that looked like polyaccel-moe's own. The error line now escapes
control characters as ``polyaccel-asr`` does (``\\x1b``, ``\\n``)."""

from __future__ import annotations

import json
from pathlib import Path

from polyaccel.moe import cli

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"
HOSTILE = "\x1b]0;owned\x07\x1b[2Jhi\npolyaccel-moe: training finished\u202e"


def test_a_hostile_key_in_the_data_is_escaped_on_one_line(tmp_path: Path, capsys) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({HOSTILE: 1}) + "\n")
    rc = cli.main(["finetune", str(TINY), "--set", "data.synthetic=null", "--set", f"data.jsonl={data}",
                   "--set", f"output_dir={tmp_path / 'out'}", "--set", "checkpoint.dir=null"])
    err = capsys.readouterr().err
    assert rc == 2 and "record has no 'text' field" in err
    assert err.endswith("\n") and err.count("\n") == 1
    assert "\x1b" not in err and "\x07" not in err and "\u202e" not in err
    assert r"\x1b]0;owned\x07\x1b[2Jhi\npolyaccel-moe: training finished\u202e" in err
    assert not (tmp_path / "out").exists()
