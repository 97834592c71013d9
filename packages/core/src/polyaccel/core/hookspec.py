"""Hook specifications for polyaccel plugins.

A backend package exposes a module through the entry-point group ``polyaccel.backends``;
that module implements some of the hooks below with ``@hookimpl``. Core calls the hooks;
backends never patch core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from polyaccel.core.backend import Backend
    from polyaccel.core.kernels import KernelRegistry

hookspec = pluggy.HookspecMarker("polyaccel")
hookimpl = pluggy.HookimplMarker("polyaccel")


# -------------------------------------------------------------------------
# Discovery: called once when the plugin manager is first built.
# -------------------------------------------------------------------------


@hookspec
def polyaccel_add_backends() -> list[Backend]:
    """Return the backends this plugin supplies.

    Must be cheap: no heavy imports, no device probing. A backend that cannot run on this
    machine is still returned; it reports why through :meth:`Backend.availability`.
    """


# -------------------------------------------------------------------------
# Activation: called when a backend is selected for use.
# -------------------------------------------------------------------------


@hookspec
def polyaccel_register_kernels(backend: Backend, registry: KernelRegistry) -> None:
    """Register kernel implementations for ``backend`` in ``registry``.

    :param backend: the backend being activated (already known to be available).
    :param registry: the kernel registry; call ``registry.register(op, device_type, fn)``.

    Called at most once per backend per process, the first time it is selected.
    """


@hookspec(firstresult=True)
def polyaccel_pick_auto(candidates: list[Backend]) -> Backend | None:
    """Choose the backend that ``select_backend("auto")`` returns.

    :param candidates: the available backends, best priority first.

    First non-``None`` result wins; when no plugin answers, core takes the first candidate.
    """
