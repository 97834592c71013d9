"""CUDA graph capture of a static-shape function: copy inputs in, replay, read outputs.

The example inputs become the graph's input buffers (they are not cloned): a caller that
passes the very same tensors on every call skips the copy, which is how in-place state such
as a decoder KV cache is shared between the caller and the graph. Other inputs are copied
into those buffers before each replay. Outputs are the graph's static output tensors and
are overwritten by the next replay: consume or clone them first.

Replicas capture from their own threads: captures are serialized by a process-wide lock and
use ``thread_local`` capture mode, so another replica's work on its own stream never
invalidates a capture in progress.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

_CAPTURE_LOCK = threading.Lock()


class CudaGraphRunner:
    """A captured CUDA graph with its static input/output buffers."""

    def __init__(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *,
                 name: str = "graph", warmup: int = 2, pool: Any = None) -> None:
        self.name = name
        self.static_inputs = list(example_inputs)
        with _CAPTURE_LOCK:
            stream = torch.cuda.Stream(device=self.static_inputs[0].device)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up outside the capture (allocator, cuBLAS handles)
                for _ in range(warmup):
                    fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.static_outputs = fn(*self.static_inputs)
            torch.cuda.current_stream().wait_stream(stream)

    def __call__(self, *inputs: torch.Tensor) -> Any:
        for dst, src in zip(self.static_inputs, inputs, strict=True):
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_outputs


def capture(fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *, name: str = "graph"
            ) -> CudaGraphRunner:
    """Capture ``fn`` at the shapes of ``example_inputs`` (all on one CUDA device)."""
    return CudaGraphRunner(fn, example_inputs, name=name)
