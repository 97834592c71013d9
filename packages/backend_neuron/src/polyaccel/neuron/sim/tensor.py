"""Tensors of the interpreter: where they live (HBM, SBUF, PSUM) and what they cost.

An :class:`NDArray` is a NumPy view plus its memory space. Slicing gives views in the same
space. On-chip allocations are charged to the running kernel's :class:`SimRun` while they
are reachable from Python (a tile rebound in a loop body is freed when its last view goes),
which is how the interpreter checks the SBUF and PSUM budgets across live allocations.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import defaultdict
from typing import Any

import ml_dtypes
import numpy as np

from polyaccel.neuron.sim.rules import (
    NUM_PARTITIONS,
    PSUM_BANK_BYTES,
    PSUM_BANKS,
    SBUF_BYTES_PER_PARTITION,
    NKIRuleError,
)


class Buffer:
    """A memory space: ``sbuf`` and ``psum`` are on chip, ``hbm``/``shared_hbm`` off chip."""

    def __init__(self, name: str, on_chip: bool) -> None:
        self.name = name
        self.on_chip = on_chip

    def __repr__(self) -> str:
        return f"nl.{self.name}"


sbuf = Buffer("sbuf", True)
psum = Buffer("psum", True)
hbm = Buffer("hbm", False)
shared_hbm = Buffer("shared_hbm", False)

float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
int32 = np.dtype(np.int32)
int8 = np.dtype(np.int8)
uint8 = np.dtype(np.uint8)

NKI_DTYPES = frozenset(np.dtype(t) for t in (
    np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
    np.int32, np.int16, np.int8, np.uint32, np.uint16, np.uint8, np.bool_))
"""Element types a NeuronCore engine handles; nothing 64-bit (no float64, int64)."""


def check_dtype(dtype: np.dtype, what: str) -> None:
    """Raise the ``dtype`` rule unless ``dtype`` is one NKI tensors can have."""
    if np.dtype(dtype) not in NKI_DTYPES:
        raise NKIRuleError("dtype", f"{what} has dtype {np.dtype(dtype)}, which NKI does not support "
                                    f"(no 64-bit types on a NeuronCore: cast to float32/int32 first)")


@dataclasses.dataclass
class DMAStats:
    """Bytes moved by DMA in one kernel call, by direction and by HBM tensor name."""

    hbm_to_sbuf: int = 0
    sbuf_to_hbm: int = 0
    sbuf_to_sbuf: int = 0
    hbm_to_hbm: int = 0
    transfers: int = 0
    loaded: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    stored: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    def bytes_from(self, name: str) -> int:
        """Bytes read from the HBM tensor ``name`` (a kernel argument) during the call."""
        return self.loaded.get(name, 0)


class SimRun:
    """Book-keeping for one kernel call: live on-chip bytes, peaks, DMA and instruction counts."""

    def __init__(self, kernel_name: str) -> None:
        self.kernel_name = kernel_name
        self.dma = DMAStats()
        self.sbuf_bytes = 0  # per partition, live
        self.psum_banks = 0  # live
        self.peak_sbuf_bytes = 0
        self.peak_psum_banks = 0
        self.instructions: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def charge(self, buffer: Buffer, per_partition: int, shape: tuple[int, ...]) -> Allocation:
        with self._lock:
            if buffer is sbuf:
                if self.sbuf_bytes + per_partition > SBUF_BYTES_PER_PARTITION:
                    raise NKIRuleError("sbuf-capacity", (
                        f"allocating {shape} needs {per_partition} B per partition with "
                        f"{self.sbuf_bytes} B live; SBUF holds {SBUF_BYTES_PER_PARTITION} B per partition"))
                self.sbuf_bytes += per_partition
                self.peak_sbuf_bytes = max(self.peak_sbuf_bytes, self.sbuf_bytes)
            else:
                if per_partition > PSUM_BANK_BYTES:
                    raise NKIRuleError("psum-bank", (
                        f"PSUM tile {shape} needs {per_partition} B per partition; a PSUM tile sits "
                        f"in one {PSUM_BANK_BYTES} B bank (512 fp32)"))
                if self.psum_banks + 1 > PSUM_BANKS:
                    raise NKIRuleError("psum-capacity", (
                        f"a PSUM tile {shape} would be the {self.psum_banks + 1}th live one; "
                        f"PSUM has {PSUM_BANKS} banks per partition"))
                self.psum_banks += 1
                self.peak_psum_banks = max(self.peak_psum_banks, self.psum_banks)
        alloc = Allocation(buffer, per_partition)
        weakref.finalize(alloc, self._release, buffer, per_partition)
        return alloc

    def _release(self, buffer: Buffer, per_partition: int) -> None:
        with self._lock:
            if buffer is sbuf:
                self.sbuf_bytes -= per_partition
            else:
                self.psum_banks -= 1


class Allocation:
    """One on-chip allocation (kept alive by its views); PSUM ones remember written elements."""

    def __init__(self, buffer: Buffer, per_partition: int) -> None:
        self.buffer = buffer
        self.per_partition = per_partition
        self.base: np.ndarray | None = None
        self.written: np.ndarray | None = None  # PSUM only: same shape/itemsize as base


_state = threading.local()


def current_run() -> SimRun:
    """The kernel call running on this thread (tiles only exist inside a kernel)."""
    run = getattr(_state, "run", None)
    if run is None:
        raise NKIRuleError("outside-kernel", "on-chip tensors exist only inside an @nki.jit kernel call")
    return run


def set_run(run: SimRun | None) -> None:
    _state.run = run


class NDArray:
    """A tensor in one memory space: ``data`` is a NumPy view, dim 0 is the partition axis on chip."""

    __slots__ = ("data", "buffer", "alloc", "name", "__weakref__")

    def __init__(self, data: np.ndarray, buffer: Buffer, alloc: Allocation | None = None,
                 name: str = "") -> None:
        self.data = data
        self.buffer = buffer
        self.alloc = alloc
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, index: Any) -> NDArray:
        idx = index if isinstance(index, tuple) else (index,)
        if self.buffer.on_chip and idx and not isinstance(idx[0], slice):
            raise NKIRuleError("partition-axis", "index the partition axis (dim 0) of a tile with a slice")
        if self.buffer.on_chip and idx and idx[0].step not in (None, 1):
            raise NKIRuleError("partition-axis", (
                f"partition slice {idx[0]!r}: a tile covers a contiguous range of partitions (step 1); "
                f"stride along a free dim instead"))
        if any(not isinstance(i, (slice, int, type(Ellipsis))) for i in idx):
            raise NKIRuleError("access-pattern", f"only basic slicing is supported, got {index!r}")
        return NDArray(self.data[index], self.buffer, self.alloc, self.name)

    def reshape(self, shape: tuple[int, ...]) -> NDArray:
        """A reshaped view of an HBM tensor (DMA access patterns may regroup dims)."""
        if self.buffer.on_chip:
            raise NKIRuleError("access-pattern", "reshape a tile's free dims by slicing, not reshape")
        return NDArray(self.data.reshape(shape), self.buffer, self.alloc, self.name)

    def partition_start(self) -> int:
        """The first partition this view covers (0 for off-chip tensors)."""
        if self.alloc is None or self.alloc.base is None:
            return 0
        base = self.alloc.base
        offset = self.data.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        return offset // base.strides[0]

    def written_mask(self) -> np.ndarray:
        """For a PSUM view: the matching view of its allocation's written-element mask."""
        assert self.alloc is not None and self.alloc.base is not None and self.alloc.written is not None
        offset = self.data.__array_interface__["data"][0] - self.alloc.base.__array_interface__["data"][0]
        return np.ndarray(self.shape, dtype=self.alloc.written.dtype, buffer=self.alloc.written,
                          offset=offset, strides=self.data.strides)

    def __repr__(self) -> str:
        return f"NDArray({self.name or '?'}, {self.shape}, {self.dtype}, {self.buffer})"


