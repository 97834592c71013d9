"""Runtime metrics: throughput, per-replica busy time, steals, queue depth, restarts.

Counters live in one :class:`SlotCounters` per replica slot, written only by that slot's
worker thread, so the hot path takes no lock for them; :meth:`ReplicaPool.metrics` sums
them into an immutable :class:`PoolMetrics` snapshot (which may trail by one batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PoolMetrics", "ReplicaStats", "SlotCounters"]


@dataclasses.dataclass(slots=True)
class SlotCounters:
    """Mutable per-slot counters (single writer: the slot's current worker thread)."""

    items: int = 0          # items this slot finished (ok or error)
    failed: int = 0         # of which errors
    batches: int = 0        # process() calls that returned, splits counted once
    split_batches: int = 0  # batches that raised and were retried item by item
    busy_s: float = 0.0     # wall time inside process()
    steals: int = 0         # items taken from other slots' deques
    restarts: int = 0       # times this slot's replica died and was rebuilt
    work_units: float = 0.0  # caller-defined units (e.g. audio seconds) of ok items
    last_done: float = 0.0  # perf_counter() when this slot last finished a batch


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaStats:
    """One replica slot's share of the work."""

    index: int
    alive: bool
    queued: int
    items: int
    failed: int
    batches: int
    busy_s: float
    steals: int
    restarts: int
    utilization: float  # busy_s / the pool's elapsed_s


@dataclasses.dataclass(frozen=True, slots=True)
class PoolMetrics:
    """A snapshot of a pool's counters.

    Attributes:
        elapsed_s: seconds from the first submit to the last finished item (or to now while
            items are outstanding); rates are per this span.
        submitted / done / failed / cancelled: item counts; ``done`` includes ``failed``,
            ``cancelled`` counts items no replica ran (cancelled, or no replica left).
        items_per_s: ``done / elapsed_s``.
        work_units / work_units_per_s: sum of ``work_units(item)`` over ok items (audio
            seconds for ASR, so ``work_units_per_s`` is audio-s/s, i.e. RTFx).
        queue_depth / max_queue_depth: items waiting in deques now / at most so far.
        steals: items a worker took from another replica's deque.
        restarts: replica rebuilds after a death.
        split_batches: batches that raised and were retried one item at a time.
        replicas: per-replica stats.
    """

    elapsed_s: float
    submitted: int
    done: int
    failed: int
    cancelled: int
    items_per_s: float
    work_units: float
    work_units_per_s: float
    queue_depth: int
    max_queue_depth: int
    steals: int
    restarts: int
    split_batches: int
    replicas: tuple[ReplicaStats, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able dict (for benchmark lines and logs)."""
        return dataclasses.asdict(self)
