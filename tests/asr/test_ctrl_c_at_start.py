"""Ctrl-C in the seconds ``polyaccel-asr`` spends loading torch: it printed a traceback through
torch's import machinery and the process died of SIGINT (the CLI's handler did not exist yet);
now one line, exit 130."""

from __future__ import annotations

import subprocess
import sys


def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(tmp_path, ctrl_c_while_torch_loads):
    done = ctrl_c_while_torch_loads("polyaccel.asr.launch:run",
                                    ["polyaccel-asr", "transcribe", "a.wav", "-o", "out.jsonl"], tmp_path)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "polyaccel-asr: interrupted while starting; nothing was run or written\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_the_command_runs_through_the_launcher(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['polyaccel-asr', '--help']; "
                           "from polyaccel.asr.launch import run; run()"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "transcribe" in done.stdout, done.stderr
