"""Backend selection, the kernel registry, the ``polyaccel`` command, the graph cache and the
backend/plan data: guarantees the other tests in ``tests/core`` left unpinned, found by
mutation testing (each test fails when one line of core's source is broken)."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from polyaccel.core import (
    GraphCache,
    GraphSpec,
    ParallelPlan,
    ShapeBuckets,
    ops,
    plugins,
    registry,
    select_backend,
)
from polyaccel.core.backend import Availability, Backend
from polyaccel.core.cli import main as cli_main
from polyaccel.core.clitools import dumps
from polyaccel.core.cpu import CpuBackend
from polyaccel.core.hookspec import hookimpl


@pytest.fixture(autouse=True)
def _fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


class _Fake(Backend):
    name = "fake"
    device_type = "cpu"
    priority = 50

    def availability(self):
        return Availability.yes("always")


class _Ghost(Backend):
    """A backend that cannot run here (like cuda on a CPU-only machine), with devices it would drive."""

    name = "ghost"
    device_type = "cpu"
    priority = 60

    def availability(self):
        return Availability.no("no ghost device here", "pip install ghost-sdk")

    def device_count(self):
        return 4


class _Plugin:
    def __init__(self, *backends: Backend, pick: str | None = None) -> None:
        self.backends, self.pick, self.registered = list(backends), pick, []

    @hookimpl
    def polyaccel_add_backends(self):
        return self.backends

    @hookimpl
    def polyaccel_register_kernels(self, backend, registry):
        self.registered.append(backend.name)


class _Picker(_Plugin):
    @hookimpl
    def polyaccel_pick_auto(self, candidates):
        return next((b for b in candidates if b.name == self.pick), None)


# ---- backend selection ------------------------------------------------------------------------

def test_a_plugin_s_pick_auto_hook_decides_auto():
    """``polyaccel_pick_auto`` (first non-None answer) overrides the priority order; with no
    answer the highest-priority available backend wins."""
    plugins.plugin_manager().register(_Picker(_Fake(), pick="cpu"))
    assert select_backend("auto").name == "cpu"
    plugins.reset()
    plugins.plugin_manager().register(_Picker(_Fake(), pick="nothing-like-this"))
    if not torch.cuda.is_available():
        assert select_backend("auto").name == "fake"


def test_two_plugins_supplying_one_backend_name_is_an_error():
    """A second plugin claiming an existing backend name is refused loudly, never one of
    the two picked silently."""
    plugins.plugin_manager().register(_Plugin(_Fake()))
    plugins.plugin_manager().register(_Plugin(_Fake()))
    with pytest.raises(RuntimeError, match="two plugins supply a backend named 'fake'"):
        plugins.backends()


def test_polyaccel_plugins_naming_an_installed_plugin_registers_it_once(monkeypatch):
    """``POLYACCEL_PLUGINS`` naming a module its entry point already loaded (or naming one
    twice, with blanks) is no error and registers it once."""
    monkeypatch.delenv(plugins.DISABLE_AUTOLOAD_ENV, raising=False)
    monkeypatch.setenv(plugins.EXTRA_PLUGINS_ENV, "polyaccel.neuron.plugin, polyaccel.neuron.plugin,")
    assert sorted(plugins.backends()) == ["cpu", "cuda", "neuron"]


def test_only_available_backends_are_activated_by_polyaccel_kernels(capsys):
    """``polyaccel kernels`` registers the kernels of the backends that can run here only: a
    backend's ``polyaccel_register_kernels`` may assume its SDK and device are present."""
    plugin = _Plugin(_Fake(), _Ghost())
    plugins.plugin_manager().register(plugin)
    assert cli_main(["kernels"]) == 0
    capsys.readouterr()
    assert "fake" in plugin.registered and "ghost" not in plugin.registered


# ---- the kernel registry ----------------------------------------------------------------------

def test_nested_reference_only_blocks_restore_the_outer_block():
    """Leaving an inner ``reference_only()`` block keeps the outer one in force."""
    calls = []
    before = registry.implementations("rms_norm").get("cpu")
    registry.register("rms_norm", "cpu", lambda x, w, eps=1e-6: calls.append("fast"), impl="fake", backend="test")
    x, w = torch.randn(2, 4), torch.ones(4)  # (meta tensors would cost seconds on first use)
    try:
        with registry.reference_only():
            with registry.reference_only():
                ops.rms_norm(x, w)
            ops.rms_norm(x, w)
        assert calls == []
        ops.rms_norm(x, w)
        assert calls == ["fast"]
    finally:
        registry.unregister("rms_norm", "cpu")
        if before is not None:
            registry.register("rms_norm", "cpu", before.fn, impl=before.impl, backend=before.backend)


