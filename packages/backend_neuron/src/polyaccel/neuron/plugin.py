"""The ``neuron`` backend: availability of the Neuron SDK and libnrt on this machine."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os

from polyaccel.core.backend import Availability, Backend
from polyaccel.core.hookspec import hookimpl

INSTALL_HINT = ("a Trainium instance with the Neuron SDK: pip install torch-neuronx neuronx-cc nki "
                "--extra-index-url https://pip.repos.neuron.amazonaws.com, and aws-neuronx-runtime-lib")
LIBNRT_PATHS = ("/opt/aws/neuron/lib/libnrt.so.1",)


def find_libnrt() -> str | None:
    """Path of libnrt.so.1 if present (NEURON_RT_LIB overrides), else None."""
    env = os.environ.get("NEURON_RT_LIB")
    if env and os.path.exists(env):
        return env
    for p in LIBNRT_PATHS:
        if os.path.exists(p):
            return p
    return ctypes.util.find_library("nrt")


class NeuronBackend(Backend):
    """AWS Trainium2 through TorchNeuron (compile to NEFF) and libnrt (8 replicas per chip at LNC=1)."""

    name = "neuron"
    device_type = "neuron"
    priority = 90
    ray_resource = "neuron_cores"
    visible_devices_env = "NEURON_RT_VISIBLE_CORES"

    def availability(self) -> Availability:
        if importlib.util.find_spec("torch_neuronx") is None:
            return Availability.no("torch-neuronx (TorchNeuron) is not installed", INSTALL_HINT)
        if find_libnrt() is None:
            return Availability.no("libnrt.so.1 (Neuron runtime) not found", INSTALL_HINT)
        if not any(os.path.exists(f"/dev/neuron{i}") for i in range(16)):
            return Availability.no("no Neuron device (/dev/neuron*) on this machine", INSTALL_HINT)
        return Availability.yes("Neuron SDK and devices found")

    def device_count(self) -> int:
        return sum(os.path.exists(f"/dev/neuron{i}") for i in range(16)) * 8


@hookimpl
def polyaccel_add_backends() -> list[Backend]:
    return [NeuronBackend()]
