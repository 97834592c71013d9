"""The backend interface: what a hardware backend tells core and what it does for it.

Device facts are plain data (names, environment variables, Ray resource keys); behaviour is
a handful of methods. Core calls backends; backends never patch core.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class Availability:
    """Whether a backend can run here and, when it cannot, why and what to install."""

    ok: bool
    reason: str = ""
    install_hint: str = ""

    @classmethod
    def yes(cls, detail: str = "") -> Availability:
        return cls(True, detail)

    @classmethod
    def no(cls, reason: str, install_hint: str = "") -> Availability:
        return cls(False, reason, install_hint)


class BackendUnavailable(RuntimeError):
    """Raised when a backend is asked for but cannot run on this machine."""


class Backend:
    """A hardware backend. Subclasses override the data fields and the methods they need.

    Attributes:
        name: short name used by ``select_backend`` (``"cpu"``, ``"cuda"``, ``"neuron"``).
        device_type: the torch device type tensors live on for this backend.
        priority: higher wins in ``select_backend("auto")``.
        ray_resource: the Ray resource a replica actor asks for (``"GPU"``, ``"neuron_cores"``).
        visible_devices_env: env var that restricts a process to some devices.
    """

    name: str = "base"
    device_type: str = "cpu"
    priority: int = 0
    ray_resource: str | None = None
    visible_devices_env: str | None = None
    replicas_per_device: int = 1
    """Replicas a serving pool puts on each device by default (see :meth:`default_replicas`)."""
    default_batch_size: int = 8
    """Items a replica batches when the user names no batch size (a GPU wants larger batches
    than a CPU core to keep busy)."""

    # ---- facts -----------------------------------------------------------------
    def availability(self) -> Availability:
        """Say whether this backend can run here (cheap; may import the backend's SDK)."""
        return Availability.yes()

    def device_count(self) -> int:
        """Number of devices this backend drives in this process."""
        return 1

    def default_replicas(self) -> int:
        """Replicas a pool runs when the user names none: ``replicas_per_device`` per device."""
        return max(1, self.device_count()) * self.replicas_per_device

    def replica_devices(self, replicas: int) -> list[torch.device]:
        """The device each of ``replicas`` replicas should use (round-robin over devices)."""
        n = max(1, self.device_count())
        return [torch.device(self.device_type, i % n) if self.device_type != "cpu" else torch.device("cpu")
                for i in range(replicas)]

    def default_dtype(self) -> torch.dtype:
        """The dtype models run in by default on this backend."""
        return torch.float32

    # ---- compile / run -----------------------------------------------------------
    def compile_graph(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *,
                      name: str = "graph") -> Callable[..., Any]:
        """Turn ``fn`` into something that replays a static-shape graph for inputs shaped like
        ``example_inputs``. The result takes tensors of exactly those shapes and dtypes.

        The CPU reference runs ``fn`` eagerly.
        """
        return fn

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all queued work on ``device``."""

    def replica_stream(self, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
        """A factory of context managers that run work on one replica's own queue (a CUDA
        stream), so replicas sharing a device overlap. Call once per replica."""
        return contextlib.nullcontext

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for ``polyaccel backends``."""
        a = self.availability()
        return {"name": self.name, "device_type": self.device_type, "available": a.ok,
                "reason": a.reason, "install_hint": a.install_hint, "priority": self.priority,
                "devices": self.device_count() if a.ok else 0}

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"
