"""Which NKI runs a kernel: the real SDK (``import nki``) or :mod:`polyaccel.neuron.sim`.

Kernels are written once against module-level names ``nki``, ``nl`` and ``nisa`` and
declared with :func:`kernel`. ``kernel_fn.build(impl)`` rebinds those three names to one
implementation and applies that implementation's ``jit``, so the same source runs through
the real compiler/simulator or through our interpreter (tests parametrize over
:func:`available`). ``POLYACCEL_NKI=sim|nki`` picks the default; otherwise the real SDK is
used when it is installed (an installed one that fails to import is an error, not a fallback).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from polyaccel.neuron import sim

log = logging.getLogger(__name__)
IMPL_ENV = "POLYACCEL_NKI"
NKI_INSTALL_HINT = ("the Neuron SDK's NKI: pip install nki neuronx-cc "
                    "--extra-index-url https://pip.repos.neuron.amazonaws.com")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One NKI implementation: its top-level module, ``language`` and ``isa``."""

    name: str
    nki: Any
    nl: Any
    nisa: Any

    def simulate(self, kernel: Any) -> Callable[..., Any]:
        """The implementation's CPU simulation entry point for a jitted kernel."""
        return self.nki.simulate(kernel)


SIM = Impl("sim", sim, sim.language, sim.isa)


@functools.cache
def real_nki_importable() -> bool:
    """Whether the Neuron SDK's ``nki`` is installed. Not installed: False, with one logged
    warning (kernels then run on :mod:`polyaccel.neuron.sim`). An installed ``nki`` that fails
    to import raises its error; one without ``jit``/``simulate`` (not the SDK's) raises too."""
    try:
        mod = importlib.import_module("nki")
    except ModuleNotFoundError as e:
        if e.name != "nki":
            raise
        log.warning("the Neuron SDK's NKI is not installed: NKI kernels run on polyaccel's NumPy "
                    "interpreter; install %s", NKI_INSTALL_HINT)
        return False
    if not (hasattr(mod, "jit") and hasattr(mod, "simulate")):
        raise ImportError(f"the installed 'nki' ({getattr(mod, '__file__', None)}) is not the Neuron SDK's "
                          f"NKI (no nki.jit / nki.simulate); uninstall it or install {NKI_INSTALL_HINT}")
    return True


def get(name: str | None = None) -> Impl:
    """The implementation called ``name`` (``"sim"``, ``"nki"``, or ``None``/``"auto"``)."""
    name = name or os.environ.get(IMPL_ENV, "auto")
    if name == "sim" or (name == "auto" and not real_nki_importable()):
        return SIM
    if name in ("nki", "auto"):
        if not real_nki_importable():
            raise ImportError(f"the real NKI is not importable here; install {NKI_INSTALL_HINT}")
        nki = importlib.import_module("nki")
        return Impl("nki", nki, importlib.import_module("nki.language"), importlib.import_module("nki.isa"))
    raise ValueError(f"unknown NKI implementation {name!r}; use 'sim', 'nki' or 'auto'")


def available() -> list[str]:
    """Names of the implementations that can run here (the interpreter always can)."""
    return ["sim"] + (["nki"] if real_nki_importable() else [])


class Kernel:
    """An NKI kernel source, built lazily per implementation (see the module docstring)."""

    def __init__(self, fn: types.FunctionType) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._built: dict[str, Any] = {}
        self._op: Any = None

    def build(self, impl: Impl | str | None = None) -> Any:
        """The kernel jitted for ``impl`` (cached)."""
        impl = impl if isinstance(impl, Impl) else get(impl)
        if impl.name not in self._built:
            g = dict(self.fn.__globals__, nki=impl.nki, nl=impl.nl, nisa=impl.nisa)
            fn = types.FunctionType(self.fn.__code__, g, self.fn.__name__, self.fn.__defaults__,
                                    self.fn.__closure__)
            fn.__kwdefaults__ = self.fn.__kwdefaults__
            fn.__doc__, fn.__module__, fn.__qualname__ = self.fn.__doc__, self.fn.__module__, self.fn.__qualname__
            self._built[impl.name] = impl.nki.jit(fn)
        return self._built[impl.name]

    def __call__(self, *args: Any, impl: Impl | str | None = None) -> Any:
        """Run on tensors of the ``neuron`` device through TorchNeuron, anything else
        (NumPy arrays, CPU tensors) through ``impl``'s simulator."""
        if any(getattr(getattr(a, "device", None), "type", None) == "neuron" for a in args):
            require_lnc1(self.__name__)
            return self.torch_op()(*args)
        return self.simulate(*args, impl=impl)

    def torch_op(self) -> Any:
        """The real kernel as a torch custom op (``torch_neuronx.nki_op``), built on first use."""
        if self._op is None:
            try:
                import torch_neuronx
            except ImportError as e:
                raise ImportError(f"running NKI kernels on neuron tensors needs torch-neuronx and "
                                  f"{NKI_INSTALL_HINT}") from e
            self._op = torch_neuronx.nki_op(f"polyaccel::{self.__name__}", mutates_args=())(self.build("nki"))
        return self._op

    def simulate(self, *args: Any, impl: Impl | str | None = None) -> Any:
        """Run on CPU through ``impl``'s simulator (``nki.simulate`` or our interpreter)."""
        impl = impl if isinstance(impl, Impl) else get(impl)
        if impl is SIM:  # the interpreter takes CPU torch tensors as they are
            return impl.simulate(self.build(impl))(*args)
        torch_in = any(sim.is_torch(a) for a in args)
        out = impl.simulate(self.build(impl))(*(sim.torch_to_numpy(a) if sim.is_torch(a) else a for a in args))
        if not torch_in:
            return out
        if isinstance(out, tuple):
            return tuple(sim.numpy_to_torch(np.asarray(o)) for o in out)
        return sim.numpy_to_torch(np.asarray(out))


def require_lnc1(name: str) -> None:
    """Raise unless the runtime runs at LNC=1: polyaccel's kernels are LNC=1 kernels (no work
    split across the logical core's physical cores), called as ``kernel(...)``, i.e.
    ``kernel[1]``, and NKI requires the call's LNC to match NEURON_LOGICAL_NC_CONFIG."""
    from polyaccel.neuron.plugin import LNC_ENV, logical_nc_config

    lnc = logical_nc_config()
    if lnc != "1":
        setting = f"{LNC_ENV}={lnc}" if os.environ.get(LNC_ENV, "").strip() else \
            f"{LNC_ENV} is unset (the runtime's trn2 default is LNC={lnc})"
        raise RuntimeError(f"NKI kernel {name} is written for LNC=1 but {setting}: run at LNC=1 "
                           f"(polyaccel.neuron.runtime.configure_lnc1()) or use the reference op")


def kernel(fn: types.FunctionType) -> Kernel:
    """Declare an NKI kernel written against the module globals ``nki``, ``nl``, ``nisa``."""
    return Kernel(fn)
