"""libnrt (the Neuron Runtime C library) through ctypes, with prototypes we declare ourselves.

Only the calls a data-parallel inference runtime needs: init/close, load/unload a NEFF on a
NeuronCore, device tensors and tensor sets, execute, and the model's tensor table. Every
call returning a status goes through :meth:`Libnrt.check`, which raises :class:`NrtError`
carrying the status name. ``ctypes.CDLL`` releases the GIL for the duration of each foreign
call, so ``nrt_execute`` on different cores from different threads runs in parallel.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import weakref
from typing import Any

import ml_dtypes
import numpy as np

# ---- status codes (NRT_STATUS) ----------------------------------------------------------------

STATUS_NAMES: dict[int, str] = {
    0: "NRT_SUCCESS", 1: "NRT_FAILURE", 2: "NRT_INVALID", 3: "NRT_INVALID_HANDLE",
    4: "NRT_RESOURCE", 5: "NRT_TIMEOUT", 6: "NRT_HW_ERROR", 7: "NRT_QUEUE_FULL",
    9: "NRT_LOAD_NOT_ENOUGH_NC", 10: "NRT_UNSUPPORTED_NEFF_VERSION", 13: "NRT_UNINITIALIZED",
    14: "NRT_CLOSED", 1100: "NRT_COLL_PENDING", 1002: "NRT_EXEC_BAD_INPUT", 1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR",
    1004: "NRT_EXEC_COMPLETED_WITH_ERR", 1005: "NRT_EXEC_NC_BUSY", 1006: "NRT_EXEC_OOB",
    **{c: f"NRT_EXEC_HW_ERR_{c - 1200}" for c in range(1200, 1207)},
}

CORE_FAILURES = frozenset({3, 5, 6, 13, 14, *range(1200, 1207)})
"""Statuses after which a core's models are not to be trusted with the next item: invalid
handle, timeout, hardware errors, runtime uninitialized or closed. A replica that meets one
is rebuilt (unloaded and loaded again), not retried; input errors (NRT_EXEC_BAD_INPUT,
NRT_EXEC_OOB) stay the item's own."""

# ---- dtypes (nrt_dtype_t) ---------------------------------------------------------------------

DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float32): 0xA, np.dtype(ml_dtypes.bfloat16): 0x6, np.dtype(np.float16): 0x7,
    np.dtype(np.int32): 0x8, np.dtype(np.int64): 0xC, np.dtype(np.int8): 0x2, np.dtype(np.uint8): 0x3,
    np.dtype(np.int16): 0x4, np.dtype(np.uint16): 0x5, np.dtype(np.uint32): 0x9, np.dtype(np.uint64): 0x1,
}
CODE_DTYPES: dict[int, np.dtype] = {v: k for k, v in DTYPE_CODES.items()}
UNSUPPORTED_DTYPE_NAMES: dict[int, str] = {
    0x0: "NRT_DTYPE_UNKNOWN", 0xB: "NRT_DTYPE_FP32R", 0xD: "NRT_DTYPE_FP8_E3", 0xE: "NRT_DTYPE_FP8_E4",
    0xF: "NRT_DTYPE_FP8_E5",
}
"""Codes nrt.h declares that have no NumPy dtype here: a NEFF tensor of one is refused at load."""
MAX_TENSOR_DIMS = 32
MAX_MODEL_TENSORS = 1 << 16

FRAMEWORK_NONE = 1
PLACEMENT_DEVICE = 0
USAGE_INPUT, USAGE_OUTPUT = 0, 1
TENSOR_NAME_MAX = 256
RUNTIME_ENV = ("NEURON_RT_VISIBLE_CORES", "NEURON_LOGICAL_NC_CONFIG")
"""Read by libnrt once, at ``nrt_init``."""
VNC_COUNT_AUTO = -1
"""``nrt_load``'s ``vnc_count``: nrt.h (runtime API 2.0) marks it deprecated, "always use -1"."""


class NrtError(RuntimeError):
    """A libnrt call failed; ``code`` is the status and ``status`` its name."""

    def __init__(self, call: str, code: int, where: str = "") -> None:
        self.call = call
        self.code = code
        self.status = STATUS_NAMES.get(code, f"NRT_STATUS_{code}")
        super().__init__(f"{call} failed: {self.status} ({code})" + (f" [{where}]" if where else ""))