def allocate(shape: tuple[int, ...], dtype: Any, buffer: Buffer, name: str = "") -> NDArray:
    """Allocate a zero-filled tensor; on-chip tiles are checked against the partition and
    capacity rules and charged to the running kernel."""
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    check_dtype(dtype, f"{buffer} tensor {name or shape}")
    if buffer.on_chip:
        if len(shape) < 2:
            raise NKIRuleError("partition-axis", f"an on-chip tile needs a partition and a free dim, got {shape}")
        if not 0 < shape[0] <= NUM_PARTITIONS:
            raise NKIRuleError("partition-axis", (
                f"tile {shape} has {shape[0]} partitions; dim 0 (the partition axis) holds at most "
                f"{NUM_PARTITIONS}"))
        if len(shape) > 5:
            raise NKIRuleError("access-pattern", f"tile {shape} has more than 4 free dims")
        per_partition = int(np.prod(shape[1:])) * dtype.itemsize
        alloc = current_run().charge(buffer, per_partition, shape)
        data = np.zeros(shape, dtype)
        alloc.base = data
        if buffer is psum:
            alloc.written = np.zeros(shape, np.dtype(f"u{dtype.itemsize}"))
        return NDArray(data, buffer, alloc, name)
    return NDArray(np.zeros(shape, dtype), buffer, None, name)
