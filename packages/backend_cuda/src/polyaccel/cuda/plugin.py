"""The ``cuda`` backend: availability, CUDA-graph compilation of static graphs, kernel registration."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyaccel.core.backend import Availability, Backend
from polyaccel.core.hookspec import hookimpl

INSTALL_HINT = ("a CUDA build of PyTorch and an NVIDIA driver "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu130)")


class CudaBackend(Backend):
    """NVIDIA GPUs through PyTorch CUDA: CUDA graphs per shape bucket, fused kernels."""

    name = "cuda"
    device_type = "cuda"
    priority = 100
    ray_resource = "GPU"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    # Two replicas per GPU: one's host work (reading results, preparing the next batch) runs
    # while the other's kernels do; whisper-base end to end on an H200 went from 67% to 84%
    # GPU busy and 5,004 to 6,449 steady RTFx (docs/benchmarks.md).
    replicas_per_device = 2
    default_batch_size = 64  # whisper-base end to end, 2 replicas: 64 beat 128 and 32 in files/s (docs/benchmarks.md)

    def availability(self) -> Availability:
        if torch.version.cuda is None:
            return Availability.no(f"torch {torch.__version__} is a CPU-only build", INSTALL_HINT)
        if not torch.cuda.is_available():
            return Availability.no("no NVIDIA GPU or driver visible to this process", INSTALL_HINT)
        n = torch.cuda.device_count()
        return Availability.yes(f"{n} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}")

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def replica_stream(self, device: torch.device):
        from polyaccel.cuda.graphs import replica_section

        stream = torch.cuda.Stream(device=device)
        return lambda: replica_section(stream)

    def compile_graph(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *,
                      name: str = "graph") -> Callable[..., Any]:
        from polyaccel.cuda.graphs import capture

        return capture(fn, example_inputs, name=name)


@hookimpl
def polyaccel_add_backends() -> list[Backend]:
    return [CudaBackend()]


@hookimpl
def polyaccel_register_kernels(backend: Backend, registry) -> None:
    if backend.name != "cuda":
        return
    from polyaccel.cuda import kernels

    kernels.register_all(registry)
