"""Backend discovery, selection and the reasons an unavailable backend gives."""

import json

import pytest
import torch

from polyaccel.core import BackendUnavailable, backends, plugins, select_backend
from polyaccel.core.backend import Availability, Backend
from polyaccel.core.cli import main as cli_main
from polyaccel.core.hookspec import hookimpl


@pytest.fixture(autouse=True)
def _fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


def test_entry_point_backends_found_with_reasons():
    found = backends()
    assert {"cpu", "cuda", "neuron"} <= set(found)
    assert found["cpu"].availability().ok
    if not torch.cuda.is_available():
        a = found["cuda"].availability()
        assert not a.ok and a.reason and a.install_hint
    a = found["neuron"].availability()
    assert not a.ok and "torch-neuronx" in a.reason


def test_select_unavailable_backend_says_why_and_what_to_install():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(BackendUnavailable, match="not available here.*To use it"):
        select_backend("cuda")
    with pytest.raises(BackendUnavailable, match="torch-neuronx"):
        select_backend("neuron")


def test_select_unknown_backend():
    with pytest.raises(KeyError, match="unknown backend 'tpu'"):
        select_backend("tpu")


def test_auto_picks_best_available():
    b = select_backend("auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert b.name == expected


class _FakeBackend(Backend):
    name = "fake"
    device_type = "cpu"
    priority = 50

    def availability(self):
        return Availability.yes("always")


class _FakePlugin:
    calls: list[str] = []

    @hookimpl
    def polyaccel_add_backends(self):
        return [_FakeBackend()]

    @hookimpl
    def polyaccel_register_kernels(self, backend, registry):
        if backend.name == "fake":
            self.calls.append("registered")


def test_hand_registered_plugin_wins_auto_and_registers_kernels_once():
    plugins.plugin_manager().register(_FakePlugin())
    _FakePlugin.calls.clear()
    if torch.cuda.is_available():
        pytest.skip("cuda outranks the fake backend")
    assert select_backend("auto").name == "fake"
    select_backend("fake")
    assert _FakePlugin.calls == ["registered"]


def test_disable_autoload_keeps_only_cpu(monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    assert list(backends()) == ["cpu"]


def test_extra_plugins_env_registers_modules(monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(plugins.EXTRA_PLUGINS_ENV, "polyaccel.neuron.plugin")
    assert set(backends()) == {"cpu", "neuron"}


def test_broken_plugin_import_is_loud(monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(plugins.EXTRA_PLUGINS_ENV, "polyaccel.does_not_exist")
    with pytest.raises(plugins.PluginImportError, match="POLYACCEL_PLUGINS names 'polyaccel.does_not_exist'"):
        backends()


def test_a_typo_in_polyaccel_plugins_is_one_line_from_the_cli(monkeypatch, capsys):
    """The library raises (above); the ``polyaccel`` command said it with a 27-line traceback."""
    monkeypatch.setattr(plugins, "_pm", None)
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    monkeypatch.setenv(plugins.EXTRA_PLUGINS_ENV, "nope.mod")
    assert cli_main(["backends"]) == 1
    err = capsys.readouterr().err
    assert err == ("polyaccel: error: POLYACCEL_PLUGINS names 'nope.mod', which cannot be imported: "
                   "ModuleNotFoundError: No module named 'nope'\n"), err


def test_cli_backends_json(capsys):
    assert cli_main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cpu"]["available"] is True
    assert rows["neuron"]["available"] is False and rows["neuron"]["reason"]


def test_cli_kernels_and_doctor(capsys):
    assert cli_main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "grouped_mm" in out and "rms_norm" in out
    assert cli_main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "backend cpu" in out and "polyaccel.backends" in out


def test_cli_output_into_a_closed_pipe_is_no_traceback():
    import os
    import subprocess
    import sys

    env = {**os.environ, "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "polyaccel.core.cli", "kernels"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head -0`: the reader is gone before the table is printed
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, like a standard tool
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_cli_a_broken_pipe_other_than_stdout_is_an_error_not_141(capsys, monkeypatch):
    import errno

    from polyaccel.core import cli

    def broken(args):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")  # from some pipe the command wrote, not stdout

    monkeypatch.setattr(cli, "_kernels", broken)
    assert cli_main(["kernels"]) == 1
    err = capsys.readouterr().err
    assert err == "polyaccel: error: cannot write a pipe other than stdout: Broken pipe (its reader went away)\n"
