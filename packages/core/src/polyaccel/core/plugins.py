"""Backend discovery through pluggy and the ``polyaccel.backends`` entry-point group.

Plugins are loaded on first use, not at import. An entry point whose plugin fails to load
(a stale or half-installed package) never takes the other backends down: it is skipped with
a warning, listed by ``backends()`` as an unavailable backend whose reason names the error,
and selecting it by name raises :class:`BackendUnavailable` with that reason (never a silent
fallback). A module named in ``POLYACCEL_PLUGINS`` that fails to import raises. Set ``POLYACCEL_DISABLE_PLUGIN_AUTOLOAD=1`` to
load only the built-in CPU backend. ``POLYACCEL_PLUGINS=mod.a,mod.b`` registers plugin
modules by import path as well (like ``PYTEST_PLUGINS``): useful where the packages are on
``PYTHONPATH`` but not installed, so their entry points are not visible.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import types
from collections.abc import Iterable

import pluggy

from polyaccel.core import cpu, hookspec
from polyaccel.core.backend import Availability, Backend, BackendUnavailable

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "polyaccel.backends"
DISABLE_AUTOLOAD_ENV = "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD"
EXTRA_PLUGINS_ENV = "POLYACCEL_PLUGINS"

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_activated: set[str] = set()
_broken: dict[str, str] = {}  # entry-point name -> why its plugin could not be loaded


class BrokenPlugin(Backend):
    """Stands in for an entry point whose plugin failed to load: listed, never available."""

    priority = -1

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self._reason = reason

    def availability(self) -> Availability:
        return Availability.no(self._reason)

    def device_count(self) -> int:
        return 0


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built (and entry points loaded) on first call."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("polyaccel")
            pm.add_hookspecs(hookspec)
            pm.register(cpu, name="cpu")
            if not os.environ.get(DISABLE_AUTOLOAD_ENV):
                _load_entry_points(pm)
            for modname in filter(None, (m.strip() for m in os.environ.get(EXTRA_PLUGINS_ENV, "").split(","))):
                module = _import_named_plugin(modname)
                if pm.get_plugin(modname) is None and not pm.is_registered(module):
                    pm.register(module, name=modname)
            _pm = pm
        return _pm


class PluginImportError(ImportError):
    """A module named in :data:`EXTRA_PLUGINS_ENV` cannot be imported (a typo, a missing
    dependency): the message names the variable, the module and the cause."""


def _import_named_plugin(modname: str) -> types.ModuleType:
    try:
        return importlib.import_module(modname)
    except ImportError as e:
        raise PluginImportError(f"{EXTRA_PLUGINS_ENV} names {modname!r}, which cannot be imported: "
                                f"{type(e).__name__}: {e}", name=e.name) from e


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Register the plugin of every entry point in :data:`ENTRY_POINT_GROUP` (the first of a
    name wins); one that fails to load or register is recorded in ``_broken`` and warned
    about, so that it cannot take the other backends down."""
    import importlib.metadata as md

    for dist in list(md.distributions()):
        for ep in dist.entry_points:
            if ep.group != ENTRY_POINT_GROUP or pm.has_plugin(ep.name) or pm.is_blocked(ep.name) \
                    or ep.name in _broken:  # (a package visible twice: one warning)
                continue
            try:
                pm.register(ep.load(), name=ep.name)
            except Exception as e:  # noqa: BLE001 - reported through the backend it stands for
                why = (f"its plugin {ep.value} (package {dist.metadata['Name']}) failed to load: "
                       f"{type(e).__name__}: {e}")
                _broken[ep.name] = why
                log.warning("backend plugin %r skipped: %s", ep.name, why)
                log.debug("backend plugin %r failed to load", ep.name, exc_info=True)


def broken_plugins() -> dict[str, str]:
    """Entry-point name -> why its plugin could not be loaded (empty when all loaded)."""
    plugin_manager()
    return dict(_broken)


