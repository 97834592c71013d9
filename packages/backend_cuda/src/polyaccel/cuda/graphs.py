"""CUDA graph capture of a static-shape function: copy inputs in, replay, read outputs.

The example inputs become the graph's input buffers (they are not cloned): a caller that
passes the very same tensors on every call skips the copy, which is how in-place state such
as a decoder KV cache is shared between the caller and the graph. Other inputs are copied
into those buffers before each replay. Outputs are the graph's static output tensors and
are overwritten by the next replay: consume or clone them first.

Replicas capture from their own threads. Another thread's CUDA calls during a capture can
invalidate it (a library call that synchronizes the device: two Whisper replicas in fp32 lost
16 of 20 files that way on an H200), so :data:`GATE` makes a capture exclusive: it waits until
every replica is out of its GPU section (:meth:`CaptureGate.work`, entered by the backend's
``replica_stream``), and replicas wait while a capture runs or is waiting.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from polyaccel.core.graphs import cuda_graph_capture


class CaptureGate:
    """Replicas' GPU work (shared) against graph captures (exclusive), in one process.

    :meth:`work` sections nest; a capture waits for every section to end, and new sections
    wait while a capture runs or waits (a stream of short sections cannot starve it). A thread
    that captures from inside its own section steps out of it for the capture and back in
    after, so lazy captures in the middle of a replica's work never deadlock.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0  # threads inside a section
        self._capturing = False
        self._waiting = 0  # captures waiting for the sections to end
        self._local = threading.local()

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        """A replica's GPU section: no capture runs while any thread is inside one."""
        depth = self._depth()
        if depth == 0:
            with self._cond:
                while self._capturing or self._waiting:
                    self._cond.wait()
                self._active += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Exclusive: no other capture and no thread inside a section meanwhile."""
        inside = self._depth() > 0
        with self._cond:
            if inside:
                self._active -= 1
                self._cond.notify_all()
            self._waiting += 1
            try:
                while self._capturing or self._active:
                    self._cond.wait()
            except BaseException:  # interrupted while waiting: leave the counts as they were
                self._waiting -= 1
                if inside:
                    self._active += 1
                self._cond.notify_all()
                raise
            self._waiting -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                if inside:
                    self._active += 1
                self._cond.notify_all()


GATE = CaptureGate()
"""The process's gate: CUDA graph captures against replicas' GPU sections."""


def replica_section(stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
    """A replica's work on its own ``stream``, inside a :data:`GATE` section."""
    stack = contextlib.ExitStack()
    stack.enter_context(GATE.work())
    stack.enter_context(torch.cuda.stream(stream))
    return stack


class CudaGraphRunner:
    """A captured CUDA graph with its static input/output buffers."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *,
                 name: str = "graph", warmup: int = 2, pool: Any = None) -> None:
        self.name = name
        self.static_inputs = list(example_inputs)
        with GATE.capture():
            stream = torch.cuda.Stream(device=self.static_inputs[0].device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up outside the capture (allocator, cuBLAS handles)
                for _ in range(warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with cuda_graph_capture(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.static_outputs = fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(stream)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.static_inputs):
            raise ValueError(f"graph {self.name} takes {len(self.static_inputs)} inputs, got {len(inputs)}")
        copies = [(i, dst, src) for i, (dst, src) in enumerate(zip(self.static_inputs, inputs))
                  if src is not dst and src.data_ptr() != dst.data_ptr()]  # the buffer itself: nothing to do
        for i, dst, src in copies:  # all checked before any is copied
            self._check_input(i, dst, src)
        for _, dst, src in copies:
            dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_outputs

    def _check_input(self, i: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An input copied in must have its buffer's shape and a dtype that casts to the buffer's
        within its kind: ``copy_`` would broadcast a smaller batch into the whole buffer, or
        truncate floats into an integer buffer, and the replay return wrong results."""
        if src.shape != dst.shape or not torch.can_cast(src.dtype, dst.dtype):
            raise ValueError(f"graph {self.name} input {i}: captured for {tuple(dst.shape)} {dst.dtype}, "
                             f"got {tuple(src.shape)} {src.dtype}")


def capture(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *, name: str = "graph"
            ) -> CudaGraphRunner:
    """Capture ``fn`` at the shapes of ``example_inputs`` (all on one CUDA device)."""
    return CudaGraphRunner(fn, example_inputs, name=name)
