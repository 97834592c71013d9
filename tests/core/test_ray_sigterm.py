"""SIGTERM in a command that starts or joins a Ray cluster: ``ray.init`` replaced the handler of
``clitools.sigterm_as_interrupt`` with its own ``sys.exit``, so ``kill`` of ``polyaccel-moe finetune
--ray`` ended it with status 1 (or SIGABRT) and no line naming what a rerun resumes from, where
Ctrl-C printed it. The application's handler is put back after ``ray.init``; a SIGTERM that Ray's
``get`` hands on as a plain ``KeyboardInterrupt`` is still reported as a SIGTERM (143)."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from polyaccel.core import clitools, ray_local


def _fake_ray(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    def init(*args, **kwargs):  # as ray.init does (ray/_private/worker.py)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    fake = types.SimpleNamespace(init=init)
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_apply", lambda values: None)
    monkeypatch.setattr(ray_local, "local_cluster_env", lambda *a: {})
    monkeypatch.setattr(ray_local, "auth_env", lambda *a, **k: {})
    monkeypatch.setattr(ray_local, "_node_ports", lambda ray: {})
    return fake


@pytest.mark.parametrize("start", ["init_local", "connect"])
def test_sigterm_after_ray_init_is_the_application_s_interrupt(start, tmp_path, monkeypatch):
    _fake_ray(monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(KeyboardInterrupt) as raised, clitools.sigterm_as_interrupt():
            if start == "init_local":
                ray_local.init_local(1, _temp_dir=str(tmp_path / "t"))
            else:
                ray_local.connect("127.0.0.1:6379")
            os.kill(os.getpid(), signal.SIGTERM)
        assert clitools.interrupt_status(raised.value) == (143, "terminated")
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, (143, "terminated")), (signal.SIGHUP, (129, "hung up"))])
def test_a_plain_keyboard_interrupt_after_a_signal_is_that_signal_s(signum, status):
    """Ray's ``get`` raises KeyboardInterrupt for whatever a signal handler raised inside it; the
    status is still the signal's. SIGHUP (the terminal closed) is taken over only where it would
    end the process (SIG_DFL), and left as it was after the block. A later Ctrl-C is a Ctrl-C."""
    before = signal.signal(signum, signal.SIG_DFL)
    try:
        with pytest.raises(KeyboardInterrupt) as raised, clitools.sigterm_as_interrupt():
            try:
                os.kill(os.getpid(), signum)
            except clitools.Terminated:
                raise KeyboardInterrupt from None
        assert clitools.interrupt_status(raised.value) == status
        assert signal.getsignal(signum) is signal.SIG_DFL
        with pytest.raises(KeyboardInterrupt) as raised, clitools.sigterm_as_interrupt():
            raise KeyboardInterrupt  # Ctrl-C in a later block
        assert clitools.interrupt_status(raised.value) == (130, "interrupted")
    finally:
        signal.signal(signum, before)
