"""The TorchNeuron compile path: one static-shape graph -> one NEFF, kept on disk.

``compile_graph(fn, example_inputs, name)`` runs ``torch.compile(fn, backend="neuron",
fullgraph=True, dynamic=False)`` once on the example inputs (TorchNeuron rejects dynamic
shapes, so every bucket is its own graph) with
``TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS=1`` and ``TORCH_NEURONX_DEBUG_DIR`` pointing
at a directory of its own, then collects the NEFFs the compiler left there. Models call it
through :class:`polyaccel.core.GraphCache`, once per (graph, bucket), so an ASR model's
encoder and decoder become separate graphs per bucket, each with its NEFF directory under
the artifacts root (``POLYACCEL_NEURON_ARTIFACTS``, default ``~/.cache/polyaccel/neuron``).
Those NEFFs are what :mod:`polyaccel.neuron.runtime` loads through libnrt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

ARTIFACTS_ENV = "POLYACCEL_NEURON_ARTIFACTS"
PRESERVE_ENV = "TORCH_NEURONX_PRESERVE_COMPILATION_ARTIFACTS"
DEBUG_DIR_ENV = "TORCH_NEURONX_DEBUG_DIR"
MARKER = ".polyaccel-neuron-graph"
"""File in every graph directory compile_graph wrote; only such directories (or empty ones) are replaced."""
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


def graph_dir_name(name: str) -> str:
    """A directory name for a graph name such as ``"encode{'batch': 8, 'frames': 3000}"``."""
    slug = re.sub(r"[^A-Za-z0-9_]+", "-", re.sub(r"['\"]?(\w+)['\"]?:\s*", r"\1", name)).strip("-")
    return slug or "graph"


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


def collect_neffs(root: Path | None = None) -> dict[str, list[Path]]:
    """Every compiled graph under the artifacts root: graph directory name -> its NEFFs. Only
    directories compile_graph wrote count, and only in a root nobody else can write to."""
    root = Path(root) if root is not None else artifacts_root()
    if not root.is_dir():
        return {}
    check_private_root(root)
    out = {d.name: find_neffs(d) for d in _graph_dirs(root)}
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
    owner = marker.read_text().rstrip("\n")
    if owner != name:
        raise FileExistsError(f"{out_dir} holds the NEFFs of graph {owner!r}, which maps to the same "
                              f"directory as {name!r}: rename one of the graphs")


@dataclasses.dataclass
class CompiledGraph:
    """A graph compiled for one shape bucket: call it like ``fn``; ``neffs`` are its artifacts."""

    name: str
    fn: Callable[..., Any]
    artifacts_dir: Path
    neffs: list[Path]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


def compile_graph(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], name: str = "graph", *,
                  root: Path | None = None) -> CompiledGraph:
    """Compile ``fn`` for exactly the shapes of ``example_inputs`` with TorchNeuron and keep
    the NEFFs under ``root/<name>`` (see the module docstring)."""
    require_torch_neuronx()
    root = Path(root) if root is not None else artifacts_root()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private_root(root)
    out_dir = root / graph_dir_name(name)
    _check_replaceable(out_dir, name)
    # compile into a fresh hidden directory and swap it in only when the compile finished: a
    # failed or killed compile never leaves a partial NEFF, nor stale ones from an earlier compile,
    # where collect_neffs looks
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=root))
    try:
        compiled = torch.compile(fn, backend="neuron", fullgraph=True, dynamic=False)
        with neuron_compile_env(tmp), torch.no_grad():
            compiled(*example_inputs)  # compile now, at this bucket's shapes
        (tmp / MARKER).write_text(name + "\n")
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=root))
            os.replace(out_dir, old / "graph")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return CompiledGraph(name, compiled, out_dir, find_neffs(out_dir))
