"""Ctrl-C in ``polyaccel-moe finetune --ray``: Ray Train's SIGINT handler aborts the run, then its
``fit()`` raises ``SystemExit(1)`` (``SystemExit(0)`` at the third Ctrl-C). The CLI ended with
status 1 (or 0), without the line naming the checkpoint a rerun resumes from, and Ray's handler
stayed installed after the run. Now ``run_with_ray`` raises ``KeyboardInterrupt`` (exit 130 and
that line) and puts the driver's SIGINT handler back."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.train.torch import TorchTrainer  # noqa: E402

from polyaccel.moe.cli import main  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _rays_sigint_handler(self, controller):
    """Ray Train 2.60's handler, less the actor call: the abort ends the controller, whose
    ``ray.get`` then raises RayActorError and the handler calls ``sys.exit(0)``."""
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(0))


def _fit_interrupted(self):
    """``fit()`` as Ray Train runs it in the main thread: its handler is registered, the user's
    Ctrl-C arrives while it waits for the run."""
    self._register_sigint_handler(controller=None)
    signal.raise_signal(signal.SIGINT)
    raise AssertionError("the Ctrl-C did not stop fit()")


@pytest.mark.timeout(60)
def test_ctrl_c_during_a_ray_train_run_exits_130_naming_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a cluster is up: none is started
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(TorchTrainer, "_register_sigint_handler", _rays_sigint_handler)
    monkeypatch.setattr(TorchTrainer, "fit", _fit_interrupted)
    before = signal.getsignal(signal.SIGINT)
    code = main(["finetune", str(TINY), "--ray", "--workers", "2", "--set", f"checkpoint.dir={tmp_path}/ck",
                 "--set", f"output_dir={tmp_path}/out"])
    err = capsys.readouterr().err
    assert code == 130, err
    assert err.startswith("polyaccel-moe: interrupted; ") and err.count("\n") == 1, err
    assert signal.getsignal(signal.SIGINT) is before  # Ray's handler is not left behind
