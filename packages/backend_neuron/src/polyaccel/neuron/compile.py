"""The TorchNeuron compile path: one static-shape graph -> one NEFF, kept on disk.

``compile_graph(fn, example_inputs, name)`` runs ``torch.compile(fn, backend="neuron",
fullgraph=True, dynamic=False)`` once on the example inputs (TorchNeuron rejects dynamic
shapes, so every bucket is its own graph) with
``TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS=1`` and ``TORCH_NEURONX_DEBUG_DIR`` pointing
at a directory of its own, then collects the NEFFs the compiler left there. Models call it
through :class:`polyaccel.core.GraphCache`, once per (graph, bucket), so an ASR model's
encoder and decoder become separate graphs per bucket, each with its NEFF directory under
the artifacts root (``POLYACCEL_NEURON_ARTIFACTS``, default ``~/.cache/polyaccel/neuron``).
A directory is named after the graph and its cache key (:func:`graph_key`: input shapes and
dtypes, compiler versions, LNC), so a bf16 and an fp32 compile of one graph live side by side;
compiles of one directory take turns under a file lock, across processes. Those NEFFs are
what :mod:`polyaccel.neuron.runtime` loads through libnrt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ARTIFACTS_ENV = "POLYACCEL_NEURON_ARTIFACTS"
PRESERVE_ENV = "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS"
DEBUG_DIR_ENV = "TORCH_NEURONX_DEBUG_DIR"
MARKER = ".polyaccel-neuron-graph"
"""File in every graph directory compile_graph wrote; only such directories (or empty ones) are
replaced. It holds JSON: the graph name, its cache key and what the key was made of (older
versions wrote the bare name)."""
COMPILER_PACKAGES = ("torch-neuronx", "neuronx-cc", "torch")
"""Distributions whose versions go into a graph's cache key (those installed)."""
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TORCH_NEURONX_HINT = ("TorchNeuron: pip install torch-neuronx neuronx-cc "
                      "--extra-index-url https://pip.repos.neuron.amazonaws.com (on a Trainium instance)")

_env_lock = threading.Lock()  # the compile environment is process-wide


def require_torch_neuronx() -> Any:
    """Import ``torch_neuronx`` (which registers the ``neuron`` device and compile backend)."""
    try:
        return importlib.import_module("torch_neuronx")
    except ImportError as e:
        raise ImportError(f"compiling for Trainium needs {TORCH_NEURONX_HINT}; import failed: {e}") from e


def artifacts_root() -> Path:
    """Where per-graph NEFF directories go."""
    return Path(os.environ.get(ARTIFACTS_ENV, Path.home() / ".cache" / "polyaccel" / "neuron"))


def graph_dir_name(name: str, key: str | None = None) -> str:
    """A directory name for a graph name such as ``"encode{'batch': 8, 'frames': 3000}"``,
    ending in ``-<key>`` when given the graph's cache key (see :func:`graph_key`)."""
    slug = re.sub(r"[^A-Za-z0-9_]+", "-", re.sub(r"['\"]?(\w+)['\"]?:\s*", r"\1", name)).strip("-")
    slug = slug or "graph"
    return f"{slug}-{key}" if key else slug


def compiler_versions() -> dict[str, str]:
    """Versions of the installed compile stack (:data:`COMPILER_PACKAGES`) and the LNC setting:
    a NEFF made by another compiler or for another LNC is another artifact."""
    out = {}
    for dist in COMPILER_PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    out[LNC_ENV] = os.environ.get(LNC_ENV, "")
    return out


def input_signature(example_inputs: Sequence[Any]) -> list[list[Any]]:
    """``[[shape, dtype], ...]`` of the inputs (tensors or anything with ``shape``/``dtype``)."""
    return [[list(x.shape), str(x.dtype).removeprefix("torch.")] for x in example_inputs]


def graph_key(example_inputs: Sequence[Any], versions: dict[str, str] | None = None) -> str:
    """A short hash of the input shapes and dtypes, the compiler versions and the LNC setting
    (:func:`compiler_versions`): the part of the cache key that the graph name does not carry
    (an fp32 and a bf16 compile of one graph differ here)."""
    facts = {"inputs": input_signature(example_inputs),
             "versions": compiler_versions() if versions is None else versions}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


@contextlib.contextmanager
def neuron_compile_env(debug_dir: Path) -> Iterator[dict[str, str]]:
    """Set the TorchNeuron variables that keep compilation artifacts in ``debug_dir``; restore
    the previous values on exit. Holds a process-wide lock: compiles are serialized."""
    env = {PRESERVE_ENV: "1", DEBUG_DIR_ENV: str(debug_dir)}
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def find_neffs(directory: Path) -> list[Path]:
    """NEFF files under ``directory``, oldest first (a graph's compile writes one per subgraph)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(directory.rglob("*.neff"), key=lambda p: (p.stat().st_mtime, str(p)))


def check_private_root(root: Path) -> None:
    """Refuse an artifacts root that another user could write to: owned by someone else, or
    writable by group or others (a shared ``/tmp`` folder), where anyone could plant or swap
    the NEFFs the runtime then loads."""
    st = root.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{root} is owned by uid {st.st_uid} with mode {st.st_mode & 0o7777:o}: the "
                              f"NEFF artifacts root must be yours and not writable by others (chmod go-w, "
                              f"or point {ARTIFACTS_ENV} at a private folder)")


def _graph_dirs(root: Path) -> list[Path]:
    """Graph directories under ``root`` that compile_graph wrote (marker present, ours)."""
    return [d for d in sorted(root.iterdir()) if not d.name.startswith(".") and d.is_dir()
            and (d / MARKER).is_file() and d.stat().st_uid == os.geteuid()]


def read_marker(graph_dir: Path) -> dict[str, Any]:
    """The marker of a graph directory: ``{"name", "key", ...}``; an old bare-name marker
    gives ``{"name": ...}`` only (no key: it matches no key a caller asks for); bytes that are
    not UTF-8 are replaced (such a name matches no graph)."""
    text = (Path(graph_dir) / MARKER).read_bytes().decode("utf-8", "replace")
    with contextlib.suppress(ValueError):
        data = json.loads(text)
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            return data
    return {"name": text.rstrip("\n")}


def _wanted(marker: dict[str, Any], name: str | None, key: str | None) -> bool:
    """Whether a graph directory's marker is the graph (and key) the caller asked for."""
    return (name is None or marker.get("name") == name) and (key is None or marker.get("key") == key)


