"""``nki.isa`` as the interpreter knows it: DMA, Tensor Engine and Vector/Scalar Engine
instructions, each checking the hardware rules before computing in NumPy.

Every instruction writes into ``dst`` (the current NKI convention) and computes in fp32;
the result is rounded to ``dst``'s dtype on write (bf16 through ``ml_dtypes``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from polyaccel.neuron.sim import rules
from polyaccel.neuron.sim.language import Op
from polyaccel.neuron.sim.rules import NKIRuleError
from polyaccel.neuron.sim.tensor import NDArray, current_run, psum, sbuf

__all__ = ["activation", "dma_copy", "memset", "nc_matmul", "nc_transpose", "scalar_tensor_tensor",
           "tensor_copy", "tensor_scalar", "tensor_tensor"]


class engine:  # noqa: N801 - mirrors nki.isa.engine
    """Engine selectors accepted (and, except for nc_transpose, ignored) by the interpreter."""

    unknown = "unknown"
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"


# ---- checks ---------------------------------------------------------------------------


def _on_chip(instr: str, **tiles: Any) -> None:
    for role, t in tiles.items():
        if not isinstance(t, NDArray):
            continue
        if not t.buffer.on_chip:
            raise NKIRuleError("engine-operand", (
                f"{instr}: {role} {t!r} is in {t.buffer}; compute engines read and write SBUF/PSUM "
                f"only (DMA it in first)"))
        n, start = t.shape[0], t.partition_start()
        ok = start == 0 if n > 64 else start in (0, 64) if n > 32 else start in (0, 32, 64, 96)
        if not ok:
            raise NKIRuleError("partition-start", (
                f"{instr}: {role} covers {n} partitions starting at {start}; a tile of >64 partitions "
                f"starts at 0, 33-64 at 0/64, <=32 at 0/32/64/96"))


def _write(instr: str, dst: NDArray, value: np.ndarray) -> None:
    if tuple(value.shape) != tuple(dst.shape):
        raise NKIRuleError("shape", f"{instr}: result shape {tuple(value.shape)} != dst shape {dst.shape}")
    dst.data[...] = value.astype(dst.dtype)
    if dst.buffer is psum:
        dst.written_mask()[...] = 1
    current_run().instructions[instr] += 1


def _f32(t: NDArray | float | int) -> np.ndarray | float:
    return t.data.astype(np.float32) if isinstance(t, NDArray) else float(t)


def _operand(instr: str, data: NDArray, operand: NDArray | float | int) -> np.ndarray | float:
    """A tensor_scalar operand: an fp32 scalar or a [P, 1] tile broadcast along the free dims."""
    if not isinstance(operand, NDArray):
        return float(operand)
    if operand.shape[0] != data.shape[0] or int(np.prod(operand.shape[1:])) != 1:
        raise NKIRuleError("shape", f"{instr}: a vector operand must be [{data.shape[0]}, 1], got {operand.shape}")
    return operand.data.astype(np.float32).reshape((data.shape[0],) + (1,) * (data.ndim - 1))


# ---- data movement ----------------------------------------------------------------------


def dma_copy(dst: NDArray, src: NDArray, **_: Any) -> None:
    """Copy ``src`` to ``dst`` with the DMA engines (HBM<->SBUF, SBUF<->SBUF, HBM<->HBM)."""
    if src.buffer is psum:
        raise NKIRuleError("dma-from-psum", (
            f"dma_copy reads {src!r} from PSUM; PSUM is never a DMA source: tensor_copy it to SBUF first"))
    if dst.buffer is psum:
        raise NKIRuleError("dma-to-psum", f"dma_copy writes {dst!r} in PSUM; DMA targets SBUF or HBM")
    if src.dtype != dst.dtype:
        raise NKIRuleError("dma-dtype", f"dma_copy {src.dtype} -> {dst.dtype}: DMA does not convert; use tensor_copy")
    if src.data.size != dst.data.size:
        raise NKIRuleError("shape", f"dma_copy moves {src.shape} into {dst.shape}: element counts differ")
    for t in (src, dst):
        if t.buffer.on_chip:
            _on_chip_partitions(t)
    dst.data[...] = src.data.reshape(dst.shape)
    run = current_run()
    nbytes = src.data.nbytes
    run.dma.transfers += 1
    if not src.buffer.on_chip and dst.buffer.on_chip:
        run.dma.hbm_to_sbuf += nbytes
        run.dma.loaded[src.name] += nbytes
    elif src.buffer.on_chip and not dst.buffer.on_chip:
        run.dma.sbuf_to_hbm += nbytes
        run.dma.stored[dst.name] += nbytes
    elif src.buffer.on_chip:
        run.dma.sbuf_to_sbuf += nbytes
    else:
        run.dma.hbm_to_hbm += nbytes
        run.dma.loaded[src.name] += nbytes
        run.dma.stored[dst.name] += nbytes
    run.instructions["dma_copy"] += 1


def _on_chip_partitions(t: NDArray) -> None:
    if t.shape and t.partition_start() + t.shape[0] > rules.NUM_PARTITIONS:
        raise NKIRuleError("partition-axis", f"{t!r} runs past partition {rules.NUM_PARTITIONS}")


def tensor_copy(dst: NDArray, src: NDArray, engine: Any = None, **_: Any) -> None:
    """Copy (and convert dtype, through fp32) between on-chip tiles; the way out of PSUM."""
    _on_chip("tensor_copy", dst=dst, src=src)
    _write("tensor_copy", dst, src.data.astype(np.float32))


def memset(dst: NDArray, value: float, **_: Any) -> None:
    """Fill an on-chip tile with ``value``."""
    _on_chip("memset", dst=dst)
    _write("memset", dst, np.full(dst.shape, value, np.float32))


# ---- Tensor Engine ------------------------------------------------------------------------


def nc_matmul(dst: NDArray, stationary: NDArray, moving: NDArray, accumulate: bool | None = None,
              **_: Any) -> None:
    """``dst = stationary.T @ moving`` on the 128x128 systolic array.

    stationary [K, M], moving [K, N...] in SBUF; dst [M, N...] fp32 in PSUM. K <= 128 (the
    partition axis of both), M <= 128, N <= 512. ``accumulate=None``: the first write to a
    PSUM element overwrites, later writes add; ``True`` always adds; ``False`` overwrites.
    """
    _on_chip("nc_matmul", dst=dst, stationary=stationary, moving=moving)
    for role, t in (("stationary", stationary), ("moving", moving)):
        if t.buffer is not sbuf:
            raise NKIRuleError("matmul-operand", f"nc_matmul: {role} {t!r} must be in SBUF")
    if dst.buffer is not psum:
        raise NKIRuleError("matmul-output", f"nc_matmul: dst {dst!r} must be in PSUM")
    if dst.dtype != np.float32:
        raise NKIRuleError("matmul-output", f"nc_matmul: dst must be fp32 (PSUM accumulates in fp32), got {dst.dtype}")
    K, M = stationary.shape[0], int(np.prod(stationary.shape[1:]))
    N = int(np.prod(moving.shape[1:]))
    if moving.shape[0] != K:
        raise NKIRuleError("shape", f"nc_matmul: K differs: stationary {stationary.shape}, moving {moving.shape}")
    if K > rules.MATMUL_MAX_K:
        raise NKIRuleError("matmul-k", f"nc_matmul: K={K} > {rules.MATMUL_MAX_K}")
    if M > rules.MATMUL_MAX_M:
        raise NKIRuleError("matmul-m", f"nc_matmul: stationary free size M={M} > {rules.MATMUL_MAX_M}")
    if N > rules.MATMUL_MAX_N:
        raise NKIRuleError("matmul-n", f"nc_matmul: moving free size N={N} > {rules.MATMUL_MAX_N}")
    if dst.shape[0] != M or int(np.prod(dst.shape[1:])) != N:
        raise NKIRuleError("shape", f"nc_matmul: dst {dst.shape} is not [M={M}, N={N}]")
    # einsum, not BLAS: no thread pool to oversubscribe, and the same result on every machine
    prod = np.einsum("km,kn->mn", stationary.data.astype(np.float32).reshape(K, M),
                     moving.data.astype(np.float32).reshape(K, N)).reshape(dst.shape)
    if accumulate is None:
        prod = np.where(dst.written_mask() != 0, dst.data + prod, prod)
    elif accumulate:
        prod = dst.data + prod
    _write("nc_matmul", dst, prod)


def nc_transpose(dst: NDArray, data: NDArray, engine: Any = None, **_: Any) -> None:
    """Transpose a 2-D tile: on the Tensor Engine (<=128x128, dst in PSUM) or the Vector
    Engine (<=32x32). The engine is the one asked for, else chosen by where dst lives."""
    _on_chip("nc_transpose", dst=dst, data=data)
    if data.ndim != 2:
        raise NKIRuleError("shape", f"nc_transpose: expects a 2-D tile, got {data.shape}")
    on_pe = engine == "tensor" or (engine in (None, "unknown") and dst.buffer is psum)
    limit = rules.PE_TRANSPOSE_MAX if on_pe else rules.VE_TRANSPOSE_MAX
    if max(data.shape) > limit:
        raise NKIRuleError("transpose-size", (
            f"nc_transpose of {data.shape} on the {'Tensor' if on_pe else 'Vector'} Engine; max {limit}x{limit}"))
    if on_pe and (data.buffer is not sbuf or dst.buffer is not psum):
        raise NKIRuleError("transpose-operand", "nc_transpose on the Tensor Engine reads SBUF and writes PSUM")
    _write("nc_transpose", dst, data.data.astype(np.float32).T)


# ---- Vector / Scalar Engines -----------------------------------------------------------------


def activation(dst: NDArray, op: Op, data: NDArray, bias: NDArray | None = None,
               scale: NDArray | float = 1.0, **_: Any) -> None:
    """``dst = op(data * scale + bias)`` on the Scalar Engine; bias is a [P, 1] tile."""
    _on_chip("activation", dst=dst, data=data, bias=bias, scale=scale)
    x = _f32(data) * _operand("activation", data, scale)
    if bias is not None:
        x = x + _operand("activation", data, bias)
    _write("activation", dst, np.asarray(op(np.asarray(x, np.float32)), np.float32))


def tensor_tensor(dst: NDArray, data1: NDArray, data2: NDArray, op: Op, **_: Any) -> None:
    """``dst = data1 <op> data2`` elementwise; the two inputs are never both in PSUM."""
    _on_chip("tensor_tensor", dst=dst, data1=data1, data2=data2)
    if data1.buffer is psum and data2.buffer is psum:
        raise NKIRuleError("tensor-tensor-psum", "tensor_tensor: data1 and data2 are both in PSUM")
    if data1.shape != data2.shape:
        raise NKIRuleError("shape", f"tensor_tensor: {data1.shape} vs {data2.shape}")
    _write("tensor_tensor", dst, np.asarray(op(_f32(data1), _f32(data2)), np.float32))


def tensor_scalar(dst: NDArray, data: NDArray, op0: Op, operand0: NDArray | float, reverse0: bool = False,
                  op1: Op | None = None, operand1: NDArray | float | None = None, reverse1: bool = False,
                  **_: Any) -> None:
    """``dst = (data <op0> operand0) <op1> operand1`` with scalar or [P, 1] operands broadcast
    along the free dims."""
    _on_chip("tensor_scalar", dst=dst, data=data, operand0=operand0, operand1=operand1)
    a = _operand("tensor_scalar", data, operand0)
    x = op0(a, _f32(data)) if reverse0 else op0(_f32(data), a)
    if op1 is not None:
        b = _operand("tensor_scalar", data, operand1)
        x = op1(b, x) if reverse1 else op1(x, b)
    _write("tensor_scalar", dst, np.asarray(x, np.float32))


def scalar_tensor_tensor(dst: NDArray, data: NDArray, op0: Op, operand0: NDArray | float, op1: Op,
                         operand1: NDArray, reverse0: bool = False, reverse1: bool = False,
                         **_: Any) -> None:
    """``dst = (data <op0> operand0) <op1> operand1``: a broadcast scalar op then an
    elementwise one in one Vector Engine instruction (a multiply-accumulate with op0=multiply,
    op1=add). data and operand1 are never both in PSUM."""
    _on_chip("scalar_tensor_tensor", dst=dst, data=data, operand0=operand0, operand1=operand1)
    if data.buffer is psum and operand1.buffer is psum:
        raise NKIRuleError("tensor-tensor-psum", "scalar_tensor_tensor: data and operand1 are both in PSUM")
    if data.shape != operand1.shape:
        raise NKIRuleError("shape", f"scalar_tensor_tensor: {data.shape} vs {operand1.shape}")
    a = _operand("scalar_tensor_tensor", data, operand0)
    x = op0(a, _f32(data)) if reverse0 else op0(_f32(data), a)
    x = op1(_f32(operand1), x) if reverse1 else op1(x, _f32(operand1))
    _write("scalar_tensor_tensor", dst, np.asarray(x, np.float32))
