"""The ``neuron`` backend: availability of the Neuron SDK and libnrt on this machine, the
TorchNeuron compile path, NeuronCore placement of replicas, and NKI kernel registration.

Importing this module imports nothing heavy; torch-neuronx, NKI and libnrt load when used.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyaccel.core.backend import Availability, Backend
from polyaccel.core.hookspec import hookimpl

INSTALL_HINT = ("a Trainium instance with the Neuron SDK: pip install torch-neuronx neuronx-cc nki "
                "--extra-index-url https://pip.repos.neuron.amazonaws.com, and aws-neuronx-runtime-lib")
LIBNRT_PATHS = ("/opt/aws/neuron/lib/libnrt.so.1",)


def find_libnrt() -> str | None:
    """Path of libnrt.so.1 if present (NEURON_RT_LIB overrides), else None. A NEURON_RT_LIB
    naming no file is None, not some other libnrt found elsewhere."""
    env = os.environ.get("NEURON_RT_LIB")
    if env:
        return env if os.path.exists(env) else None
    for p in LIBNRT_PATHS:
        if os.path.exists(p):
            return p
    return ctypes.util.find_library("nrt")


def visible_cores(default: int) -> list[int]:
    """NeuronCore ids this process may use: ``NEURON_RT_VISIBLE_CORES`` ("3", "0-7", "4,5-7")
    or ``range(default)``. The runtime takes only a contiguous set (AWS Neuron runtime guide:
    "3,5,6" is invalid), so a gap is refused here rather than at ``nrt_init``."""
    spec = os.environ.get("NEURON_RT_VISIBLE_CORES", "").strip()
    if not spec:
        return list(range(default))
    cores: list[int] = []
    for part in spec.split(","):
        cores.extend(_core_range(part.strip(), spec))
    if len(set(cores)) != len(cores):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r} names a core twice: two replicas would share it")
    if cores != list(range(cores[0], cores[0] + len(cores))):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r} is not one contiguous ascending range of cores "
                         "(the Neuron runtime refuses gaps, e.g. 3,5,6)")
    return cores


def _core_range(part: str, spec: str) -> range:
    """One ``"3"`` or ``"0-7"`` item of NEURON_RT_VISIBLE_CORES; a clear error for anything else."""
    lo, sep, hi = part.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={spec!r}: {part!r} is not a core id or an "
                         f"ascending range such as 0-7")
    return range(int(lo), int(hi or lo) + 1)


LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"
TRN2_DEFAULT_LNC = "2"


def logical_nc_config() -> str:
    """The LNC the Neuron runtime will use: NEURON_LOGICAL_NC_CONFIG, else trn2's default, 2
    (two physical cores per logical one). polyaccel's DP8 needs 1: ``runtime.configure_lnc1()``."""
    return os.environ.get(LNC_ENV, "").strip() or TRN2_DEFAULT_LNC


def neuron_chips() -> int:
    """Neuron devices (``/dev/neuron*``) on this machine."""
    return sum(os.path.exists(f"/dev/neuron{i}") for i in range(16))


def visible_core_count() -> int:
    """How many NeuronCores libnrt gives this process: those ``NEURON_RT_VISIBLE_CORES`` names,
    else every core of every chip. libnrt numbers them 0..n-1 whatever their absolute ids."""
    return len(visible_cores(neuron_chips() * NeuronBackend().cores_per_chip()))


def core_index(replica: int, visible: int, *, first: int = 0, share: bool = False) -> int:
    """The core index to pass libnrt (``nrt_load``'s ``start_nc``) for replica ``replica``.

    libnrt counts from the first core visible to the process: with NEURON_RT_VISIBLE_CORES=8-15
    absolute core 8 is index 0. Replica ``i`` gets index ``first + i``; more replicas than the
    ``visible - first`` cores are refused unless ``share`` (then round-robin over those cores).
    """
    if visible < 1:
        raise RuntimeError("no NeuronCore is visible to this process: set NEURON_RT_VISIBLE_CORES "
                           "(e.g. runtime.configure_lnc1()) or check /dev/neuron*")
    if not 0 <= first < visible:
        raise ValueError(f"first core index {first} is not among the {visible} visible NeuronCores "
                         f"(0..{visible - 1}): indices count from the first visible core, they are "
                         f"not absolute core ids")
    own = visible - first
    if replica < own:
        return first + replica
    if share:
        return first + replica % own
    raise ValueError(f"replica {replica} needs a NeuronCore of its own but only {own} of the {visible} "
                     f"visible cores are left from index {first}; use fewer replicas, or pass "
                     f"share=True to load several replicas on one core")


class NeuronBackend(Backend):
    """AWS Trainium2 through TorchNeuron (compile to NEFF) and libnrt (8 replicas per chip at LNC=1)."""

    name = "neuron"
    device_type = "neuron"
    priority = 90
    ray_resource = "neuron_cores"
    visible_devices_env = "NEURON_RT_VISIBLE_CORES"
    lnc_env = LNC_ENV

    def availability(self) -> Availability:
        if importlib.util.find_spec("torch_neuronx") is None:
            return Availability.no("torch-neuronx (TorchNeuron) is not installed", INSTALL_HINT)
        if find_libnrt() is None:
            env = os.environ.get("NEURON_RT_LIB")
            return Availability.no(f"NEURON_RT_LIB={env} does not exist" if env else
                                   "libnrt.so.1 (Neuron runtime) not found", INSTALL_HINT)
        if not any(os.path.exists(f"/dev/neuron{i}") for i in range(16)):
            return Availability.no("no Neuron device (/dev/neuron*) on this machine", INSTALL_HINT)
        return Availability.yes("Neuron SDK and devices found")

    def cores_per_chip(self) -> int:
        """8 NeuronCores per trn2 chip at LNC=1 (``configure_lnc1()``), 4 at LNC=2, which is
        what the runtime uses on trn2 when NEURON_LOGICAL_NC_CONFIG is unset."""
        return 8 if logical_nc_config() == "1" else 4

    def device_count(self) -> int:
        chips = neuron_chips()
        return len(visible_cores(chips * self.cores_per_chip())) if chips else 0

    def replica_cores(self, replicas: int, *, share: bool = False) -> list[int]:
        """libnrt's core index per replica: 0..n-1 over the n visible cores (relative to
        NEURON_RT_VISIBLE_CORES, as ``nrt_load`` numbers them; ``visible_cores()[i]`` is the
        absolute id). More replicas than cores only with ``share=True`` (round-robin)."""
        visible = visible_core_count()
        return [core_index(i, visible, share=share) for i in range(replicas)]

    def replica_devices(self, replicas: int) -> list[torch.device]:
        """``torch.device("neuron", core)`` per replica (needs torch-neuronx for the device type)."""
        from polyaccel.neuron.compile import require_torch_neuronx

        require_torch_neuronx()
        n = len(visible_cores(max(1, self.device_count())))
        return [torch.device("neuron", i % n) for i in range(replicas)]

    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16

    def compile_graph(self, fn: Callable[..., Any], example_inputs: Sequence[torch.Tensor], *,
                      name: str = "graph") -> Callable[..., Any]:
        """TorchNeuron ``torch.compile(backend="neuron")`` per bucket, NEFFs kept (see compile.py)."""
        from polyaccel.neuron.compile import compile_graph

        return compile_graph(fn, example_inputs, name)


@hookimpl
def polyaccel_add_backends() -> list[Backend]:
    return [NeuronBackend()]


@hookimpl
def polyaccel_register_kernels(backend: Backend, registry: Any) -> None:
    if backend.name != "neuron":
        return
    from polyaccel.neuron import kernels

    kernels.register_all(registry)
