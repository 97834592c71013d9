"""NKI kernels for core's named ops, and their registration for device type ``"neuron"``.

Each module holds one kernel (written against ``nki``/``nl``/``nisa``, see
:mod:`polyaccel.neuron.nki_api`) and a torch-facing wrapper with the core op's signature.
"""

from __future__ import annotations

from typing import Any

OPS = {
    "ffn": ("polyaccel.neuron.kernels.ffn", "ffn"),
    "depthwise_conv1d": ("polyaccel.neuron.kernels.depthwise_conv1d", "depthwise_conv1d"),
    "conv2d_subsample": ("polyaccel.neuron.kernels.conv2d_subsample", "conv2d_subsample"),
    "fused_qkv": ("polyaccel.neuron.kernels.fused_qkv", "fused_qkv"),
}


def register_all(registry: Any, device_type: str = "neuron") -> None:
    """Register every NKI kernel wrapper for ``device_type`` (imports the kernel modules,
    which import nothing heavy: the Neuron SDK is imported on first call)."""
    import importlib

    for op, (module, fn) in OPS.items():
        registry.register(op, device_type, getattr(importlib.import_module(module), fn), impl="nki",
                          backend="neuron")
