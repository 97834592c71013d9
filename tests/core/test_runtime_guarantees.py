"""ReplicaPool guarantees that ``test_runtime_pool.py`` left unpinned, found by mutation testing
(each test fails when one line of ``runtime/pool.py`` or ``runtime/replica.py`` is broken):
restarts during a split retry, shutdown (a ``with`` block left on an exception, ``close``
timeouts, cancelled restart backoffs, items stranded by a death during close), replica
``close()``, cancelled futures, results of the wrong length and retiring after exactly
``max_start_failures`` rebuilds."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from polyaccel.core.runtime import CancelledError, ReplicaDied, ReplicaPool
from polyaccel.core.runtime.toy import ToyItem, ToyReplica

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_thread_leaks")]

_NAME = "polyaccel-guarantee"


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(_NAME)]


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


class DiesOnce(ToyReplica):
    """A ToyReplica whose batch dies (``ReplicaDied``) if no replica sharing ``died`` has died yet."""

    def __init__(self, index: int, died: threading.Event) -> None:
        super().__init__(index)
        self.died = died

    def process(self, batch):
        if not self.died.is_set():
            self.died.set()
            raise ReplicaDied("device lost")
        return super().process(batch)


class GatedToy(ToyReplica):
    """A ToyReplica that waits at a shared gate before each batch and logs what it ran."""

    def __init__(self, index: int, *, gate: threading.Event, log: list | None = None) -> None:
        super().__init__(index)
        self.gate, self.log = gate, log

    def process(self, batch):
        self.gate.wait()
        if self.log is not None:
            self.log.append([item.value for item in batch])
        return super().process(batch)


def _gated(gate: threading.Event, log: list | None = None, builds: list | None = None, fail_after: int = 0):
    """A factory of GatedToys that records its calls and fails from call ``fail_after + 1`` on."""
    def factory(index: int) -> GatedToy:
        if builds is not None:
            builds.append(index)
            if fail_after and len(builds) > fail_after:
                raise OSError("device gone for good")
        return GatedToy(index, gate=gate, log=log)
    return factory


# ---- deaths and restarts ---------------------------------------------------------------------

def test_a_replica_dying_during_the_item_by_item_retry_is_rebuilt():
    """A batch raises, its items are retried one at a time, and the replica dies on one of
    them: that is a replica death (rebuild, item re-run), not that item's error."""
    builds: list[int] = []
    died = threading.Event()

    class SplitThenDie(ToyReplica):
        def process(self, batch):
            if len(batch) > 1:
                raise ValueError("the batch as a whole fails")
            if batch[0].value == 1 and not died.is_set():
                died.set()
                raise ReplicaDied("device lost during the retry")
            return super().process(batch)

    def factory(index):
        builds.append(index)
        return SplitThenDie(index)

    with ReplicaPool(factory, 1, batch_size=2, restart_backoff_s=0.0, name=_NAME) as pool:
        with pool._lock:  # both items queued before the worker takes a batch (one batch of 2)
            futures = [pool.submit(ToyItem(i)) for i in range(2)]
        results = [f.result(timeout=5) for f in futures]
        m = pool.metrics()
    assert [r.value for r in results] == [0, 2] and all(r.ok for r in results), results
    assert [r.attempts for r in results] == [1, 2]
    assert m.restarts == 1 and builds == [0, 0] and m.split_batches == 0


def test_a_failing_item_alone_in_its_batch_is_run_once():
    """A batch of one that raises is that item's error at once: no second call of
    ``process()`` for the same item, and no split batch counted."""
    calls: list[list[int]] = []

    class Counting(ToyReplica):
        def process(self, batch):
            calls.append([item.value for item in batch])
            return super().process(batch)

    with ReplicaPool(Counting, 1, batch_size=4, name=_NAME) as pool:
        result = pool.submit(ToyItem(7, fail=True)).result(timeout=5)
        m = pool.metrics()
    assert isinstance(result.error, ValueError)
    assert calls == [[7]] and m.split_batches == 0 and m.failed == 1


def test_results_of_the_wrong_length_fail_the_items_without_killing_the_replica():
    """``process()`` returning fewer results than items is the items' error (naming the
    counts), never taken for a replica death (which rebuilds and reruns them)."""
    builds = itertools.count()

    def factory(index):
        next(builds)
        return lambda batch: batch[:-1]  # one result short

    with ReplicaPool(factory, 1, batch_size=1, name=_NAME) as pool:
        results = list(pool.map(range(3)))
        m = pool.metrics()
    assert all(isinstance(r.error, ValueError) and "returned 0 results for a batch of 1" in str(r.error)
               for r in results), results
    assert m.restarts == 0 and next(builds) == 1


