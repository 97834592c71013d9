"""Small behaviours of ``polyaccel.core`` (kernel dispatch, command-line helpers) the other
tests left unpinned, found by hand mutation testing."""

from __future__ import annotations

import threading

import torch

from polyaccel.core import ops, registry


def _fake_rms_norm(calls: list[str]):  # noqa: ANN202
    def fake(x, w, eps=1e-6):  # noqa: ANN001
        calls.append(x.device.type)
        return ops.rms_norm.reference(x, w, eps)
    return fake


def test_a_call_with_only_keyword_tensors_dispatches_on_their_device() -> None:
    calls: list[str] = []
    registry.register("rms_norm", "meta", _fake_rms_norm(calls), impl="fake", backend="test")
    try:
        ops.rms_norm(x=torch.empty(2, 4, device="meta"), w=torch.empty(4, device="meta"))
        assert calls == ["meta"]
    finally:
        registry.unregister("rms_norm", "meta")


def test_reference_only_in_one_thread_leaves_the_others_on_their_kernels() -> None:
    """Replica threads share the registry: one thread checking against the references must not
    switch the others (serving real traffic) to the slow reference path."""
    calls: list[str] = []
    registry.register("rms_norm", "meta", _fake_rms_norm(calls), impl="fake", backend="test")
    inside, done = threading.Event(), threading.Event()

    def checker() -> None:
        with registry.reference_only():
            inside.set()
            done.wait(10)

    t = threading.Thread(target=checker)
    t.start()
    try:
        assert inside.wait(10)
        ops.rms_norm(torch.empty(2, 4, device="meta"), torch.empty(4, device="meta"))
        assert calls == ["meta"]
    finally:
        done.set()
        t.join()
        registry.unregister("rms_norm", "meta")


# ---- clitools: strict JSON, signal statuses, handlers put back -------------------------------------

def test_json_output_turns_every_non_finite_number_into_null_also_inside_tuples() -> None:
    import json
    import math

    from polyaccel.core.clitools import dumps

    text = dumps({"a": (1.0, math.inf), "b": [-math.inf, {"c": math.nan}], "d": 2})
    assert json.loads(text) == {"a": [1.0, None], "b": [None, {"c": None}], "d": 2}


def test_interrupt_status_names_the_signal() -> None:
    import signal

    from polyaccel.core import clitools

    assert clitools.interrupt_status(clitools.Terminated(signal.SIGTERM)) == (143, "terminated")
    assert clitools.interrupt_status(clitools.Terminated(signal.SIGHUP)) == (129, "hung up")


def test_a_signal_from_an_earlier_block_does_not_colour_a_later_ctrl_c(monkeypatch) -> None:  # noqa: ANN001
    """A SIGTERM seen in one command run (tests, a notebook) is forgotten when the next block
    starts: a plain Ctrl-C there is 130 "interrupted", not 143."""
    import signal

    from polyaccel.core import clitools

    monkeypatch.setattr(clitools, "_signal_seen", signal.SIGTERM)
    with clitools.sigterm_as_interrupt():
        pass
    assert clitools.interrupt_status(KeyboardInterrupt()) == (130, "interrupted")


def test_the_handlers_set_before_the_block_are_put_back_and_an_ignored_sighup_stays_ignored() -> None:
    """Under ``nohup`` SIGHUP is ignored: the block must not make a closed terminal end the
    run. The application's own SIGTERM handler is back after the block."""
    import signal

    from polyaccel.core import clitools

    def mine(signum, frame):  # noqa: ANN001
        pass

    old_term, old_hup = signal.signal(signal.SIGTERM, mine), signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with clitools.sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is clitools._terminate
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGHUP, old_hup)


def test_a_broken_pipe_naming_a_file_is_that_error_even_when_stdout_is_gone(monkeypatch, capsys) -> None:  # noqa: ANN001
    import errno

    from polyaccel.core import clitools

    monkeypatch.setattr(clitools, "stdout_broken", lambda: True)
    e = BrokenPipeError(errno.EPIPE, "Broken pipe", "/tmp/log.fifo")
    assert clitools.broken_pipe(e, "polyaccel-asr") == 1
    assert capsys.readouterr().err == "polyaccel-asr: error: cannot write /tmp/log.fifo: Broken pipe (its reader went away)\n"


def test_a_world_size_that_is_no_number_is_a_single_process(monkeypatch) -> None:  # noqa: ANN001
    from polyaccel.core import clitools

    monkeypatch.setenv("WORLD_SIZE", "many")
    assert clitools._world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert clitools._world_size() == 4


def test_rms_norm_of_an_all_zero_row_is_zeros_not_nan() -> None:
    """Padding rows are all zeros: without ``eps`` under the root they would become NaN and
    poison whatever reads them (a batch's loss, a max over the row)."""
    y = ops.rms_norm(torch.zeros(2, 8), torch.ones(8))
    assert torch.equal(y, torch.zeros(2, 8))
