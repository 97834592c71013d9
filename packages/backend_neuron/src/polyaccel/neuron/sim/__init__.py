"""A NumPy interpreter of the NKI subset polyaccel's kernels use, checking Trainium2 rules.

This module stands in for the top-level ``nki`` module (``jit``, ``simulate``, ``language``,
``isa``), so a kernel written against ``import nki`` runs here unchanged on any CPU::

    from polyaccel.neuron import sim as nki
    nl, nisa = nki.language, nki.isa

    @nki.jit
    def kernel(a): ...

    out = kernel(a_numpy)            # or kernel[1](...), or nki.simulate(kernel)(a_numpy)
    kernel.last_run.dma.hbm_to_sbuf  # bytes DMA'd in by that call

Rules enforced (violations raise :class:`NKIRuleError` naming the rule): at most 128
partitions on dim 0 of on-chip tiles and the start-partition rule; SBUF <= 212,728 B per
partition over live allocations; PSUM tiles within one 2 KiB bank, at most 8 live; matmul
K/M <= 128, N <= 512, inputs in SBUF, fp32 output in PSUM; no DMA out of (or into) PSUM;
compute engines never touch HBM; ``tensor_tensor`` never reads two PSUM tiles; kernel
outputs live in ``nl.shared_hbm``. Only LNC=1 kernels are interpreted.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from polyaccel.neuron.sim import isa, language
from polyaccel.neuron.sim.rules import NKIRuleError
from polyaccel.neuron.sim.tensor import DMAStats, NDArray, SimRun, check_dtype, set_run, shared_hbm

__all__ = ["DMAStats", "NKIRuleError", "SimKernel", "SimRun", "isa", "jit", "language", "simulate"]


class SimKernel:
    """An ``@nki.jit`` kernel run by the interpreter. ``kernel[lnc](...)`` picks the LNC.

    Arguments may be NumPy arrays or CPU torch tensors (outputs come back in the same kind);
    non-array arguments pass through as compile-time constants. ``last_run`` holds the
    :class:`SimRun` (DMA bytes, peak SBUF/PSUM use, instruction counts) of the latest call.
    """

    def __init__(self, fn: Callable[..., Any], lnc: int = 1) -> None:
        self.fn = fn
        self.lnc = lnc
        self.last_run: SimRun | None = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, lnc: int) -> SimKernel:
        bound = SimKernel(self.fn, lnc)
        bound._parent = self  # type: ignore[attr-defined]
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.lnc != 1:
            raise NotImplementedError(f"the NKI interpreter runs LNC=1 kernels only (asked for LNC={self.lnc})")
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        torch_out = False
        for name, value in bound.arguments.items():
            if isinstance(value, tuple):  # *args
                wrapped = [self._hbm_arg(v, f"{name}{i}") for i, v in enumerate(value)]
                bound.arguments[name] = tuple(w for w, _ in wrapped)
                torch_out |= any(t for _, t in wrapped)
            else:
                bound.arguments[name], was_torch = self._hbm_arg(value, name)
                torch_out |= was_torch
        run = SimRun(self.fn.__name__)
        set_run(run)
        try:
            result = self.fn(*bound.args, **bound.kwargs)
            outs = result if isinstance(result, tuple) else (result,)
            for i, out in enumerate(outs):
                if not isinstance(out, NDArray) or out.buffer is not shared_hbm:
                    raise NKIRuleError("output-buffer", (
                        f"{self.fn.__name__} returns {out!r} as output {i}; kernel outputs are "
                        f"allocated in nl.shared_hbm"))
            arrays = tuple(np.array(o.data) for o in outs)
        finally:
            set_run(None)
        self.last_run = run
        parent = getattr(self, "_parent", None)
        if parent is not None:
            parent.last_run = run
        if torch_out:
            arrays = tuple(numpy_to_torch(a) for a in arrays)
        return arrays if isinstance(result, tuple) else arrays[0]


    @staticmethod
    def _hbm_arg(value: Any, name: str) -> tuple[Any, bool]:
        """An argument as the kernel sees it: arrays become HBM tensors named after the parameter."""
        was_torch = is_torch(value)
        if was_torch:
            value = torch_to_numpy(value)
        if isinstance(value, np.ndarray):
            check_dtype(value.dtype, f"kernel argument {name!r}")
            value = NDArray(value, language.hbm, None, name)
        return value, was_torch


def jit(fn: Callable[..., Any] | None = None, **_options: Any) -> Any:
    """Decorate a top-level kernel (``@nki.jit`` or ``@nki.jit()``)."""
    if fn is None:
        return lambda f: SimKernel(f)
    return SimKernel(fn)


def simulate(kernel: SimKernel | Callable[..., Any]) -> Callable[..., Any]:
    """``nki.simulate(kernel)(*numpy_args)``: run ``kernel`` in the interpreter."""
    return kernel if isinstance(kernel, SimKernel) else SimKernel(kernel)


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray) -> Any:
    import torch

    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))
