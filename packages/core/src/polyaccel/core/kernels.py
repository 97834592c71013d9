"""Named kernel ops: a plain-PyTorch reference for each, plus per-device implementations.

Every op is a Python function in :mod:`polyaccel.core.ops` whose body is the reference.
Backends register faster implementations per torch device type with
``registry.register("rms_norm", "cuda", fn, impl="triton")`` (from their
``polyaccel_register_kernels`` hook). A call dispatches on the device of its first tensor
argument: a registered implementation if there is one, else the reference.

Why not ``torch.library.custom_op`` for the references? A custom op is opaque to autograd
and Inductor, so each reference would need a hand-written backward and would block fusion;
plain functions get both for free and ``torch.compile`` traces straight through the
dispatch. Backends wrap their own kernels as ``torch.library`` ops (with ``register_fake``
and ``register_autograd``) so they compose with ``torch.compile`` and pass ``opcheck``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@dataclasses.dataclass(slots=True)
class KernelImpl:
    """One implementation of an op for one device type."""

    op: str
    device_type: str
    fn: Callable[..., Any]
    impl: str
    backend: str


class KernelRegistry:
    """What implements what: op name -> device type -> implementation."""

    def __init__(self) -> None:
        self._refs: dict[str, Callable[..., Any]] = {}
        self._impls: dict[str, dict[str, KernelImpl]] = {}
        self._local = threading.local()

    # -- definition ------------------------------------------------------------------
    def define(self, fn: F) -> F:
        """Declare ``fn`` as a named op whose body is the reference implementation."""
        name = fn.__name__
        self._refs[name] = fn
        self._impls.setdefault(name, {})

        @functools.wraps(fn)
        def dispatch(*args: Any, **kwargs: Any) -> Any:
            impls = self._impls[name]
            if impls and not getattr(self._local, "reference_only", False):
                device_type = _first_device_type(args, kwargs)
                k = impls.get(device_type)
                if k is not None:
                    return k.fn(*args, **kwargs)
            return fn(*args, **kwargs)

        dispatch.reference = fn  # type: ignore[attr-defined]
        return dispatch  # type: ignore[return-value]

    def register(self, op: str, device_type: str, fn: Callable[..., Any], *, impl: str,
                 backend: str = "") -> None:
        """Make ``fn`` the implementation of ``op`` for tensors on ``device_type``."""
        if op not in self._refs:
            raise KeyError(f"unknown op {op!r}; known ops: {', '.join(sorted(self._refs))}")
        self._impls[op][device_type] = KernelImpl(op, device_type, fn, impl, backend)

    def unregister(self, op: str, device_type: str) -> None:
        self._impls[op].pop(device_type, None)

    # -- queries -----------------------------------------------------------------------
    def ops(self) -> list[str]:
        return sorted(self._refs)

    def reference(self, op: str) -> Callable[..., Any]:
        return self._refs[op]

    def implementations(self, op: str) -> dict[str, KernelImpl]:
        return dict(self._impls[op])

    def table(self) -> list[dict[str, str]]:
        """One row per op: the reference plus every registered device implementation."""
        rows = []
        for op in self.ops():
            impls = {d: f"{k.impl} ({k.backend})" for d, k in sorted(self._impls[op].items())}
            rows.append({"op": op, "reference": "torch", **impls})
        return rows

    @contextlib.contextmanager
    def reference_only(self) -> Iterator[None]:
        """Within this block (this thread), every op runs its reference implementation."""
        prev = getattr(self._local, "reference_only", False)
        self._local.reference_only = True
        try:
            yield
        finally:
            self._local.reference_only = prev


def _first_device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            a = a[0]  # (an op taking one tensor per micro-batch)
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


registry = KernelRegistry()
