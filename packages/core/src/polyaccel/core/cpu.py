"""The built-in CPU backend: eager PyTorch, the reference every other backend is checked against."""

from __future__ import annotations

import os

import torch

from polyaccel.core.backend import Availability, Backend
from polyaccel.core.hookspec import hookimpl


class CpuBackend(Backend):
    """Eager PyTorch on the host CPU. Always available; what CI runs."""

    name = "cpu"
    device_type = "cpu"
    priority = 0
    ray_resource = "CPU"

    def availability(self) -> Availability:
        return Availability.yes(f"torch {torch.__version__}, {os.cpu_count()} cores")

    def device_count(self) -> int:
        return 1


@hookimpl
def polyaccel_add_backends() -> list[Backend]:
    return [CpuBackend()]