class TensorInfoC(ctypes.Structure):
    """One entry of ``nrt_get_model_tensor_info``'s table (our declaration of its layout)."""

    _fields_ = [("name", ctypes.c_char * TENSOR_NAME_MAX), ("usage", ctypes.c_int),
                ("size", ctypes.c_size_t), ("dtype", ctypes.c_int),
                ("shape", ctypes.POINTER(ctypes.c_uint32)), ("ndim", ctypes.c_uint32)]


class TensorInfoArrayC(ctypes.Structure):
    """Header of the tensor-info table; ``tensor_count`` entries follow it."""

    _fields_ = [("tensor_count", ctypes.c_uint64)]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A NEFF input or output: name, size in bytes, dtype and shape."""

    name: str
    usage: int
    size: int
    dtype: np.dtype | None
    shape: tuple[int, ...]
    dtype_code: int = -1

    @property
    def is_input(self) -> bool:
        return self.usage == USAGE_INPUT

    def check(self) -> None:
        """Raise ``ValueError`` unless the entry is one we can bind: a known dtype, an input or
        output, and a size that is exactly its shape times its element size."""
        if self.usage not in (USAGE_INPUT, USAGE_OUTPUT):
            raise ValueError(f"NEFF tensor {self.name!r} has usage {self.usage}, neither input nor output")
        if self.dtype is None:
            raise ValueError(f"NEFF tensor {self.name!r} has a dtype polyaccel cannot convert "
                             f"({self.dtype_name}); only {sorted(str(d) for d in DTYPE_CODES)} are supported")
        elements = int(np.prod(self.shape, dtype=np.int64)) if self.shape else self.size // self.dtype.itemsize
        if elements * self.dtype.itemsize != self.size:
            raise ValueError(f"NEFF tensor {self.name!r}: {self.size} bytes do not hold shape {self.shape} "
                             f"of {self.dtype} (the runtime's tensor table is inconsistent)")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype) if self.dtype is not None else UNSUPPORTED_DTYPE_NAMES.get(
            self.dtype_code, f"nrt dtype code {self.dtype_code:#x}")


_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "nrt_init": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "nrt_close": (None, []),
    "nrt_load": (ctypes.c_int, [_p, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, _pp]),
    "nrt_unload": (ctypes.c_int, [_p]),
    "nrt_tensor_allocate": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p, _pp]),
    "nrt_tensor_free": (None, [_pp]),
    "nrt_tensor_write": (ctypes.c_int, [_p, _p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_tensor_read": (ctypes.c_int, [_p, _p, ctypes.c_size_t, ctypes.c_size_t]),
    "nrt_allocate_tensor_set": (ctypes.c_int, [_pp]),
    "nrt_add_tensor_to_tensor_set": (ctypes.c_int, [_p, ctypes.c_char_p, _p]),
    "nrt_destroy_tensor_set": (None, [_pp]),
    "nrt_execute": (ctypes.c_int, [_p, _p, _p]),
    "nrt_get_model_tensor_info": (ctypes.c_int, [_p, ctypes.POINTER(ctypes.POINTER(TensorInfoArrayC))]),
    "nrt_free_model_tensor_info": (ctypes.c_int, [ctypes.POINTER(TensorInfoArrayC)]),
}


class Libnrt:
    """A loaded ``libnrt.so.1`` with typed entry points; one per process (see :func:`load`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = ctypes.CDLL(path)  # CDLL (not PyDLL): every call releases the GIL
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(self.lib, name, None)
            if fn is None:
                if name == "nrt_free_model_tensor_info":
                    continue
                raise OSError(f"{path} has no symbol {name}; is it libnrt.so.1?")
            fn.restype, fn.argtypes = restype, argtypes
        self.initialized = False
        self.init_env: dict[str, str | None] = {}
        self._lock = threading.Lock()
        self._models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._models_lock = threading.Lock()

    @staticmethod
    def check(call: str, rc: int, where: str = "") -> None:
        """Raise :class:`NrtError` unless ``rc`` is NRT_SUCCESS; ``where`` (e.g. the core) goes
        into the message."""
        if rc != 0:
            raise NrtError(call, rc, where)

    def init(self) -> None:
        """``nrt_init`` once per process (later calls do nothing)."""
        with self._lock:
            if not self.initialized:
                env = runtime_env()
                self.check("nrt_init", self.lib.nrt_init(FRAMEWORK_NONE, b"", b""))
                self.initialized, self.init_env = True, env

    def check_env(self, env: dict[str, str | None] | None = None) -> None:
        """Raise ``RuntimeError`` if the runtime was initialized with other NeuronCore settings
        than ``env`` (default: the current environment): libnrt read them once, at ``nrt_init``,
        so core numbers computed from the new values would point at other cores."""
        env = runtime_env() if env is None else env
        with self._lock:
            if not self.initialized:
                return
            for key in RUNTIME_ENV:
                if env.get(key) != self.init_env.get(key):
                    raise RuntimeError(
                        f"{key}={env.get(key)!r} but the Neuron runtime was started with "
                        f"{key}={self.init_env.get(key)!r} (libnrt reads it once, at nrt_init): set it "
                        f"(runtime.configure_lnc1()) before the first model loads, or close the runtime first")

    def register(self, model: Any) -> None:
        """Track ``model`` (it has ``close()``) so that :meth:`close` releases it before ``nrt_close``."""
        with self._models_lock:
            self._models.add(model)

    def unregister(self, model: Any) -> None:
        with self._models_lock:
            self._models.discard(model)

    def close(self) -> None:
        """Close every model still open on this runtime (each waits for its running
        ``nrt_execute``), then ``nrt_close``. Idempotent; afterwards the process may ``init``
        again. A model's failure to close is raised after ``nrt_close`` has run."""
        with self._lock:
            if not self.initialized:
                return
            with self._models_lock:
                models = list(self._models)
            errors = []
            for model in models:
                try:
                    model.close()
                except Exception as e:  # noqa: BLE001 - close the rest and the runtime first
                    errors.append(e)
            self.lib.nrt_close()
            self.initialized = False
        if errors:
            raise errors[0]

    def load(self, neff: bytes, start_core: int = -1) -> ctypes.c_void_p:
        """Load a NEFF onto ``start_core`` (-1: the first free one); returns the model handle.
        ``vnc_count`` is always :data:`VNC_COUNT_AUTO`, as the published ``nrt.h`` asks."""
        if not neff:
            raise ValueError("the NEFF is empty (0 bytes)")
        model = ctypes.c_void_p()
        # the bytes object itself (nrt_load takes const void *): no second copy of a NEFF of GBs
        # per replica while eight replicas load at once
        self.check("nrt_load", self.lib.nrt_load(bytes(neff), len(neff), start_core, VNC_COUNT_AUTO,
                                                 ctypes.byref(model)), f"core {start_core}")
        if not model:
            raise NrtError("nrt_load", 3, f"core {start_core}: returned success but no model handle")
        return model

    def tensor_info(self, model: ctypes.c_void_p, where: str = "") -> list[TensorInfo]:
        """The model's inputs and outputs (``nrt_get_model_tensor_info``); the runtime's table is
        freed on every path."""
        arr = ctypes.POINTER(TensorInfoArrayC)()
        self.check("nrt_get_model_tensor_info", self.lib.nrt_get_model_tensor_info(model, ctypes.byref(arr)),
                   where)
        if not arr:
            raise NrtError("nrt_get_model_tensor_info", 3, f"{where}: returned success but no table")
        try:
            return _read_tensor_table(arr)
        finally:
            if hasattr(self.lib, "nrt_free_model_tensor_info"):
                self.lib.nrt_free_model_tensor_info(arr)


def runtime_env() -> dict[str, str | None]:
    """The current values of the variables libnrt reads at ``nrt_init``."""
    return {key: os.environ.get(key) for key in RUNTIME_ENV}


def started_runtimes() -> list[Libnrt]:
    """The loaded libnrt instances that are initialized (``nrt_init`` done, not closed)."""
    with _libs_lock:
        return [lib for lib in _libs.values() if lib.initialized]


def _read_tensor_table(arr: Any) -> list[TensorInfo]:
    """Copy ``nrt_tensor_info_array_t`` into :class:`TensorInfo` entries, refusing counts and
    ranks that only a layout mismatch (or a broken runtime) would produce."""
    count = arr.contents.tensor_count
    if count > MAX_MODEL_TENSORS:
        raise ValueError(f"nrt_get_model_tensor_info reports {count} tensors: not a table this libnrt "
                         f"version's layout matches (see tests/neuron/test_nrt_abi.py)")
    entries = ctypes.cast(ctypes.addressof(arr.contents) + ctypes.sizeof(TensorInfoArrayC),
                          ctypes.POINTER(TensorInfoC * count)).contents
    infos = []
    for e in entries:
        name = e.name.decode()
        if e.ndim > MAX_TENSOR_DIMS or (e.ndim and not e.shape):
            raise ValueError(f"NEFF tensor {name!r}: rank {e.ndim} with shape pointer "
                             f"{'set' if e.shape else 'NULL'} is not a valid tensor-info entry")
        infos.append(TensorInfo(name, e.usage, e.size, CODE_DTYPES.get(e.dtype),
                                tuple(e.shape[i] for i in range(e.ndim)), e.dtype))
    return infos


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def check_trusted_library(path: str) -> str:
    """Refuse to load ``path`` unless it is absolute and no user other than us or root can
    change what it loads: not the file, not its folder, not any folder above (whoever may write
    a folder can rename what is in it and put their own in its place).
    Returns the file checked (symlinks resolved): load that one, not a link someone may swap."""
    if not os.path.isabs(path):
        raise OSError(f"libnrt path {path!r} is relative (it would load from the current folder): "
                      f"give NEURON_RT_LIB an absolute path")
    real = os.path.realpath(path)
    st = os.stat(real)
    if not _trusted(st.st_uid) or st.st_mode & 0o022:
        raise OSError(f"refusing to load {path}: {real} is owned by uid {st.st_uid} with mode "
                      f"{st.st_mode & 0o7777:o}; libnrt must not be writable by others: "
                      f"chmod go-w {real} (owned by you or root)")
    child, folder = real, os.path.dirname(real)
    while True:
        _check_folder(path, folder, child)
        if folder == os.path.dirname(folder):  # the root
            return real
        child, folder = folder, os.path.dirname(folder)


def _check_folder(path: str, folder: str, child: str) -> None:
    """Raise unless only we or root can replace ``child`` in ``folder``: the folder is ours or
    root's, and neither its group nor others may write it unless it is sticky (as /tmp: then
    only an entry's owner may rename it, and every entry on the path is ours or root's)."""
    st = os.stat(folder)
    if _trusted(st.st_uid) and (not st.st_mode & 0o022 or st.st_mode & 0o1000):
        return
    raise OSError(f"refusing to load {path}: folder {folder} is owned by uid {st.st_uid} with mode "
                  f"{st.st_mode & 0o7777:o}, so another user could swap {child}; libnrt and every folder "
                  f"above it must not be writable by others. Fix: chmod go-w {folder} (or make it yours "
                  f"or root's), or point NEURON_RT_LIB at a libnrt in folders only you or root can write")


_libs: dict[str, Libnrt] = {}
_libs_lock = threading.Lock()


def load(path: str | None = None) -> Libnrt:
    """The process's :class:`Libnrt` for ``path`` (default: ``find_libnrt()``), loaded once."""
    from polyaccel.neuron.plugin import INSTALL_HINT, find_libnrt

    path = path or find_libnrt()
    if path is None and os.environ.get("NEURON_RT_LIB"):
        raise OSError(f"NEURON_RT_LIB={os.environ['NEURON_RT_LIB']} does not exist: point it at "
                      f"libnrt.so.1 or unset it")
    if path is None:
        raise OSError(f"libnrt.so.1 (the Neuron runtime) was not found; install {INSTALL_HINT} "
                      f"or point NEURON_RT_LIB at it")
    if os.sep in path:  # a file path; a bare name is dlopen's to find in the system's paths, never ./
        path = check_trusted_library(path)
    with _libs_lock:
        if path not in _libs:
            _libs[path] = Libnrt(path)
        return _libs[path]