def collect_neffs(root: Path | None = None, *, name: str | None = None,
                  example_inputs: Sequence[Any] | None = None) -> dict[str, list[Path]]:
    """Compiled graphs under the artifacts root: graph directory name -> its NEFFs. Only
    directories compile_graph wrote count, and only in a root nobody else can write to.

    ``name`` keeps the graph of that name; ``example_inputs`` keeps the compile for exactly
    those shapes and dtypes under the installed compiler (:func:`graph_key`). Without them
    every graph is listed, each compile under its own directory name.
    """
    root = Path(root) if root is not None else artifacts_root()
    if not root.is_dir():
        return {}
    check_private_root(root)
    key = graph_key(example_inputs) if example_inputs is not None else None
    dirs = [d for d in _graph_dirs(root) if _wanted(read_marker(d), name, key)]
    out = {d.name: find_neffs(d) for d in dirs}
    return {k: v for k, v in out.items() if v}


def _check_replaceable(out_dir: Path, name: str) -> None:
    """``out_dir`` may be replaced only if it is absent, empty, or compile_graph's directory for
    this very ``name`` (another name can map to the same directory: ``a.b`` and ``a-b``)."""
    if not out_dir.exists():
        return
    marker = out_dir / MARKER
    if not marker.exists():
        if any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} exists and was not written by compile_graph; move it away "
                                  f"or point {ARTIFACTS_ENV} elsewhere")
        return
    owner = read_marker(out_dir)["name"]
    if owner != name:
        raise FileExistsError(f"{out_dir} holds the NEFFs of graph {owner!r}, which maps to the same "
                              f"directory as {name!r}: rename one of the graphs")


@contextlib.contextmanager
def graph_lock(root: Path, dir_name: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``root/.<dir_name>.lock`` so that two processes compiling
    the same graph into one root take turns. The lock file is opened without following a
    symlink and must be a regular file of ours."""
    path = Path(root) / f".{dir_name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symlink; the compile lock must be a plain file") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{path} is not a plain file of ours; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@dataclasses.dataclass
class CompiledGraph:
    """A graph compiled for one shape bucket: call it like ``fn``; ``neffs`` are its artifacts,
    ``key`` the cache key (:func:`graph_key`) in its directory name."""

    name: str
    fn: Callable[..., Any]
    artifacts_dir: Path
    neffs: list[Path]
    key: str = ""

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


def _marker_text(name: str, key: str, example_inputs: Sequence[Any], versions: dict[str, str],
                 compile_id: str) -> str:
    """The JSON marker of one compile (``compile_id`` tells this compile from any other)."""
    return json.dumps({"name": name, "key": key, "inputs": input_signature(example_inputs),
                       "versions": versions, "compile_id": compile_id}, sort_keys=True) + "\n"


def _swap_in(tmp: Path, out_dir: Path, root: Path) -> None:
    """Replace ``out_dir`` with the finished ``tmp`` (the old one is removed)."""
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=root))
        os.replace(out_dir, old / "graph")
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out_dir)


def _verified_neffs(out_dir: Path, produced: list[Path], compile_id: str) -> list[Path]:
    """The NEFFs in ``out_dir``, checked to be the ones this compile (``compile_id``) wrote."""
    neffs = find_neffs(out_dir)
    if (read_marker(out_dir).get("compile_id") != compile_id
            or sorted(p.relative_to(out_dir) for p in neffs) != sorted(produced)):
        raise RuntimeError(f"{out_dir} changed under the compile lock: another process wrote it "
                           f"without the lock; compile again")
    return neffs


def compile_graph(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], name: str = "graph", *,
                  root: Path | None = None) -> CompiledGraph:
    """Compile ``fn`` for exactly the shapes and dtypes of ``example_inputs`` with TorchNeuron
    and keep the NEFFs under ``root/<name>-<key>`` (see the module docstring)."""
    require_torch_neuronx()
    root = Path(root) if root is not None else artifacts_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_root(root)
    versions = compiler_versions()
    key = graph_key(example_inputs, versions)
    out_dir = root / graph_dir_name(name, key)
    compile_id = uuid.uuid4().hex
    # one compile of this graph at a time across processes: the swap and the NEFF list below
    # then describe this compile's files, not another process's
    with graph_lock(root, out_dir.name):
        _check_replaceable(out_dir, name)
        # compile into a fresh hidden directory and swap it in only when the compile finished:
        # a failed or killed compile never leaves a partial NEFF, nor stale ones from an earlier
        # compile, where collect_neffs looks
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=root))
        try:
            compiled = torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)
            with neuron_compile_env(tmp), torch.no_grad():
                compiled(*example_inputs)  # compile now, at this bucket's shapes
            produced = [p.relative_to(tmp) for p in find_neffs(tmp)]
            (tmp / MARKER).write_text(_marker_text(name, key, example_inputs, versions, compile_id))
            _swap_in(tmp, out_dir, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        neffs = _verified_neffs(out_dir, produced, compile_id)
    return CompiledGraph(name, compiled, out_dir, neffs, key)