# ---- the polyaccel command ----------------------------------------------------------------------

def test_doctor_exits_1_when_the_cpu_backend_is_unusable(capsys, monkeypatch):
    """``polyaccel doctor`` says so in its exit status when the CPU reference cannot run."""
    monkeypatch.setattr(CpuBackend, "availability", lambda self: Availability.no("torch is broken"))
    assert cli_main(["doctor"]) == 1
    assert "backend cpu     NO  torch is broken" in capsys.readouterr().out


def test_backends_table_names_what_to_install_for_an_unavailable_backend(capsys):
    """The table's detail column gives an unavailable backend's install hint (and none for
    an available one), and reports no devices for it."""
    plugins.plugin_manager().register(_Plugin(_Ghost()))
    assert cli_main(["backends"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["ghost"].split()[1:3] == ["no", "0"]
    assert rows["ghost"].endswith("no ghost device here (install: pip install ghost-sdk)")
    assert "(install:" not in rows["cpu"] and rows["cpu"].split()[1] == "yes"
    assert cli_main(["backends", "--json"]) == 0
    ghost = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == "ghost")
    assert ghost["devices"] == 0 and ghost["install_hint"] == "pip install ghost-sdk"


def test_polyaccel_without_a_command_is_a_usage_error(capsys):
    """``polyaccel`` alone exits 2 with argparse's usage message, not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main([])
    assert exit_info.value.code == 2
    assert "required: cmd" in capsys.readouterr().err


def test_json_output_is_strict_json():
    """``dumps`` (all ``--json`` output) writes NaN and infinities as ``null``, also nested."""
    text = dumps({"loss": math.nan, "rows": [math.inf, (1.5, -math.inf)], "n": 3})
    assert json.loads(text) == {"loss": None, "rows": [None, [1.5, None]], "n": 3}
    assert "NaN" not in text and "Infinity" not in text


# ---- backend data ----------------------------------------------------------------------------------

def test_default_replicas_and_replica_devices():
    """``default_replicas()`` is at least ``replicas_per_device`` even with no device seen,
    and ``replica_devices`` deals replicas round-robin over the devices."""
    class TwoGpus(Backend):
        device_type = "cuda"
        replicas_per_device = 2

        def device_count(self):
            return 2

    class NoDevice(TwoGpus):
        def device_count(self):
            return 0

    assert TwoGpus().default_replicas() == 4 and NoDevice().default_replicas() == 2
    assert [str(d) for d in TwoGpus().replica_devices(5)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert [str(d) for d in CpuBackend().replica_devices(3)] == ["cpu"] * 3


def test_parallel_plan_refuses_booleans():
    """``ParallelPlan(dp=True)`` is a mistake, not one rank."""
    with pytest.raises(ValueError, match="positive integer, got True"):
        ParallelPlan(dp=True)


# ---- the graph cache ----------------------------------------------------------------------------------

def test_two_threads_asking_for_one_new_graph_compile_it_once():
    """Replica threads sharing a cache: a thread that asks for a graph another thread is
    compiling waits for it instead of compiling (capturing) it again."""
    compiled: list[str] = []
    entered, second_waits = threading.Event(), threading.Event()

    class Slow(CpuBackend):
        def compile_graph(self, fn, example_inputs, *, name="graph"):
            compiled.append(name)
            entered.set()
            second_waits.wait(5)
            return fn

    class WatchedLock:
        """The cache's lock, noting when a second thread arrives at it."""

        def __init__(self) -> None:
            self.lock, self.arrivals = threading.Lock(), 0

        def __enter__(self):
            self.arrivals += 1
            if self.arrivals == 2:
                second_waits.set()
            self.lock.acquire()

        def __exit__(self, *exc):
            self.lock.release()

    spec = GraphSpec("double", lambda x: x * 2, ShapeBuckets({"batch": (4,)}), lambda b: [torch.zeros(4)])
    cache = GraphCache(Slow(), [spec])
    cache._lock = WatchedLock()
    got: list = []
    first = threading.Thread(target=lambda: got.append(cache.get("double", {"batch": 4})))
    first.start()
    assert entered.wait(5)
    second = threading.Thread(target=lambda: got.append(cache.get("double", {"batch": 4})))
    second.start()
    first.join(5)
    second.join(5)
    assert len(got) == 2 and got[0] is got[1]
    assert compiled == ["double{'batch': 4}"] and len(cache) == 1
