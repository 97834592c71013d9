"""Data-parallel NEFF execution: one :class:`NeuronModel` per (graph, NeuronCore), one
:class:`NeuronReplica` per core, and a ``replica_factory`` for core's ``ReplicaPool``.

At LNC=1 a Trainium2 chip exposes 8 NeuronCores; replica ``i`` is bound to core index
``first_core + i``, so 8 replicas (worker threads) per chip run side by side. Core indices are
libnrt's: they count from the first core visible to the process (NEURON_RT_VISIBLE_CORES=8-15
makes absolute core 8 index 0), and there are never more replicas than visible cores unless
sharing is asked for. Each replica
owns its model handles, device tensors and tensor sets (libnrt does not promise thread
safety for shared tensor sets) and calls ``nrt_execute`` with the GIL released.
"""

from __future__ import annotations

import ctypes
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyaccel.neuron import nrt

CORES_PER_CHIP_LNC1 = 8


def configure_lnc1(num_cores: int = CORES_PER_CHIP_LNC1, first_core: int = 0) -> dict[str, str]:
    """Set the runtime environment for LNC=1 replicas on cores ``first_core..+num_cores-1``.

    Must run before ``nrt_init`` (i.e. before the first model loads): with a runtime already
    started on other settings it raises ``RuntimeError`` instead of changing what libnrt would
    no longer read. Returns what it set. libnrt then numbers those cores 0..num_cores-1:
    replicas use indices, not ``first_core``.
    """
    env = {"NEURON_LOGICAL_NC_CONFIG": "1",
           "NEURON_RT_VISIBLE_CORES": f"{first_core}-{first_core + num_cores - 1}"}
    for lib in nrt.started_runtimes():
        lib.check_env(env)
    os.environ.update(env)
    return env


