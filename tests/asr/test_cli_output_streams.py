"""``polyaccel-asr`` output as other tools read it: a reader that leaves early (``| head``)
ends the command quietly (status 141, no traceback), and the JSON written is strict (no
``NaN``/``Infinity`` tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from polyaccel.asr.results_file import dumps


def test_wer_per_file_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    hyps, refs = tmp_path / "hyps.jsonl", tmp_path / "refs.jsonl"
    hyps.write_text("".join(json.dumps({"path": f"/clips/a{i}.wav", "text": "a b c", "duration_s": 1.0,
                                        "error": None}) + "\n" for i in range(200)))
    refs.write_text("".join(json.dumps({"path": f"/clips/a{i}.wav", "text": "a b d"}) + "\n" for i in range(200)))
    proc = subprocess.Popen([sys.executable, "-m", "polyaccel.asr.cli", "wer", "--refs", str(refs), "--hyps",
                             str(hyps), "--per-file"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    proc.stdout.close()  # like `| head -0`: the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_results_lines_are_strict_json() -> None:
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    line = dumps({"path": "a.wav", "text": "", "duration_s": 0.0, "rtfx": float("inf"), "score": float("nan")})
    rec = json.loads(line, parse_constant=refuse)
    assert rec["rtfx"] is None and rec["score"] is None and rec["duration_s"] == 0.0


def test_a_broken_pipe_other_than_stdout_is_exit_1_naming_it(monkeypatch, capsys) -> None:
    """Only a closed stdout is the quiet 141: a pipe the command writes besides (a FIFO whose
    reader left) stops it with one line naming that pipe, and the "stopped early" status."""
    import errno

    from polyaccel.asr import cli

    def broken(argv):  # noqa: ANN001, ANN202
        raise BrokenPipeError(errno.EPIPE, "Broken pipe", "/tmp/subs.fifo")

    monkeypatch.setattr(cli, "_main", broken)
    assert cli.main(["wer"]) == 1
    err = capsys.readouterr().err
    assert "polyaccel-asr: error: cannot write /tmp/subs.fifo: Broken pipe" in err and "Traceback" not in err