def test_items_of_a_dead_replica_are_run_by_an_idle_one_while_it_is_rebuilt():
    """A restarting replica never holds work the others could do: the item in flight on a
    replica that died is run by the idle replica while the rebuild is still going on."""
    release = threading.Event()
    died = threading.Event()
    builds = itertools.count()

    def factory(index):
        if next(builds) >= 2:
            release.wait(10)  # a slow rebuild (loading and compiling a model again)
        return DiesOnce(index, died)

    pool = ReplicaPool(factory, 2, restart_backoff_s=0.0, name=_NAME)
    try:
        _wait_until(lambda: pool._idle == 2)  # white box: both workers are waiting for work
        result = pool.submit(ToyItem(5)).result(timeout=3)
        assert result.ok and result.value == 10 and result.attempts == 2
        assert not release.is_set()
    finally:
        release.set()
        pool.close()


def test_a_slot_is_retired_after_exactly_max_start_failures_rebuilds():
    """``max_start_failures`` bounds the factory calls for a dead slot: that many attempts,
    then the slot is retired (no extra model load)."""
    builds: list[int] = []

    def factory(index):
        builds.append(index)
        if len(builds) > 1:
            raise OSError("device gone for good")
        return ToyReplica(index)

    with ReplicaPool(factory, 1, max_start_failures=3, restart_backoff_s=0.0, name=_NAME) as pool:
        result = pool.submit(ToyItem(0, kill=True)).result(timeout=5)
        late = pool.submit(ToyItem(1)).result(timeout=5)
        m = pool.metrics()
    assert isinstance(result.error, ReplicaDied) and isinstance(late.error, ReplicaDied)
    assert len(builds) == 1 + 3
    assert not m.replicas[0].alive
    # Neither item was run to the end by a replica: both count as not run.
    assert (m.submitted, m.done, m.cancelled) == (2, 0, 2)


# ---- shutdown ----------------------------------------------------------------------------------

def test_leaving_the_with_block_on_an_exception_cancels_the_waiting_items():
    """An exception in the ``with`` block cancels what is still waiting (it does not run
    the whole queue first); the batch already running finishes."""
    gate = threading.Event()
    futures: list = []

    def open_gate_once_cancelled():
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not (futures and all(f.done() for f in futures[1:])):
            time.sleep(0.002)
        gate.set()

    opener = threading.Thread(target=open_gate_once_cancelled)
    with pytest.raises(KeyboardInterrupt):
        with ReplicaPool(_gated(gate), 1, queue_capacity=10, name=_NAME) as pool:
            futures.extend(pool.submit(ToyItem(i)) for i in range(5))
            _wait_until(lambda: pool.metrics().queue_depth == 4)
            opener.start()
            raise KeyboardInterrupt
    opener.join(5)
    assert futures[0].result(timeout=0).ok
    assert all(isinstance(f.result(timeout=0).error, CancelledError) for f in futures[1:])


def test_close_with_a_timeout_raises_while_a_replica_is_still_busy():
    """``close(timeout=...)`` raises ``TimeoutError`` when a worker is still running after
    that many seconds, instead of waiting for it."""
    gate = threading.Event()
    pool = ReplicaPool(_gated(gate), 1, name=_NAME)
    future = pool.submit(ToyItem(1))
    _wait_until(lambda: pool.metrics().queue_depth == 0)  # the replica holds it, at the gate
    raised: list = []

    def close():
        try:
            pool.close(timeout=0.1)
        except TimeoutError as e:
            raised.append(e)
        else:
            raised.append(None)

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(3)
    gate.set()
    closer.join(5)
    pool.close()
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError), raised
    assert future.result(timeout=0).value == 2


def test_close_cancel_pending_cuts_a_restart_backoff_short():
    """``close(cancel_pending=True)`` does not sit out the backoff between failed rebuilds."""
    builds: list[int] = []

    def factory(index):
        builds.append(index)
        if len(builds) > 1:
            raise OSError("device busy")
        return ToyReplica(index)

    pool = ReplicaPool(factory, 1, max_start_failures=5, restart_backoff_s=10.0, name=_NAME)
    future = pool.submit(ToyItem(0, kill=True))
    _wait_until(lambda: len(builds) == 2)  # the first rebuild failed: now in a 10 s backoff
    closer = threading.Thread(target=pool.close, kwargs={"cancel_pending": True})
    t0 = time.monotonic()
    closer.start()
    closer.join(3)
    assert not closer.is_alive() and time.monotonic() - t0 < 3
    assert isinstance(future.result(timeout=0).error, CancelledError)


