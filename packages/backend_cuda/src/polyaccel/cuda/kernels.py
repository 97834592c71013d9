"""CUDA kernel registrations for core's named ops."""

from __future__ import annotations

import torch


def register_all(registry) -> None:
    """Register this backend's CUDA implementations (called when the backend is activated)."""
    if hasattr(torch, "_grouped_mm"):
        registry.register("grouped_mm", "cuda", grouped_mm_cuda, impl="torch._grouped_mm", backend="cuda")


def grouped_mm_cuda(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` on Hopper (bf16). w [E, N, K] -> transpose to [E, K, N] view."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        from polyaccel.core.ops import grouped_mm

        return grouped_mm.reference(x, w, offsets)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets.to(torch.int32))
