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
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polyaccel.neuron import nrt

CORES_PER_CHIP_LNC1 = 8


def configure_lnc1(num_cores: int = CORES_PER_CHIP_LNC1, first_core: int = 0) -> dict[str, str]:
    """Set the runtime environment for LNC=1 replicas on cores ``first_core..+num_cores-1``.

    Must run before ``nrt_init`` (i.e. before the first model loads). Returns what it set.
    libnrt then numbers those cores 0..num_cores-1: replicas use indices, not ``first_core``.
    """
    env = {"NEURON_LOGICAL_NC_CONFIG": "1",
           "NEURON_RT_VISIBLE_CORES": f"{first_core}-{first_core + num_cores - 1}"}
    os.environ.update(env)
    return env


class NeuronModel:
    """One NEFF loaded on one NeuronCore with its own input/output tensors and tensor sets.

    ``core`` is libnrt's index among the cores visible to the process (0 = the first of
    NEURON_RT_VISIBLE_CORES), not an absolute core id.

    Tensors are bound by the names in the NEFF's tensor table (``input0..``, ``output0..``
    for TorchNeuron graphs), allocated once on the model's core and reused every call.
    """

    def __init__(self, neff: bytes | str | Path, core: int, lib: nrt.Libnrt | None = None) -> None:
        self.lib = lib or nrt.load()
        self.core = core
        self._tensors: list[ctypes.c_void_p] = []
        self._sets: list[ctypes.c_void_p] = []
        self._model = ctypes.c_void_p()
        self.lib.init()
        data = neff if isinstance(neff, bytes) else Path(neff).read_bytes()
        self._model = self.lib.load(data, core)
        try:
            self.infos = self.lib.tensor_info(self._model)
            self.inputs = [i for i in self.infos if i.is_input]
            self.outputs = [i for i in self.infos if not i.is_input]
            self._in_set, self._in_handles = self._tensor_set(self.inputs)
            self._out_set, self._out_handles = self._tensor_set(self.outputs)
        except BaseException:
            self.close()  # a half-built model must not stay loaded on its core
            raise

    def _tensor_set(self, infos: Sequence[nrt.TensorInfo]) -> tuple[ctypes.c_void_p, list[ctypes.c_void_p]]:
        """Allocate one device tensor per entry on this core and bind them by name in a new set."""
        lib = self.lib.lib
        tset = ctypes.c_void_p()
        self.lib.check("nrt_allocate_tensor_set", lib.nrt_allocate_tensor_set(ctypes.byref(tset)))
        self._sets.append(tset)
        handles = []
        for info in infos:
            t = ctypes.c_void_p()
            self.lib.check("nrt_tensor_allocate", lib.nrt_tensor_allocate(
                nrt.PLACEMENT_DEVICE, self.core, info.size, info.name.encode(), ctypes.byref(t)))
            self._tensors.append(t)
            handles.append(t)
            self.lib.check("nrt_add_tensor_to_tensor_set",
                           lib.nrt_add_tensor_to_tensor_set(tset, info.name.encode(), t))
        return tset, handles

    def execute(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
        """Write ``inputs`` (arrays by position or by tensor name), run, read the outputs."""
        lib = self.lib.lib
        if isinstance(inputs, Mapping):
            missing = [i.name for i in self.inputs if i.name not in inputs]
            if missing:
                raise KeyError(f"missing inputs {missing}; the NEFF takes {[i.name for i in self.inputs]}")
            inputs = [inputs[i.name] for i in self.inputs]
        if len(inputs) != len(self.inputs):
            raise ValueError(f"the NEFF takes {len(self.inputs)} inputs, got {len(inputs)}")
        for info, handle, value in zip(self.inputs, self._in_handles, inputs):
            arr = _input_array(info, value)
            self.lib.check("nrt_tensor_write", lib.nrt_tensor_write(handle, arr.ctypes.data, 0, arr.nbytes))
        self.lib.check("nrt_execute", lib.nrt_execute(self._model, self._in_set, self._out_set))
        outs = []
        for info, handle in zip(self.outputs, self._out_handles):
            out = np.empty(info.size // (info.dtype.itemsize if info.dtype else 1), info.dtype or np.uint8)
            self.lib.check("nrt_tensor_read", lib.nrt_tensor_read(handle, out.ctypes.data, 0, out.nbytes))
            outs.append(out.reshape(info.shape) if info.shape else out)
        return outs

    __call__ = execute

    def close(self) -> None:
        """Free tensors and tensor sets, unload the model (idempotent)."""
        lib = self.lib.lib
        for tset in self._sets:
            lib.nrt_destroy_tensor_set(ctypes.byref(tset))
        for t in self._tensors:
            lib.nrt_tensor_free(ctypes.byref(t))
        self._sets, self._tensors = [], []
        if self._model:
            self.lib.check("nrt_unload", lib.nrt_unload(self._model))
            self._model = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001,S110 - interpreter shutdown
            pass


class NeuronReplica:
    """Every graph of one model copy, loaded on one NeuronCore (``core``).

    ``process(batch)`` is what ``ReplicaPool`` calls: by default each item is the input list
    of the only graph; pass ``process`` to run a pipeline (e.g. encoder then decoder steps).
    """

    def __init__(self, neffs: Mapping[str, bytes | str | Path], core: int, lib: nrt.Libnrt | None = None,
                 process: Callable[[NeuronReplica, list[Any]], Sequence[Any]] | None = None) -> None:
        self.core = core
        self.models = {name: NeuronModel(neff, core, lib) for name, neff in neffs.items()}
        self._process = process

    def execute(self, graph: str, inputs: Sequence[Any] | Mapping[str, Any]) -> list[np.ndarray]:
        return self.models[graph].execute(inputs)

    def process(self, batch: list[Any]) -> Sequence[Any]:
        if self._process is not None:
            return self._process(self, batch)
        if len(self.models) != 1:
            raise TypeError("a replica with several graphs needs a process(replica, batch) function")
        (model,) = self.models.values()
        return [model.execute(item) for item in batch]

    def close(self) -> None:
        for m in self.models.values():
            m.close()


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
    core_index(0, visible, first=first_core)  # a bad first_core fails here, not in a worker
    blobs = {k: v if isinstance(v, bytes) else Path(v).read_bytes() for k, v in neffs.items()}
    lock = threading.Lock()

    def factory(index: int) -> NeuronReplica:
        core = core_index(index, visible, first=first_core, share=share_cores)
        lib = nrt.load(lib_path)
        with lock:  # nrt_init once, before the first load
            lib.init()
        return NeuronReplica(blobs, core, lib, process)

    return factory


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
