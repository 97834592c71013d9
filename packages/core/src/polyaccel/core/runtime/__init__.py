"""The replica runtime: run items through N model replicas, one worker thread each.

``ReplicaPool`` is the runtime (work stealing, backpressure, ordered streaming results,
per-item errors, replica restart, metrics); ``ThreadedQueueBaseline`` and
``ProcessPoolBaseline`` are the naive runtimes it is benchmarked against. See
``docs/runtime.md``.
"""

from polyaccel.core.runtime.baselines import ProcessPoolBaseline, ThreadedQueueBaseline
from polyaccel.core.runtime.metrics import PoolMetrics, ReplicaStats
from polyaccel.core.runtime.pool import ReplicaPool
from polyaccel.core.runtime.replica import Replica, ReplicaFactory
from polyaccel.core.runtime.results import (
    CancelledError,
    PoolClosed,
    ReplicaDied,
    ReplicaStartError,
    Result,
)

__all__ = [
    "CancelledError", "PoolClosed", "PoolMetrics", "ProcessPoolBaseline", "Replica", "ReplicaDied",
    "ReplicaFactory", "ReplicaPool", "ReplicaStartError", "ReplicaStats", "Result", "ThreadedQueueBaseline",
]
