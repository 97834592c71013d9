"""NKI missing vs NKI broken: only "not installed" selects the NumPy interpreter, with one
logged warning; an installed ``nki`` that fails to import (or is not the SDK's) raises."""

from __future__ import annotations

import logging
import sys

import pytest

from polyaccel.neuron import nki_api


def _own_modules(name: str) -> dict:
    return {m: mod for m, mod in sys.modules.items() if m == name or m.startswith(name + ".")}


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.delenv(nki_api.IMPL_ENV, raising=False)
    """A fresh probe cache, and ``sys.modules['nki*']`` put back afterwards."""
    saved = _own_modules("nki")
    for name in saved:
        del sys.modules[name]
    clear = getattr(nki_api.real_nki_importable, "cache_clear", lambda: None)  # the probe is cached
    clear()
    yield
    clear()
    for name in _own_modules("nki"):
        del sys.modules[name]
    sys.modules.update(saved)


def _fake_nki(monkeypatch, tmp_path, init_source: str) -> None:
    """Make ``import nki`` find a package whose ``__init__`` runs ``init_source``."""
    (tmp_path / "nki").mkdir()
    (tmp_path / "nki" / "__init__.py").write_text(init_source)
    monkeypatch.syspath_prepend(str(tmp_path))


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name == nki_api.__name__]


def test_not_installed_selects_the_interpreter_with_one_warning(monkeypatch, caplog, fresh_probe):
    sys.modules["nki"] = None  # (the fixture restores it) import raises ModuleNotFoundError(name="nki")
    caplog.set_level(logging.WARNING)
    assert nki_api.get() is nki_api.SIM and nki_api.available() == ["sim"]
    assert nki_api.real_nki_importable() is False
    (record,) = _warnings(caplog)
    assert "NKI is not installed" in record.getMessage() and "neuronx-cc" in record.getMessage()
    with pytest.raises(ImportError, match="not importable here"):
        nki_api.get("nki")


@pytest.mark.parametrize("init_source, error, match", [
    ("raise ImportError('libnrt.so.1: cannot open shared object file')\n", ImportError, "libnrt.so.1"),
    ("import nki._compiler\n", ModuleNotFoundError, "nki._compiler"),  # inside an installed nki
    ("raise OSError('bad install')\n", OSError, "bad install"),
    ("", ImportError, "not the Neuron SDK's NKI"),  # a placeholder package without jit/simulate
])
def test_broken_install_raises(monkeypatch, tmp_path, caplog, fresh_probe, init_source, error, match):
    _fake_nki(monkeypatch, tmp_path, init_source)
    with pytest.raises(error, match=match):
        nki_api.get()
    with pytest.raises(error, match=match):
        nki_api.available()
    assert nki_api.get("sim") is nki_api.SIM  # asking for the interpreter by name still works
    assert _warnings(caplog) == []


def test_installed_sdk_is_picked_without_a_warning(monkeypatch, tmp_path, caplog, fresh_probe):
    _fake_nki(monkeypatch, tmp_path, "def jit(f):\n    return f\n\ndef simulate(k):\n    return k\n")
    for sub in ("language", "isa"):
        (tmp_path / "nki" / f"{sub}.py").write_text("")
    impl = nki_api.get()
    assert impl.name == "nki" and impl.nki is sys.modules["nki"] and nki_api.available() == ["sim", "nki"]
    assert _warnings(caplog) == []


def test_kernels_on_neuron_tensors_need_lnc1(monkeypatch):
    """The kernels are called as kernel(...) = kernel[1]; NKI needs the call's LNC to match
    NEURON_LOGICAL_NC_CONFIG, so at LNC=2 the call went to the compiler and failed there."""
    from types import SimpleNamespace

    from polyaccel.neuron.kernels.ffn import ffn_kernel

    on_neuron = SimpleNamespace(device=SimpleNamespace(type="neuron"))
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    with pytest.raises(RuntimeError, match="ffn_kernel is written for LNC=1 but NEURON_LOGICAL_NC_CONFIG=2"):
        ffn_kernel(on_neuron)
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    with pytest.raises(RuntimeError, match=r"NEURON_LOGICAL_NC_CONFIG is unset \(the runtime's trn2 default is LNC=2\)"):
        ffn_kernel(on_neuron)


def test_an_unset_lnc_is_trn2s_default_of_2(monkeypatch):
    """cores_per_chip() took an unset NEURON_LOGICAL_NC_CONFIG for LNC=1 (8 cores per chip);
    the runtime then exposed 4 and replicas 4..7 of a chip failed in nrt_load."""
    from polyaccel.neuron.plugin import NeuronBackend

    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert NeuronBackend().cores_per_chip() == 4
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert NeuronBackend().cores_per_chip() == 8
