"""Lazy Triton: kernels are defined on first use, so importing this backend never imports Triton."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[[], Any])
log = logging.getLogger(__name__)

TRITON_HINT = "Triton (pip install triton; it ships with CUDA builds of PyTorch on Linux)"


def _not_installed(e: ModuleNotFoundError, module: str) -> bool:
    """Whether ``e`` says ``module`` itself is absent (not a module an installed one imports)."""
    return e.name == module


def require_triton() -> Any:
    """Import and return ``triton``; not installed: raise naming what to install. An installed
    Triton that fails to import raises its own error."""
    try:
        import triton
    except ModuleNotFoundError as e:
        if not _not_installed(e, "triton"):
            raise
        raise ImportError(f"polyaccel's CUDA kernels need {TRITON_HINT}") from e
    return triton


def triton_kernels(build: F) -> F:
    """Decorate a function that defines ``@triton.jit`` kernels: build them once, on first call."""

    @functools.cache
    def cached() -> Any:
        require_triton()
        return build()

    return cached  # type: ignore[return-value]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grid sizes."""
    return -(-a // b)


@functools.cache
def has_triton() -> bool:
    """Whether Triton is installed. Not installed: False, with one logged warning (the CUDA
    ops then run core's torch references). Any other import failure raises."""
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as e:
        if not _not_installed(e, "triton"):
            raise
        log.warning("Triton is not installed: the cuda backend's ops run core's torch references; "
                    "install %s", TRITON_HINT)
        return False
    return True


def use_triton(t: Any) -> bool:
    """Run the Triton kernel for tensor ``t``: on CUDA, or anywhere under ``TRITON_INTERPRET=1``
    (Triton's CPU interpreter, which lets the kernels be checked on a machine with no GPU).
    Without Triton installed the ops fall back to torch math (:func:`has_triton` warns once)."""
    return (t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") and has_triton()


def num_sms(device: Any) -> int:
    """Streaming multiprocessors on ``device`` (a small number off CUDA, for the interpreter)."""
    return _num_sms(device.type, device.index)


@functools.cache
def _num_sms(device_type: str, index: int | None) -> int:
    import torch

    if device_type != "cuda":
        return 2
    return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count


DEPENDENT_LAUNCH = os.environ.get("POLYACCEL_CUDA_PDL", "1") != "0"
"""Whether the decoder step's kernels start early, beside the kernel before them (programmatic
dependent launch: each waits, before touching memory, until that one has finished). On: on an
H200, Whisper large-v3-turbo's shape at batch 1 and 16 ran 1.4% and 1.7% faster with it (even
at 128; docs/benchmarks.md). ``POLYACCEL_CUDA_PDL=0`` turns it off."""


def dependent_launch(device: Any) -> dict:
    """The launch arguments of a kernel with a ``PDL`` flag (see :data:`DEPENDENT_LAUNCH`):
    ``PDL`` and ``launch_pdl`` on a Hopper or newer GPU whose Triton has griddepcontrol;
    nothing otherwise (the kernel's ``PDL`` defaults to off)."""
    if not (DEPENDENT_LAUNCH and device.type == "cuda" and _dependent_launch_capable(device.index)):
        return {}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def _dependent_launch_capable(index: int | None) -> bool:
    import torch

    from polyaccel.cuda import _fused_decode_triton

    return _fused_decode_triton.HAS_PDL and torch.cuda.get_device_capability(index or 0)[0] >= 9
