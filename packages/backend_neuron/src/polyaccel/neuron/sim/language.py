"""``nki.language`` as the interpreter knows it: memory spaces, dtypes, operators, ``ndarray``,
``load``/``store`` and the tile-size constants.

Operators and activation functions are :class:`Op` objects wrapping a NumPy function that
works in fp32, as the engines do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from polyaccel.neuron.sim import rules
from polyaccel.neuron.sim.tensor import (
    NDArray,
    allocate,
    bfloat16,
    float16,
    float32,
    hbm,
    int8,
    int32,
    psum,
    sbuf,
    shared_hbm,
    uint8,
)

__all__ = ["Op", "add", "bfloat16", "copy", "float16", "float32", "gelu", "hbm", "identity", "int8",
           "int32", "load", "maximum", "multiply", "ndarray", "psum", "relu", "sbuf", "shared_hbm",
           "silu", "store", "subtract", "tile_size", "uint8", "zeros"]


class Op:
    """A named elementwise function (ALU operator or activation), evaluated in fp32."""

    def __init__(self, name: str, fn: Callable[..., np.ndarray]) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, *args: np.ndarray) -> np.ndarray:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(np.float32)


# ALU operators (tensor_tensor, tensor_scalar)
add = Op("add", np.add)
subtract = Op("subtract", np.subtract)
multiply = Op("multiply", np.multiply)
maximum = Op("maximum", np.maximum)
minimum = Op("minimum", np.minimum)

# activation functions (activation)
copy = Op("copy", lambda x: x)
identity = copy
relu = Op("relu", lambda x: np.maximum(x, 0.0))
silu = Op("silu", lambda x: x / (1.0 + np.exp(-x)))
gelu = Op("gelu", _gelu)
exp = Op("exp", np.exp)
tanh = Op("tanh", np.tanh)

tile_size = SimpleNamespace(
    pmax=rules.NUM_PARTITIONS,
    psum_fmax=rules.PSUM_BANK_BYTES // 4,
    gemm_stationary_fmax=rules.MATMUL_MAX_M,
    gemm_moving_fmax=rules.MATMUL_MAX_N,
)


def ndarray(shape: tuple[int, ...], dtype: Any, buffer: Any = sbuf, name: str = "") -> NDArray:
    """Allocate a tensor in ``buffer`` (``nl.sbuf`` by default)."""
    return allocate(shape, dtype, buffer, name)


def zeros(shape: tuple[int, ...], dtype: Any, buffer: Any = sbuf, name: str = "") -> NDArray:
    """Allocate a zero-filled tensor (every interpreter allocation starts zeroed)."""
    return allocate(shape, dtype, buffer, name)


def load(src: NDArray, dtype: Any = None) -> NDArray:
    """DMA an HBM tensor into a new SBUF tile of the same shape."""
    from polyaccel.neuron.sim import isa

    tile = allocate(src.shape, src.dtype, sbuf)
    isa.dma_copy(tile, src)
    if dtype is not None and np.dtype(dtype) != src.dtype:
        cast = allocate(src.shape, dtype, sbuf)
        isa.tensor_copy(cast, tile)
        return cast
    return tile


def store(dst: NDArray, value: NDArray) -> None:
    """DMA an SBUF tile into an HBM tensor."""
    from polyaccel.neuron.sim import isa

    isa.dma_copy(dst, value)
