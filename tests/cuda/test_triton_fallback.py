"""Triton missing vs Triton broken: only "not installed" falls back (to core's references),
with one logged warning; an installed Triton that fails to import raises its own error."""

from __future__ import annotations

import logging
import sys

import pytest

from polyaccel.cuda import _triton, kernels


def _own_modules(name: str) -> dict:
    return {m: mod for m, mod in sys.modules.items() if m == name or m.startswith(name + ".")}


@pytest.fixture
def fresh_probe():
    """A fresh ``has_triton`` cache, and ``sys.modules['triton*']`` put back afterwards."""
    saved = _own_modules("triton")
    for name in saved:
        del sys.modules[name]
    _triton.has_triton.cache_clear()
    yield
    _triton.has_triton.cache_clear()
    for name in _own_modules("triton"):
        del sys.modules[name]
    sys.modules.update(saved)


def _fake_triton(monkeypatch, tmp_path, init_source: str) -> None:
    """Make ``import triton`` find a package whose ``__init__`` runs ``init_source``."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(init_source)
    monkeypatch.syspath_prepend(str(tmp_path))


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and r.name == _triton.__name__]


def test_not_installed_falls_back_with_one_warning(monkeypatch, caplog, fresh_probe):
    sys.modules["triton"] = None  # (the fixture restores it) import raises ModuleNotFoundError(name="triton")
    caplog.set_level(logging.WARNING)
    assert _triton.has_triton() is False
    assert _triton.has_triton() is False
    (record,) = _warnings(caplog)
    assert "Triton is not installed" in record.getMessage() and "pip install triton" in record.getMessage()
    with pytest.raises(ImportError, match="need Triton"):
        _triton.require_triton()

    seen = {}

    class Recorder:
        def register(self, op, device_type, fn, *, impl, backend=""):
            seen[op] = impl

    kernels.register_all(Recorder())  # the cuda backend registers no Triton kernel
    assert "triton" not in seen.values() and seen["attention"] == "sdpa"
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("init_source, error, match", [
    ("raise ImportError('libcuda.so.1: cannot open shared object file')\n", ImportError, "libcuda.so.1"),
    ("import triton._C\n", ModuleNotFoundError, "triton._C"),  # a module inside an installed Triton
    ("raise RuntimeError('bad driver')\n", RuntimeError, "bad driver"),
])
def test_broken_install_raises(monkeypatch, tmp_path, caplog, fresh_probe, init_source, error, match):
    _fake_triton(monkeypatch, tmp_path, init_source)
    with pytest.raises(error, match=match) as e:
        _triton.has_triton()
    assert "need Triton" not in str(e.value)
    with pytest.raises(error, match=match):
        _triton.require_triton()
    assert _warnings(caplog) == []


def test_installed_triton_is_used_without_a_warning(monkeypatch, tmp_path, caplog, fresh_probe):
    _fake_triton(monkeypatch, tmp_path, "")
    assert _triton.has_triton() is True and _triton.require_triton() is sys.modules["triton"]
    assert _warnings(caplog) == []
