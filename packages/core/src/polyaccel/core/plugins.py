"""Backend discovery through pluggy and the ``polyaccel.backends`` entry-point group.

Plugins are loaded on first use, not at import. A plugin that fails to import is an error
with its traceback (never a silent fallback). Set ``POLYACCEL_DISABLE_PLUGIN_AUTOLOAD=1`` to
load only the built-in CPU backend. ``POLYACCEL_PLUGINS=mod.a,mod.b`` registers plugin
modules by import path as well (like ``PYTEST_PLUGINS``): useful where the packages are on
``PYTHONPATH`` but not installed, so their entry points are not visible.
"""

from __future__ import annotations

import importlib
import os
import threading

import pluggy

from polyaccel.core import cpu, hookspec
from polyaccel.core.backend import Backend, BackendUnavailable

ENTRY_POINT_GROUP = "polyaccel.backends"
DISABLE_AUTOLOAD_ENV = "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD"
EXTRA_PLUGINS_ENV = "POLYACCEL_PLUGINS"

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_activated: set[str] = set()


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built (and entry points loaded) on first call."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("polyaccel")
            pm.add_hookspecs(hookspec)
            pm.register(cpu, name="cpu")
            if not os.environ.get(DISABLE_AUTOLOAD_ENV):
                pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            for modname in filter(None, os.environ.get(EXTRA_PLUGINS_ENV, "").split(",")):
                if pm.get_plugin(modname.strip()) is None and not pm.is_registered(
                        importlib.import_module(modname.strip())):
                    pm.register(importlib.import_module(modname.strip()), name=modname.strip())
            _pm = pm
        return _pm


def reset() -> None:
    """Forget loaded plugins and activations (tests use this)."""
    global _pm
    with _lock:
        _pm = None
        _activated.clear()


def backends() -> dict[str, Backend]:
    """All known backends by name, available or not, highest priority first."""
    found: list[Backend] = []
    for group in plugin_manager().hook.polyaccel_add_backends():
        found.extend(group)
    found.sort(key=lambda b: -b.priority)
    out: dict[str, Backend] = {}
    for b in found:
        if b.name in out:
            raise RuntimeError(f"two plugins supply a backend named {b.name!r}")
        out[b.name] = b
    return out


def select_backend(name: str | Backend = "auto") -> Backend:
    """Return a ready backend: ``"auto"`` (best available), or a name such as ``"cpu"``.

    Raises :class:`BackendUnavailable` naming the reason and what to install when the
    requested backend cannot run here, and ``KeyError`` for an unknown name.
    """
    if isinstance(name, Backend):
        return activate(name)
    known = backends()
    if name == "auto":
        candidates = [b for b in known.values() if b.availability().ok]
        picked = plugin_manager().hook.polyaccel_pick_auto(candidates=candidates)
        return activate(picked or candidates[0])
    if name not in known:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(known)}. "
                       f"Backends come from installed packages (e.g. pip install polyaccel-backend-{name}).")
    b = known[name]
    a = b.availability()
    if not a.ok:
        hint = f" To use it: {a.install_hint}" if a.install_hint else ""
        raise BackendUnavailable(f"backend {name!r} is not available here: {a.reason}.{hint}")
    return activate(b)


def activate(backend: Backend) -> Backend:
    """Register the backend's kernels once; return it."""
    from polyaccel.core.kernels import registry

    with _lock:
        if backend.name not in _activated:
            plugin_manager().hook.polyaccel_register_kernels(backend=backend, registry=registry)
            _activated.add(backend.name)
    return backend
