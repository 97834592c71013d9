"""A backend plugin whose entry point fails to load (a stale or half-installed package) never
takes the other backends down: it is listed as unavailable with the error as its reason,
selecting it names that error, and ``polyaccel doctor`` reports it (exit 1)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from polyaccel.core import BackendUnavailable, backends, plugins, select_backend
from polyaccel.core.backend import Availability, Backend
from polyaccel.core.cli import main as cli_main


@pytest.fixture(autouse=True)
def _fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def broken_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution (a ``.dist-info`` on ``sys.path``) with two entry points in the
    backend group: one names a module that does not exist, one a module that raises on import."""
    info = tmp_path / "brokenpkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[polyaccel.backends]\nghost = polyaccel_s29_no_such_module.plugin\nboom = polyaccel_s29_boom\n")
    twice = tmp_path / "brokenpkg-0.0.dist-info"  # the same package visible twice (an older copy)
    twice.mkdir()
    (twice / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenpkg\nVersion: 0.0\n")
    (twice / "entry_points.txt").write_text("[polyaccel.backends]\nghost = polyaccel_s29_no_such_module.plugin\n")
    (tmp_path / "polyaccel_s29_boom.py").write_text("raise RuntimeError('driver library is missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.delenv(plugins.EXTRA_PLUGINS_ENV, raising=False)
    return tmp_path


def test_a_broken_entry_point_leaves_the_other_backends_usable(broken_dist: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=plugins.__name__):
        found = backends()
    assert {"cpu", "cuda", "neuron", "ghost", "boom"} <= set(found)
    assert select_backend("cpu").name == "cpu"
    ghost, boom = found["ghost"].availability(), found["boom"].availability()
    assert not ghost.ok and "ModuleNotFoundError" in ghost.reason and "brokenpkg" in ghost.reason
    assert not boom.ok and "RuntimeError: driver library is missing" in boom.reason
    assert select_backend("auto").name not in ("ghost", "boom")
    warned = [r.getMessage() for r in caplog.records]
    assert sum("'ghost' skipped" in m for m in warned) == 1 and sum("'boom' skipped" in m for m in warned) == 1


def test_selecting_a_broken_backend_names_its_load_error(broken_dist: Path) -> None:
    with pytest.raises(BackendUnavailable, match=r"'boom' is not available here: its plugin polyaccel_s29_boom "
                                                 r"\(package brokenpkg\) failed to load: RuntimeError"):
        select_backend("boom")


def test_cli_lists_a_broken_plugin_and_doctor_fails_on_it(broken_dist: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "cpu      yes" in out and "ghost" in out and "failed to load" in out
    assert cli_main(["doctor"]) == 1
    assert "backend boom    NO  its plugin polyaccel_s29_boom" in capsys.readouterr().out


class _RaisingPlugin:
    from polyaccel.core.hookspec import hookimpl

    @hookimpl
    def polyaccel_add_backends(self):  # noqa: ANN201
        raise OSError("libfoo.so: cannot open shared object file")


def test_a_plugin_whose_add_backends_raises_leaves_the_others_usable(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    plugins.plugin_manager().register(_RaisingPlugin(), name="foo")
    with caplog.at_level(logging.WARNING, logger=plugins.__name__):
        found = backends()
        backends()
    assert select_backend("cpu").name == "cpu" and select_backend("auto").name == "cpu"
    assert not found["foo"].availability().ok and "OSError: libfoo.so" in found["foo"].availability().reason
    assert sum("'foo' skipped" in r.getMessage() for r in caplog.records) == 1


class _LowBackend(Backend):
    name = "low"
    priority = -5

    def availability(self) -> Availability:
        return Availability.yes("always")


class _LowPlugin:
    from polyaccel.core.hookspec import hookimpl

    @hookimpl
    def polyaccel_add_backends(self):  # noqa: ANN201
        return [_LowBackend()]


def test_auto_takes_the_highest_priority_not_the_last_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends are ordered by priority, whatever order the plugins answer in (pluggy calls
    the last registered first)."""
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    plugins.plugin_manager().register(_LowPlugin(), name="low")
    assert list(backends()) == ["cpu", "low"]
    assert select_backend("auto").name == "cpu"


def test_a_backend_object_is_selected_as_itself_even_when_no_plugin_supplies_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Transcriber(backend=<Backend>)``: the caller's own backend object is used as is."""
    monkeypatch.setenv(plugins.DISABLE_AUTOLOAD_ENV, "1")
    mine = _LowBackend()
    assert select_backend(mine) is mine
