"""The model interface for static-shape graphs.

A model that wants a backend to compile it declares its graphs as :class:`GraphSpec`s: a
pure function of tensors, the shape buckets it is used at, and how to make example inputs
for a bucket. A :class:`GraphCache` asks the backend to compile each (graph, bucket) once
(CUDA graph capture, ``torch.compile(backend="neuron")`` -> NEFF, or eager on CPU) and
replays it. Buckets are data (``ShapeBuckets``), not code.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from polyaccel.core.backend import Backend

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ShapeBuckets:
    """Allowed sizes per named dimension, e.g. ``{"batch": (1, 2, 4, 8), "frames": (3000,)}``."""

    sizes: Mapping[str, tuple[int, ...]]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", {k: tuple(sorted(set(v))) for k, v in self.sizes.items()})
        for k, v in self.sizes.items():
            if not v or v[0] <= 0:
                raise ValueError(f"bucket sizes for {k!r} must be positive and non-empty, got {v}")

    def pick(self, **actual: int) -> dict[str, int]:
        """The smallest bucket size >= each actual size. Raises ValueError if one is too big."""
        out = {}
        for dim, n in actual.items():
            sizes = self.sizes[dim]
            i = bisect.bisect_left(sizes, n)
            if i == len(sizes):
                raise ValueError(f"{dim}={n} exceeds the largest bucket ({sizes[-1]}); "
                                 f"split the input or add a larger bucket")
            out[dim] = sizes[i]
        return out

    def all(self) -> list[dict[str, int]]:
        """Every combination of sizes (for ahead-of-time compilation)."""
        combos: list[dict[str, int]] = [{}]
        for dim, sizes in self.sizes.items():
            combos = [{**c, dim: s} for c in combos for s in sizes]
        return combos

    @property
    def max(self) -> dict[str, int]:
        return {k: v[-1] for k, v in self.sizes.items()}


@dataclasses.dataclass(slots=True)
class GraphSpec:
    """One static-shape graph a model exposes.

    Attributes:
        name: e.g. ``"encode"`` or ``"decode_step"``.
        fn: a function of tensors only; shapes fixed per bucket.
        buckets: the shape buckets the graph is compiled for.
        example_inputs: bucket -> tensors shaped (and typed, placed) as ``fn`` expects.
    """

    name: str
    fn: Callable[..., Any]
    buckets: ShapeBuckets
    example_inputs: Callable[[dict[str, int]], Sequence[torch.Tensor]]


class StaticGraphModel(Protocol):
    """What a model implements so a backend can compile it bucket by bucket."""

    def graph_specs(self) -> list[GraphSpec]: ...


class GraphCache:
    """Compiles each (graph, bucket) with ``backend`` on first use and replays it after."""

    def __init__(self, backend: Backend, specs: Sequence[GraphSpec]) -> None:
        self.backend = backend
        self.specs = {s.name: s for s in specs}
        self._compiled: dict[tuple[str, tuple[tuple[str, int], ...]], Callable[..., Any]] = {}
        self._inputs: dict[tuple[str, tuple[tuple[str, int], ...]], tuple[int, ...] | None] = {}
        self._lock = threading.Lock()

    def get(self, name: str, bucket: Mapping[str, int],
            example_inputs: Sequence[torch.Tensor] | None = None) -> Callable[..., Any]:
        """The compiled callable for ``name`` at ``bucket`` (compiling it if needed).

        ``example_inputs`` replaces the spec's factory for this compilation: a backend may
        keep them as the graph's input buffers (CUDA graphs do), so a caller passing its own
        persistent state tensors here shares them with the graph.
        """
        key = (name, tuple(sorted(bucket.items())))
        fn = self._compiled.get(key)
        ids = None if example_inputs is None else tuple(id(t) for t in example_inputs)
        if fn is not None and ids is not None and self._inputs.get(key) != ids:
            # A backend may have kept other tensors as the graph's buffers: in-place state
            # written by the graph would not reach the caller's tensors.
            raise RuntimeError(f"graph {name}{dict(bucket)} was compiled over other input tensors")
        if fn is None:
            with self._lock:
                fn = self._compiled.get(key)
                if fn is None:
                    spec = self.specs[name]
                    example = example_inputs if example_inputs is not None else spec.example_inputs(dict(bucket))
                    fn = self.backend.compile_graph(spec.fn, example, name=f"{name}{dict(bucket)}")
                    self._compiled[key] = fn
                    self._inputs[key] = ids
        return fn

    def __call__(self, name: str, bucket: Mapping[str, int], *inputs: torch.Tensor) -> Any:
        return self.get(name, bucket)(*inputs)

    def warmup(self, names: Sequence[str] | None = None) -> int:
        """Compile every bucket of the named graphs (all by default, from the specs' example
        inputs); return how many. Graphs over caller-owned state are compiled by their owner."""
        n = 0
        for name in names or list(self.specs):
            for bucket in self.specs[name].buckets.all():
                self.get(name, bucket)
                n += 1
        return n

    def __len__(self) -> int:
        return len(self._compiled)


@contextlib.contextmanager
def cuda_graph_capture(graph: torch.cuda.CUDAGraph, *, pool: Any = None,
                       capture_error_mode: str = "global") -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=..., capture_error_mode=...)`` that no garbage collection
    interrupts and that leaves the process's CUDA random generator usable when it fails.

    Python's cyclic garbage collector, run inside a capture, may destroy an unreachable
    ``CUDAGraph`` of an earlier runner; destroying a graph is not permitted while a stream
    captures, and the capture fails ("operation failed due to a previous error during capture",
    seen on an H200 as a decode bucket falling back to eager now and then). The collector is
    paused for the capture.

    A capture that fails (an op that synchronizes, an allocation the capture refuses) ends
    without torch closing the default generator's capture: it stays marked as capturing, and
    from then on every random op on that device and every replay of any other graph raises
    "Offset increment outside graph capture encountered unexpectedly". Callers that catch the
    failure and run eagerly instead would fail later, somewhere else. Here, a failed capture
    is followed by a one-op capture that closes the generator's capture state; then the
    original error propagates.
    """
    device = torch.cuda.current_device()
    with _gc_paused():
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
                yield
        except BaseException:
            try:
                _close_generator_capture(device)
            except Exception as repair_error:  # the capture's own error is the one to report
                logger.warning("could not close the CUDA generator's capture state after a failed "
                               "capture: %s", repair_error)
            raise


_GC_PAUSE = {"depth": 0, "was_enabled": False}
_GC_PAUSE_LOCK = threading.Lock()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection within (nestable, across threads: the collector is back on,
    if it was on, when the last pause ends)."""
    with _GC_PAUSE_LOCK:
        if _GC_PAUSE["depth"] == 0:
            _GC_PAUSE["was_enabled"] = gc.isenabled()
            gc.disable()
        _GC_PAUSE["depth"] += 1
    try:
        yield
    finally:
        with _GC_PAUSE_LOCK:
            _GC_PAUSE["depth"] -= 1
            if _GC_PAUSE["depth"] == 0 and _GC_PAUSE["was_enabled"]:
                gc.enable()


def _close_generator_capture(device: int) -> None:
    """Capture and drop a one-op graph on ``device``: ending a capture marks the default
    generator as no longer capturing."""
    scratch = torch.zeros(1, device=f"cuda:{device}")
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        repair = torch.cuda.CUDAGraph()
        with torch.cuda.graph(repair, capture_error_mode="thread_local"):  # other threads keep running
            scratch.add_(1)
    del repair
