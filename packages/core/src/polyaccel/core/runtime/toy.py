"""A toy replica for tests, docs and runtime benchmarks.

It lives in the package (not in a test file) so that spawned processes can import it:
``functools.partial(ToyReplica, speeds={0: 0.1})`` is a picklable factory.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from polyaccel.core.runtime.results import ReplicaDied

__all__ = ["ToyItem", "ToyReplica"]


@dataclasses.dataclass(frozen=True, slots=True)
class ToyItem:
    """One unit of toy work.

    Attributes:
        value: the replica returns ``2 * value``.
        seconds: simulated device time this item adds to its batch.
        fail: the batch raises ``ValueError`` (the item alone then fails on retry).
        kill: the replica raises :class:`ReplicaDied` for any batch holding it (a poison item).
        units: work units (e.g. audio seconds) for the metrics.
    """

    value: float
    seconds: float = 0.0
    fail: bool = False
    kill: bool = False
    units: float = 1.0


class ToyReplica:
    """Doubles values after sleeping for the batch's simulated device time.

    ``time.sleep`` releases the GIL like a device call (a CUDA sync, ``nrt_execute``), so
    replicas overlap the way device replicas do. A batch takes
    ``(batch_overhead_s + sum(item.seconds)) / speed`` seconds; ``speeds`` maps a replica
    index to its own speed (to make one replica slow).
    """

    def __init__(self, index: int, *, speed: float = 1.0, speeds: dict[int, float] | None = None,
                 batch_overhead_s: float = 0.0) -> None:
        self.index = index
        self.speed = (speeds or {}).get(index, speed)
        self.batch_overhead_s = batch_overhead_s

    def process(self, batch: list[ToyItem]) -> list[Any]:
        """``[2 * item.value for item in batch]``, after the simulated device time."""
        if any(item.kill for item in batch):
            raise ReplicaDied(f"toy replica {self.index} was killed by a poison item")
        time.sleep((self.batch_overhead_s + sum(item.seconds for item in batch)) / self.speed)
        bad = [item.value for item in batch if item.fail]
        if bad:
            raise ValueError(f"bad toy items {bad}")
        return [2 * item.value for item in batch]
