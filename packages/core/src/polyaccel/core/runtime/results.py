"""What a runtime hands back per item, and the errors it can put in it."""

from __future__ import annotations

import dataclasses
from concurrent.futures import CancelledError
from typing import Any

__all__ = ["CancelledError", "PoolClosed", "ReplicaDied", "ReplicaStartError", "Result"]


class ReplicaDied(RuntimeError):
    """A replica is broken and must be rebuilt (device lost, runtime in a bad state).

    Raise it from ``process()`` to make the pool discard the replica, call the factory again
    and re-run the batch's items elsewhere. The pool also puts it in a :class:`Result` for an
    item that was in flight on too many replicas that died (a poison item).
    """


class ReplicaStartError(RuntimeError):
    """The replica factory failed while the pool was starting; ``__cause__`` says why."""


class PoolClosed(RuntimeError):
    """``submit()`` was called on a pool that is closing or closed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """The outcome of one item: its value, or the error that stopped it (never both).

    Attributes:
        index: the item's submission number (0, 1, 2, ... over the runtime's life).
        item: the item itself, so a consumer of a stream knows what the result is for.
        value: what the replica returned for the item (``None`` when ``error`` is set).
        error: the exception for this item only, or ``None``. Cancelled items carry a
            :class:`concurrent.futures.CancelledError`.
        replica: index of the replica that produced the result (``None`` if none ran it).
        attempts: how many replicas the item was in flight on (1 unless replicas died).
    """

    index: int
    item: Any
    value: Any = None
    error: BaseException | None = None
    replica: int | None = None
    attempts: int = 1

    @property
    def ok(self) -> bool:
        """True when the item succeeded."""
        return self.error is None

    def unwrap(self) -> Any:
        """The value, or raise the item's error."""
        if self.error is not None:
            raise self.error
        return self.value
