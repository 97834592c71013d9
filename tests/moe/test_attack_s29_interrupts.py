"""Attack pass, session 29: Ctrl-C in the seconds ``polyaccel-moe`` spends loading torch.

Importing the package loaded torch (``polyaccel.moe`` imported its model classes, the CLI
``polyaccel.core``) before the CLI's Ctrl-C handler existed: a Ctrl-C then (10-20 s on a busy
machine) printed a traceback through torch's import machinery and the process died of SIGINT.
Now importing the CLI loads no torch, and ``run()`` catches a Ctrl-C while torch loads: one
line, exit 130.
"""

from __future__ import annotations

import subprocess
import sys


def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(tmp_path, ctrl_c_while_torch_loads):
    done = ctrl_c_while_torch_loads("polyaccel.moe.cli:run", ["polyaccel-moe", "finetune", "run.yaml"], tmp_path)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "polyaccel-moe: interrupted while starting; nothing was run or saved\n"


def test_importing_the_cli_and_the_package_loads_no_torch():
    code = ("import sys, polyaccel.moe, polyaccel.moe.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


def test_the_package_still_exports_its_classes():
    import polyaccel.moe as moe
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, FlatAdamW
    from polyaccel.moe.auto import AutoModelForCausalLM as auto_class

    assert AutoModelForCausalLM is auto_class and moe.BackendConfig is BackendConfig
    assert FlatAdamW.__name__ == "FlatAdamW" and moe.GraphedMicroStep.__name__ == "GraphedMicroStep"
    assert sorted(moe.__all__) == sorted(["AutoModelForCausalLM", "BackendConfig", "FlatAdamW", "GraphedMicroStep",
                                          "Trainer", "fast_trainer_class"])