def test_an_item_stranded_by_a_death_during_close_comes_back_as_an_error():
    """Draining close: the only other worker has already exited, a replica then dies with an
    item and cannot be rebuilt. ``close()`` returns and that item has a result (no replica
    left) rather than a future that never completes."""
    gate = threading.Event()
    builds: list[int] = []
    pool = ReplicaPool(_gated(gate, builds=builds, fail_after=2), 2, max_start_failures=1,
                       restart_backoff_s=0.0, name=_NAME)
    future = pool.submit(ToyItem(0, kill=True))
    _wait_until(lambda: pool.metrics().queue_depth == 0)  # one replica holds it, at the gate
    closer = threading.Thread(target=pool.close)
    closer.start()
    _wait_until(lambda: len(_pool_threads()) == 1)  # the idle worker saw the close and left
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    result = future.result(timeout=1)
    assert isinstance(result.error, ReplicaDied) and "no replica left" in str(result.error)
    assert len(builds) == 3


def test_a_replica_dying_during_a_cancelling_close_returns_its_items_as_cancelled():
    """``close(cancel_pending=True)`` while a batch runs and its replica dies: the batch's
    items are cancelled like the waiting ones, not rerun and not reported as dead replicas."""
    gate = threading.Event()
    builds: list[int] = []
    pool = ReplicaPool(_gated(gate, builds=builds), 1, restart_backoff_s=0.0, name=_NAME)
    futures = [pool.submit(ToyItem(0, kill=True)), pool.submit(ToyItem(1))]
    _wait_until(lambda: pool.metrics().queue_depth == 1)
    closer = threading.Thread(target=pool.close, kwargs={"cancel_pending": True})
    closer.start()
    _wait_until(futures[1].done)  # the waiting item is cancelled; the poison one is at the gate
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert all(isinstance(f.result(timeout=0).error, CancelledError) for f in futures), \
        [f.result(timeout=0) for f in futures]
    assert pool.metrics().cancelled == 2 and builds == [0]


def test_a_replica_dying_during_close_with_nothing_left_is_not_rebuilt():
    """A replica that dies while the pool closes, with no item left to run, is not rebuilt
    (the factory may load a model for minutes)."""
    gate = threading.Event()
    builds: list[int] = []
    pool = ReplicaPool(_gated(gate, builds=builds), 1, max_attempts=1, restart_backoff_s=0.0, name=_NAME)
    future = pool.submit(ToyItem(0, kill=True))
    _wait_until(lambda: pool.metrics().queue_depth == 0)
    closer = threading.Thread(target=pool.close)
    closer.start()
    _wait_until(lambda: pool.closed)
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert isinstance(future.result(timeout=0).error, ReplicaDied)
    assert builds == [0]


def test_every_replica_built_is_closed_once():
    """``close()`` of each replica runs: for a replica that died (before its successor is
    built) and for each live one when the pool closes."""
    built: list[object] = []
    closed: list[object] = []
    died = threading.Event()

    class Closable(DiesOnce):
        def close(self):
            closed.append(self)

    def factory(index):
        replica = Closable(index, died)
        built.append(replica)
        return replica

    with ReplicaPool(factory, 2, restart_backoff_s=0.0, name=_NAME) as pool:
        assert [r.value for r in pool.map(ToyItem(i) for i in range(6))] == [2 * i for i in range(6)]
    assert len(built) == 3
    assert sorted(map(id, closed)) == sorted(map(id, built))


def test_a_future_cancelled_while_waiting_is_never_run():
    """``Future.cancel()`` on an item still waiting in a deque: no replica runs it, and it
    counts as cancelled."""
    gate = threading.Event()
    log: list = []
    with ReplicaPool(_gated(gate, log=log), 1, name=_NAME) as pool:
        first = pool.submit(ToyItem(0))
        _wait_until(lambda: pool.metrics().queue_depth == 0)
        second = pool.submit(ToyItem(1))
        assert second.cancel()
        gate.set()
        assert first.result(timeout=5).ok
    assert log == [[0]]
    assert pool.metrics().cancelled == 1


def test_a_dead_replica_whose_close_raises_system_exit_still_gets_a_successor():
    """A dying replica is closed, then rebuilt; a ``close()`` that raises even ``SystemExit``
    (not an ``Exception``) is that replica's own failure: the successor still starts and the
    items still run (it once ended the slot's thread, and the pool waited for ever)."""
    builds: list[int] = []
    died = threading.Event()

    class ExitsOnClose(DiesOnce):
        def close(self):
            raise SystemExit(3)

    def factory(index):
        builds.append(index)
        return ExitsOnClose(index, died)

    with ReplicaPool(factory, 1, restart_backoff_s=0.0, name=_NAME) as pool:
        results = [f.result(timeout=5) for f in [pool.submit(ToyItem(i)) for i in range(3)]]
        m = pool.metrics()
    assert [r.value for r in results] == [0, 2, 4] and all(r.ok for r in results), results
    assert m.restarts == 1 and builds == [0, 0]
