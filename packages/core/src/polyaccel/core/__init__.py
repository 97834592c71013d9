"""polyaccel core: model, kernel and runtime interfaces, and backend plugins.

``from polyaccel.core import select_backend, ops, registry`` is all most code needs.
"""

from polyaccel.core import ops
from polyaccel.core.backend import Availability, Backend, BackendUnavailable
from polyaccel.core.graphs import GraphCache, GraphSpec, ShapeBuckets, StaticGraphModel
from polyaccel.core.kernels import registry
from polyaccel.core.parallel import ParallelMeshes, ParallelPlan
from polyaccel.core.plugins import backends, select_backend
from polyaccel.core.runtime import ReplicaPool

__all__ = [
    "Availability", "Backend", "BackendUnavailable", "GraphCache", "GraphSpec", "ShapeBuckets",
    "ParallelMeshes", "ParallelPlan", "ReplicaPool", "StaticGraphModel", "backends", "ops", "registry", "select_backend",
]
__version__ = "0.1.0"