class NeuronModel:
    """One NEFF loaded on one NeuronCore with its own input/output tensors and tensor sets.

    ``core`` is libnrt's index among the cores visible to the process (0 = the first of
    NEURON_RT_VISIBLE_CORES), not an absolute core id.

    Tensors are bound by the names in the NEFF's tensor table (``input0..``, ``output0..``
    for TorchNeuron graphs), allocated once on the model's core and reused every call. Calls
    on one model take turns (they share its tensors); ``close()`` waits for a running call,
    and a call after ``close()`` is refused instead of reaching freed handles.
    """

    def __init__(self, neff: bytes | str | Path, core: int, lib: nrt.Libnrt | None = None) -> None:
        self.lib = lib or nrt.load()
        self.core = core
        self._lock = threading.Lock()
        self._closed = False
        self._tensors: list[ctypes.c_void_p] = []
        self._sets: list[ctypes.c_void_p] = []
        self._model = ctypes.c_void_p()
        data = neff if isinstance(neff, bytes) else read_neff(neff)
        self.lib.init()
        self._model = self.lib.load(data, core)
        self.lib.register(self)
        try:
            self.infos = self.lib.tensor_info(self._model, f"core {core}")
            for info in self.infos:
                info.check()
            self.inputs = [i for i in self.infos if i.is_input]
            self.outputs = [i for i in self.infos if not i.is_input]
            self._in_set, self._in_handles = self._tensor_set(self.inputs)
            self._out_set, self._out_handles = self._tensor_set(self.outputs)
        except BaseException as e:
            self._close_after_failure(e)  # a half-built model must not stay loaded on its core
            raise

    def _close_after_failure(self, error: BaseException) -> None:
        """Release what setup made; a failure here is noted on ``error``, never raised over it."""
        try:
            self.close()
        except Exception as cleanup:  # noqa: BLE001 - the setup error is the one to report
            error.add_note(f"while releasing the half-built model on core {self.core}: {cleanup}")

    def _tensor_set(self, infos: Sequence[nrt.TensorInfo]) -> tuple[ctypes.c_void_p, list[ctypes.c_void_p]]:
        """Allocate one device tensor per entry on this core and bind them by name in a new set.
        Every handle libnrt returned is recorded before the next call, so a failure part-way
        leaves nothing that ``close()`` does not free."""
        lib, where = self.lib.lib, f"core {self.core}"
        tset = ctypes.c_void_p()
        self.lib.check("nrt_allocate_tensor_set", lib.nrt_allocate_tensor_set(ctypes.byref(tset)), where)
        self._sets.append(tset)
        handles = []
        for info in infos:
            t = ctypes.c_void_p()
            self.lib.check("nrt_tensor_allocate", lib.nrt_tensor_allocate(
                nrt.PLACEMENT_DEVICE, self.core, info.size, info.name.encode(), ctypes.byref(t)),
                f"{where}, tensor {info.name}, {info.size} bytes")
            self._tensors.append(t)
            handles.append(t)
            self.lib.check("nrt_add_tensor_to_tensor_set",
                           lib.nrt_add_tensor_to_tensor_set(tset, info.name.encode(), t), f"{where}, tensor {info.name}")
        return tset, handles

    @property
    def closed(self) -> bool:
        return self._closed

    def execute(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
        """Write ``inputs`` (arrays by position or by tensor name), run, read the outputs."""
        if isinstance(inputs, Mapping):
            missing = [i.name for i in self.inputs if i.name not in inputs]
            if missing:
                raise KeyError(f"missing inputs {missing}; the NEFF takes {[i.name for i in self.inputs]}")
            inputs = [inputs[i.name] for i in self.inputs]
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the NEFF takes {len(self.inputs)} inputs, got {len(inputs)}")
        arrays = [_input_array(info, value) for info, value in zip(self.inputs, inputs)]
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the model on NeuronCore {self.core} is closed; load it again to run it")
            return self._run(arrays)

    def _run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Write, ``nrt_execute``, read; the caller holds the model's lock."""
        lib, where = self.lib.lib, f"core {self.core}"
        for info, handle, arr in zip(self.inputs, self._in_handles, arrays):
            self.lib.check("nrt_tensor_write", lib.nrt_tensor_write(handle, arr.ctypes.data, 0, arr.nbytes),
                           f"{where}, input {info.name}")
        self.lib.check("nrt_execute", lib.nrt_execute(self._model, self._in_set, self._out_set), where)
        outs = []
        for info, handle in zip(self.outputs, self._out_handles):
            out = np.empty(info.shape, info.dtype) if info.shape else np.empty(info.size // info.dtype.itemsize,
                                                                                info.dtype)
            self.lib.check("nrt_tensor_read", lib.nrt_tensor_read(handle, out.ctypes.data, 0, out.nbytes),
                           f"{where}, output {info.name}")
            outs.append(out)
        return outs

    __call__ = execute

    def close(self) -> None:
        """Free tensor sets and tensors and unload the model, after a running ``execute``
        finishes. Idempotent; every handle is released even when one release fails (the first
        failure is raised afterwards)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.lib.unregister(self)
            self._release()

    def _release(self) -> None:
        lib = self.lib.lib
        sets, tensors, model = self._sets, self._tensors, self._model
        self._sets, self._tensors, self._model = [], [], ctypes.c_void_p()
        for tset in sets:
            if tset:
                lib.nrt_destroy_tensor_set(ctypes.byref(tset))
        for t in tensors:
            if t:
                lib.nrt_tensor_free(ctypes.byref(t))
        if model:
            self.lib.check("nrt_unload", lib.nrt_unload(model), f"core {self.core}")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001,S110 - interpreter shutdown
            pass


class NeuronReplica:
    """Every graph of one model copy, loaded on one NeuronCore (``core``).

    ``process(batch)`` is what ``ReplicaPool`` calls: by default each item is the input list
    of the only graph; pass ``process`` to run a pipeline (e.g. encoder then decoder steps).
    If one graph fails to load, the graphs already loaded are closed before the error goes on.
    """

    def __init__(self, neffs: Mapping[str, bytes | str | Path], core: int, lib: nrt.Libnrt | None = None,
                 process: Callable[[NeuronReplica, list[Any]], Sequence[Any]] | None = None) -> None:
        self.core = core
        self.models: dict[str, NeuronModel] = {}
        self._process = process
        try:
            for name, neff in neffs.items():
                self.models[name] = NeuronModel(neff, core, lib)
        except BaseException as e:
            try:
                self.close()
            except Exception as cleanup:  # noqa: BLE001 - the load error is the one to report
                e.add_note(f"while closing the graphs already loaded on core {core}: {cleanup}")
            raise

    def execute(self, graph: str, inputs: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
        return self.models[graph].execute(inputs)

    def process(self, batch: list[Any]) -> Sequence[Any]:
        """Run ``batch``. A libnrt status that leaves the core in doubt (timeout, hardware
        error: :data:`nrt.CORE_FAILURES`) raises ``ReplicaDied``, so the pool rebuilds this
        replica and runs the items elsewhere instead of retrying them on the same core."""
        try:
            return self._run_batch(batch)
        except nrt.NrtError as e:
            if e.code in nrt.CORE_FAILURES:
                from polyaccel.core.runtime.results import ReplicaDied

                raise ReplicaDied(f"NeuronCore {self.core}: {e}") from e
            raise

    def _run_batch(self, batch: list[Any]) -> Sequence[Any]:
        if self._process is not None:
            return self._process(self, batch)
        if len(self.models) != 1:
            raise TypeError("a replica with several graphs needs a process(replica, batch) function")
        (model,) = self.models.values()
        return [model.execute(item) for item in batch]

    def close(self) -> None:
        """Close every graph's model; the first failure is raised after all were tried."""
        errors = []
        for m in self.models.values():
            try:
                m.close()
            except Exception as e:  # noqa: BLE001 - close the others first
                errors.append(e)
        if errors:
            raise errors[0]


def replica_factory(neffs: Mapping[str, bytes | str | Path], *, first_core: int = 0,
                    lib_path: str | None = None,
                    process: Callable[[NeuronReplica, list[Any]], Sequence[Any]] | None = None,
                    share_cores: bool = False) -> Callable[[int], NeuronReplica]:
    """``factory(i)`` for ``ReplicaPool``: replica ``i`` loads ``neffs`` on core index
    ``first_core + i``, counted from the first core visible to the process (what ``nrt_load``
    takes). A replica beyond the visible cores is refused unless ``share_cores`` (round-robin).

    NEFF files are read once here and shared (as bytes) by all replicas. Set
    NEURON_RT_VISIBLE_CORES (``configure_lnc1``) before calling this.
    """
    from polyaccel.neuron.plugin import core_index, visible_core_count

    visible = visible_core_count()
    env = nrt.runtime_env()  # what ``visible`` was computed from; the runtime must have started with it
    core_index(0, visible, first=first_core)  # a bad first_core fails here, not in a worker
    blobs = {k: v if isinstance(v, bytes) else read_neff(v) for k, v in neffs.items()}
    lock = threading.Lock()

    def factory(index: int) -> NeuronReplica:
        core = core_index(index, visible, first=first_core, share=share_cores)
        lib = nrt.load(lib_path)
        with lock:  # nrt_init once, before the first load
            lib.init()
        lib.check_env(env)
        return NeuronReplica(blobs, core, lib, process)

    return factory


def read_neff(path: str | Path) -> bytes:
    """The bytes of the NEFF file at ``path``, read once (libnrt gets the bytes, never the path).

    Refused with a clear error: anything but a regular file (a FIFO or device would block or
    never end), an empty file, one that changed size while read, and one that a user other
    than you or root owns or that group or others may write (they could swap the program the
    NeuronCore runs). The checks apply to the file actually opened, not to a name.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"NEFF {path} is not a regular file")
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise PermissionError(f"refusing NEFF {path}: owned by uid {st.st_uid} with mode "
                                  f"{st.st_mode & 0o7777:o}; a NEFF must be yours (or root's) and not "
                                  f"writable by others: chmod go-w it, or copy it somewhere of your own")
        if st.st_size == 0:
            raise ValueError(f"NEFF {path} is empty (0 bytes): a failed or unfinished compile?")
        data = f.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise ValueError(f"NEFF {path} changed size while it was read ({st.st_size} -> {len(data)} bytes)")
    return data


def _input_array(info: nrt.TensorInfo, value: Any) -> np.ndarray:
    """``value`` as the contiguous array the NEFF input ``info`` takes. Its shape must be the
    NEFF's (equal byte counts are not enough: a transposed or reshaped input would run on
    scrambled data) and its dtype must cast within its kind (floats never into integers)."""
    src = _as_numpy(value)
    if info.dtype is not None and not np.can_cast(src.dtype, info.dtype, casting="same_kind"):
        raise TypeError(f"input {info.name}: {src.dtype} does not convert safely to the NEFF's {info.dtype}")
    if info.shape and tuple(src.shape) != info.shape:
        raise ValueError(f"input {info.name}: shape {tuple(src.shape)}, the NEFF expects {info.shape}")
    arr = np.ascontiguousarray(src, dtype=info.dtype)
    if arr.nbytes != info.size:
        raise ValueError(f"input {info.name}: {arr.nbytes} bytes, the NEFF expects {info.size}")
    return arr


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach"):  # torch tensor
        from polyaccel.neuron.sim import torch_to_numpy

        return torch_to_numpy(value)
    return np.asarray(value)
