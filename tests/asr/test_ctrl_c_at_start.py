"""Ctrl-C in the seconds ``polyaccel-asr`` spends loading torch: it printed a traceback through
torch's import machinery and the process died of SIGINT (the CLI's handler did not exist yet);
now one line, exit 130."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CTRL_C_WHILE_TORCH_LOADS = textwrap.dedent("""
    import sys

    class CtrlC:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                raise KeyboardInterrupt

    sys.meta_path.insert(0, CtrlC())
    from polyaccel.asr.launch import run
    sys.argv = ["polyaccel-asr", "transcribe", "a.wav", "-o", "out.jsonl"]
    run()
""")


def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(tmp_path):
    done = subprocess.run([sys.executable, "-c", _CTRL_C_WHILE_TORCH_LOADS], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "polyaccel-asr: interrupted while starting; nothing was run or written\n"
    assert not (tmp_path / "out.jsonl").exists()


def test_the_command_runs_through_the_launcher(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['polyaccel-asr', '--help']; "
                           "from polyaccel.asr.launch import run; run()"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "transcribe" in done.stdout, done.stderr