def reset() -> None:
    """Forget loaded plugins and activations (tests use this)."""
    global _pm
    with _lock:
        _pm = None
        _activated.clear()
        _broken.clear()


def backends() -> dict[str, Backend]:
    """All known backends by name, available or not, highest priority first (a plugin that
    failed to load last, as a :class:`BrokenPlugin`)."""
    found = _supplied_backends(plugin_manager())
    found.sort(key=lambda b: -b.priority)
    out: dict[str, Backend] = {}
    for b in found:
        if b.name in out:
            raise RuntimeError(f"two plugins supply a backend named {b.name!r}")
        out[b.name] = b
    for name, why in dict(_broken).items():
        out.setdefault(name, BrokenPlugin(name, why))
    return out


def _supplied_backends(pm: pluggy.PluginManager) -> list[Backend]:
    """Every plugin's ``polyaccel_add_backends``, each called on its own: one that raises (a
    driver library missing at construction) is recorded as broken, the others still count."""
    found: list[Backend] = []
    for impl in reversed(pm.hook.polyaccel_add_backends.get_hookimpls()):  # the order pluggy calls them in
        try:
            found.extend(impl.function())
        except Exception as e:  # noqa: BLE001 - reported through the backend it stands for
            why = f"its plugin's polyaccel_add_backends failed: {type(e).__name__}: {e}"
            with _lock:
                new = impl.plugin_name not in _broken
                _broken.setdefault(impl.plugin_name, why)
            if new:
                log.warning("backend plugin %r skipped: %s", impl.plugin_name, why)
    return found


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
        raise KeyError(unknown_backend_message(name, known))
    b = known[name]
    a = b.availability()
    if not a.ok:
        hint = f" To use it: {a.install_hint}" if a.install_hint else ""
        raise BackendUnavailable(f"backend {name!r} is not available here: {a.reason}.{hint}")
    return activate(b)


BACKEND_ALIASES = {
    "gpu": "cuda", "nvidia": "cuda", "cu": "cuda", "h100": "cuda", "h200": "cuda", "a100": "cuda",
    "trainium": "neuron", "trainium2": "neuron", "trn": "neuron", "trn1": "neuron", "trn2": "neuron",
    "inferentia": "neuron", "inf2": "neuron", "aws": "neuron", "nki": "neuron", "neuronx": "neuron",
    "host": "cpu", "torch": "cpu",
}
"""Other names people use for a backend (``--backend gpu``): the did-you-mean of an unknown name."""


def unknown_backend_message(name: str, known: Iterable[str]) -> str:
    """The error for a backend ``name`` that no installed plugin supplies: the known names, a
    did-you-mean (a common alias such as ``gpu`` -> ``cuda``, or a close spelling), and where
    backends come from. It names no package to install: a guessed name could be anyone's on
    PyPI."""
    import difflib

    known = list(known)
    key = str(name).strip().lower()
    guess = key if key in known else BACKEND_ALIASES.get(key)
    if guess is None:
        close = (difflib.get_close_matches(key, known, n=1, cutoff=0.7)  # cdua, nuron; not tpu -> cpu
                 or difflib.get_close_matches(key, list(BACKEND_ALIASES), n=1, cutoff=0.8))  # gpus, trainum
        guess = BACKEND_ALIASES.get(close[0], close[0]) if close else None
    hint = ""
    if guess is not None:
        hint = f" (did you mean {guess!r}?" + ("" if guess in known else "; it is not installed here") + ")"
    return (f"unknown backend {name!r}{hint}; known: {', '.join(known)} (or 'auto'). Backends come from "
            "installed plugins of the polyaccel.backends entry-point group; `polyaccel backends` lists them "
            "and says what each needs.")


def activate(backend: Backend) -> Backend:
    """Register the backend's kernels once; return it."""
    from polyaccel.core.kernels import registry

    with _lock:
        if backend.name not in _activated:
            plugin_manager().hook.polyaccel_register_kernels(backend=backend, registry=registry)
            _activated.add(backend.name)
    return backend
