"""The replica contract shared by :class:`ReplicaPool` and the baselines.

A *replica* is one copy of a model bound to one device slot (a CUDA stream or GPU, a
NeuronCore, a CPU thread). A *factory* builds replica ``i`` for slot ``i``; runtimes call it
in the thread (or process) that will drive the replica, so thread-local device state (the
current CUDA device, a stream, a NeuronCore binding) set up in the factory stays valid.

A replica is an object with ``process(batch: list[item]) -> Sequence[result]`` (one result
per item, same order) and optionally ``close()``; a plain callable taking the batch works
too. ``process`` may return an exception instance in place of a result to fail that item
alone, raise an ordinary exception to fail the batch (the runtime then retries the items
one by one, so one bad item does not fail its batch-mates), or raise :class:`ReplicaDied`
(or any ``BaseException`` that is not an ``Exception``) to say the replica itself is broken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from polyaccel.core.runtime.results import ReplicaDied

__all__ = ["Outcome", "Replica", "ReplicaFactory", "close_replica", "process_fn", "run_batch"]


class Replica(Protocol):
    """One model copy on one device slot."""

    def process(self, batch: list[Any]) -> Sequence[Any]:
        """Run a batch; return one result (or exception instance) per item, in order."""
        ...


ReplicaFactory = Callable[[int], Any]
"""``factory(replica_index) -> Replica`` (or a callable taking a batch)."""

Outcome = tuple[Any, BaseException | None]
"""``(value, None)`` or ``(None, error)`` for one item."""


def process_fn(replica: Any) -> Callable[[list[Any]], Sequence[Any]]:
    """The callable that runs a batch on ``replica``."""
    fn = getattr(replica, "process", replica)
    if not callable(fn):
        raise TypeError(f"a replica needs a process(batch) method or must be callable, got {replica!r}")
    return fn


def close_replica(replica: Any) -> None:
    """Call ``replica.close()`` if it has one; a failure there cannot hurt results any more.
    Even ``SystemExit`` is that replica's own failure: raised in a worker thread it would end
    the thread before the successor starts. Only Ctrl-C (``KeyboardInterrupt``) goes on."""
    close = getattr(replica, "close", None)
    if callable(close):
        try:
            close()
        except (Exception, SystemExit):  # noqa: S110 - the replica is being thrown away anyway
            pass


def _checked(values: Sequence[Any], n: int) -> Sequence[Any]:
    if len(values) != n:
        raise ValueError(f"process() returned {len(values)} results for a batch of {n} items")
    return values


def _outcome(value: Any) -> Outcome:
    return (None, value) if isinstance(value, BaseException) else (value, None)


def run_batch(process: Callable[[list[Any]], Sequence[Any]], items: list[Any],
              out: list[Outcome | None]) -> bool:
    """Run ``items`` as one batch, falling back to one item at a time if the batch raises.

    Fills ``out[j]`` with item ``j``'s outcome as soon as it is known, so a caller that sees
    :class:`ReplicaDied` (or another ``BaseException``) escape knows which items are still
    unresolved (``out[j] is None``). Returns True if the batch was split into single items.
    """
    try:
        values = _checked(list(process(items)), len(items))
    except ReplicaDied:
        raise
    except Exception as batch_error:
        if len(items) == 1:
            out[0] = (None, batch_error)
            return False
        for j, item in enumerate(items):
            try:
                (value,) = _checked(list(process([item])), 1)
            except ReplicaDied:
                raise
            except Exception as item_error:
                out[j] = (None, item_error)
            else:
                out[j] = _outcome(value)
        return True
    for j, value in enumerate(values):
        out[j] = _outcome(value)
    return False
