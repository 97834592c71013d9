"""ReplicaPool: N replicas, one worker thread each, per-replica deques with work stealing.

Submission pushes each item onto one replica's deque (round-robin over live replicas) and
blocks while ``queue_capacity`` items are waiting (backpressure). A worker takes a batch from
the head of its own deque (oldest first); when its deque is empty it steals from the tail of
the busiest other deque, and it tops a short batch up from other deques' tails, so a slow or
restarting replica never holds work the others could do. Results come back as :class:`Result`
records: ``submit()`` returns a ``concurrent.futures.Future`` per item, while
:meth:`ReplicaPool.map` collects a whole stream through one lock-protected buffer (one lock
round and at most one wake-up per batch, no per-item Future: per-item container objects
cost garbage-collector time in a process that holds a large model) and yields in submission
order with a bounded window.

Failures are per item. A batch whose ``process()`` raises is retried one item at a time on
the same replica. A replica that raises :class:`ReplicaDied` (or any ``BaseException`` that
is not an ``Exception``) is closed and rebuilt by a new worker thread that calls the factory
again; the items it had in flight go back to the head of its deque to be run alone, and an
item that has been in flight on ``max_attempts`` dead replicas comes back as an error, so a
poison item cannot loop forever. A slot whose factory keeps failing is retired; when none is
left, waiting and new items come back as errors instead of hanging.

Thread safety. One lock guards every deque, the queued-item count, the round-robin cursor,
the table of worker threads and the lifecycle flags; two conditions on it wake workers
(``_has_work``) and blocked submitters (``_not_full``), so nothing busy-waits. An idle
worker is woken per batch's worth of queued items, not per item, and a woken worker that
leaves items behind wakes the next (``_wake``). The lock is held only for O(batch)
bookkeeping, never while calling the factory, ``process()``, ``batch_key``/``work_units`` or
while delivering results, so done-callbacks run unlocked. A map stream's buffer has its own
lock, never taken together with the pool lock.
A task removed from a deque under the lock belongs to exactly one worker until it is
resolved or put back, so no item runs twice at once; a dying worker puts its unresolved
items back and closes its replica before it starts its successor. Per-slot counters have a
single writer (the slot's current thread; a successor starts after its predecessor's last
write), so :meth:`ReplicaPool.metrics` reads them without a lock. Lock order is pool lock
then a future's own lock (``set_running_or_notify_cancel`` under the pool lock), never the
reverse. The lock is an RLock only because ``Condition`` checks ownership of one in C.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import CancelledError, Future, InvalidStateError
from typing import Any

from polyaccel.core.runtime.metrics import PoolMetrics, ReplicaStats, SlotCounters
from polyaccel.core.runtime.replica import Outcome, ReplicaFactory, close_replica, process_fn, run_batch
from polyaccel.core.runtime.results import PoolClosed, ReplicaDied, ReplicaStartError, Result

__all__ = ["ReplicaPool"]

_SOLO = object()  # batch key of items re-run alone after a replica died with them in flight


def _cancelled(task: _Task) -> Result:
    return Result(task.index, task.item, error=CancelledError("cancelled by close()"))


class _Task:
    """One submitted item and its bookkeeping."""

    __slots__ = ("index", "item", "future", "stream", "key", "units", "deaths", "started")

    def __init__(self, index: int, item: Any, future: Future | None, stream: _Stream | None,
                 key: Hashable, units: float) -> None:
        self.index = index
        self.item = item
        self.future = future   # submit(): the caller's Future ...
        self.stream = stream   # ... or map(): the stream that collects the result
        self.key = key
        self.units = units
        self.deaths = 0        # replicas that died with this item in flight
        self.started = False   # taken by a worker once (its Future moved to RUNNING)


class _Stream:
    """The results of one ``map()`` call, by submission index. Has its own lock."""

    __slots__ = ("cond", "results", "waiting_for", "cancelled")

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.results: dict[int, Result] = {}
        self.waiting_for = -1   # the index the consumer is blocked on, -1 if none
        self.cancelled = False  # the consumer is gone: drop its waiting items

    def put(self, results: list[Result]) -> None:
        with self.cond:
            for result in results:
                self.results[result.index] = result
            if self.waiting_for in self.results:
                self.waiting_for = -1
                self.cond.notify()

    def take(self, index: int) -> Result:
        with self.cond:
            while index not in self.results:
                self.waiting_for = index
                self.cond.wait()
            return self.results.pop(index)


class _SlotDeque:
    """One replica's waiting tasks: a FIFO per batch key. Guarded by the pool lock."""

    __slots__ = ("fifos", "count")

    def __init__(self) -> None:
        self.fifos: dict[Hashable, deque[_Task]] = {}
        self.count = 0

    def push(self, task: _Task, *, front: bool = False) -> None:
        fifo = self.fifos.get(task.key)
        if fifo is None:
            fifo = self.fifos[task.key] = deque()
        if front:
            fifo.appendleft(task)
        else:
            fifo.append(task)
        self.count += 1

    def take(self, key: Hashable, n: int, *, from_tail: bool) -> list[_Task]:
        fifo = self.fifos[key]
        n = min(n, len(fifo))
        pop = fifo.pop if from_tail else fifo.popleft
        got = [pop() for _ in range(n)]
        if not fifo:
            del self.fifos[key]
        self.count -= n
        return got

    def oldest_key(self) -> Hashable:
        return min(self.fifos, key=lambda k: self.fifos[k][0].index)

    def largest_key(self) -> Hashable:
        return max(self.fifos, key=lambda k: len(self.fifos[k]))

    def drain(self) -> list[_Task]:
        tasks = [t for fifo in self.fifos.values() for t in fifo]
        self.fifos.clear()
        self.count = 0
        return tasks


class ReplicaPool:
    """Run items through N replicas, one worker thread each, with work stealing.

    Args:
        replica_factory: ``factory(i) -> replica`` for slot ``i``; called in slot ``i``'s own
            worker thread (again after a death). See :mod:`polyaccel.core.runtime.replica`.
        num_replicas: number of replicas and worker threads.
        queue_capacity: most items waiting in deques; ``submit``/``map`` block beyond it.
            Items put back after a replica death may exceed it by one batch per dying replica.
        batch_size: most items per ``process()`` call. A worker takes what is queued (up to
            this), it does not wait for a batch to fill.
        batch_key: ``key(item) -> hashable``; items in one batch share a key (e.g. a
            duration bucket). Called on the submitting thread.
        work_units: ``units(item) -> float`` summed over ok items into the metrics (audio
            seconds, tokens). Called on the submitting thread.
        max_attempts: replicas an item may be in flight on when they die before it comes
            back as a :class:`ReplicaDied` error.
        max_start_failures: consecutive factory failures after which a dead slot is retired.
        restart_backoff_s: first delay between failed rebuilds (doubles each time).
        parallel_start: build replicas concurrently (False: one factory call at a time, for
            factories that compile or capture graphs and must not overlap).
        name: prefix of the worker thread names.

    The constructor returns once every replica is built; if a factory raises, the pool is
    closed and :class:`ReplicaStartError` is raised from that error. Interrupted (Ctrl-C) while
    replicas are built, it closes the pool (waiting for the factories running) and re-raises.
    """

    def __init__(self, replica_factory: ReplicaFactory, num_replicas: int, *,
                 queue_capacity: int = 1024, batch_size: int = 1,
                 batch_key: Callable[[Any], Hashable] | None = None,
                 work_units: Callable[[Any], float] | None = None,
                 max_attempts: int = 3, max_start_failures: int = 3,
                 restart_backoff_s: float = 0.05, parallel_start: bool = True,
                 name: str = "polyaccel-replica") -> None:
        if num_replicas < 1 or queue_capacity < 1 or batch_size < 1 or max_attempts < 1:
            raise ValueError("num_replicas, queue_capacity, batch_size and max_attempts must be >= 1")
        self._factory = replica_factory
        self._n = num_replicas
        self._capacity = queue_capacity
        self._batch_size = batch_size
        self._batch_key = batch_key
        self._work_units = work_units
        self._max_attempts = max_attempts
        self._max_start_failures = max(1, max_start_failures)
        self._restart_backoff_s = restart_backoff_s
        self._start_lock = contextlib.nullcontext() if parallel_start else threading.Lock()
        self._name = name

        self._lock = threading.RLock()
        self._has_work = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._ready = threading.Condition(self._lock)
        self._stop = threading.Event()  # set by close(cancel_pending=True): cut restart backoffs short

        self._deques = [_SlotDeque() for _ in range(num_replicas)]
        self._counters = [SlotCounters() for _ in range(num_replicas)]
        self._alive = [True] * num_replicas
        self._live = num_replicas
        self._threads: list[threading.Thread | None] = [None] * num_replicas
        self._generation = [0] * num_replicas
        self._queued = 0
        self._max_queued = 0
        self._idle = 0      # workers waiting in _has_work
        self._wakeups = 0   # of which notified and not yet running
        self._submitted = 0
        self._not_run = 0
        self._t_first: float | None = None
        self._rr = 0
        self._closing = False
        self._cancelling = False
        self._broken: BaseException | None = None  # why no replica is left
        self._started = 0
        self._start_errors: list[tuple[int, BaseException]] = []

        try:
            with self._lock:
                for slot in range(num_replicas):
                    self._spawn(slot, first=True)
                while self._started < num_replicas:
                    self._ready.wait()
                errors = list(self._start_errors)
        except BaseException:  # Ctrl-C while replicas load: close the built ones, end every thread
            self.close(cancel_pending=True)
            raise
        if errors:
            self.close(cancel_pending=True)
            slot, error = min(errors, key=lambda e: e[0])
            raise ReplicaStartError(f"replica {slot} failed to start: {error!r}") from error

    # ---- submitting ----------------------------------------------------------------
    def submit(self, item: Any) -> Future:
        """Queue one item; block while the queue is full. Returns a Future of its :class:`Result`.

        The future's ``result()`` never raises for an item failure: the error is in the
        :class:`Result`. Raises :class:`PoolClosed` if the pool is closing.
        """
        future: Future = Future()
        self._enqueue(item, future, None)
        return future

    def map(self, items: Iterable[Any], *, window: int | None = None) -> Iterator[Result]:
        """Submit ``items`` and yield their :class:`Result`s in input order, as they finish.

        At most ``window`` items (default ``queue_capacity + num_replicas * batch_size``) are
        held between being read from ``items`` and being yielded, so memory stays bounded on
        an endless input. While one slow item holds the head of the stream, the others can
        run at most ``window`` items ahead. Items still waiting when the iterator is dropped
        are cancelled.
        """
        window = window or self._capacity + self._n * self._batch_size
        stream = _Stream()
        pending: deque[int] = deque()
        try:
            for item in items:
                pending.append(self._enqueue(item, None, stream))
                while pending and (len(pending) >= window or pending[0] in stream.results):
                    yield stream.take(pending.popleft())
            while pending:
                yield stream.take(pending.popleft())
        finally:
            stream.cancelled = True

    def _enqueue(self, item: Any, future: Future | None, stream: _Stream | None) -> int:
        """Put one item on a deque (blocking while full); its submission index."""
        key = self._batch_key(item) if self._batch_key is not None else None
        units = float(self._work_units(item)) if self._work_units is not None else 0.0
        with self._lock:
            while self._queued >= self._capacity and not self._closing and self._broken is None:
                self._not_full.wait()
            if self._closing:
                raise PoolClosed("submit() on a ReplicaPool that is closing or closed")
            task = _Task(self._submitted, item, future, stream, key, units)
            self._submitted += 1
            if self._t_first is None:
                self._t_first = time.perf_counter()
            if self._broken is None:
                self._deques[self._next_slot()].push(task)
                self._queued += 1
                if self._queued > self._max_queued:
                    self._max_queued = self._queued
                self._wake()
                return task.index
            self._not_run += 1
        self._deliver([(task, Result(task.index, item, error=self._no_replica_error()))])
        return task.index

    # ---- lifecycle -----------------------------------------------------------------
    def close(self, *, cancel_pending: bool = False, timeout: float | None = None) -> None:
        """Stop accepting items, finish (or cancel) the queued ones and join every thread.

        With ``cancel_pending`` the waiting items come back as errors holding a
        :class:`concurrent.futures.CancelledError`; batches already running still finish.
        Raises ``TimeoutError`` if threads are still running after ``timeout`` seconds.
        Safe to call twice. Called from a worker thread, it does not wait for that thread.
        """
        with self._lock:
            self._closing = True
            cancelled: list[_Task] = []
            if cancel_pending and not self._cancelling:
                self._cancelling = True
                cancelled = self._drain_all()
            self._has_work.notify_all()
            self._not_full.notify_all()
        if cancel_pending:
            self._stop.set()
        self._deliver([(task, _cancelled(task)) for task in cancelled])
        self._join(timeout)
        if threading.current_thread() not in self._threads:
            # Every worker has exited; anything still queued (a replica died while draining
            # and could not be rebuilt) has nobody left to run it.
            with self._lock:
                leftovers = self._drain_all()
            self._deliver([(t, Result(t.index, t.item, error=self._no_replica_error())) for t in leftovers])

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(cancel_pending=exc_type is not None)

    @property
    def num_replicas(self) -> int:
        return self._n

    @property
    def closed(self) -> bool:
        return self._closing

    def __repr__(self) -> str:
        return (f"<ReplicaPool replicas={self._n} live={self._live} batch_size={self._batch_size} "
                f"queued={self._queued}{' closed' if self._closing else ''}>")

    # ---- metrics -------------------------------------------------------------------
    def metrics(self) -> PoolMetrics:
        """A snapshot of throughput, queue depth, steals, restarts and per-replica busy time."""
        with self._lock:
            submitted, not_run, t_first = self._submitted, self._not_run, self._t_first
            queued, max_queued = self._queued, self._max_queued
            depths = [d.count for d in self._deques]
            alive = list(self._alive)
        now = time.perf_counter()
        cs = self._counters
        done = sum(c.items for c in cs)
        if t_first is None:
            elapsed = 0.0
        else:
            end = now if submitted > done + not_run else max([c.last_done for c in cs] + [t_first])
            elapsed = max(end - t_first, 1e-9)
        rate = (lambda x: x / elapsed) if elapsed > 0 else (lambda x: 0.0)
        units = sum(c.work_units for c in cs)
        replicas = tuple(
            ReplicaStats(index=i, alive=alive[i], queued=depths[i], items=c.items, failed=c.failed,
                         batches=c.batches, busy_s=c.busy_s, steals=c.steals, restarts=c.restarts,
                         utilization=rate(c.busy_s))
            for i, c in enumerate(cs))
        return PoolMetrics(
            elapsed_s=elapsed, submitted=submitted, done=done, failed=sum(c.failed for c in cs),
            cancelled=not_run, items_per_s=rate(done), work_units=units, work_units_per_s=rate(units),
            queue_depth=queued, max_queue_depth=max_queued, steals=sum(c.steals for c in cs),
            restarts=sum(c.restarts for c in cs), split_batches=sum(c.split_batches for c in cs),
            replicas=replicas)

    # ---- worker threads ------------------------------------------------------------
    def _spawn(self, slot: int, *, first: bool) -> None:
        """Start slot's worker thread (lock held)."""
        gen = self._generation[slot]
        self._generation[slot] += 1
        thread = threading.Thread(target=self._worker, args=(slot, first), daemon=True,
                                  name=f"{self._name}-{slot}" + (f".{gen}" if gen else ""))
        self._threads[slot] = thread
        try:
            thread.start()
        except RuntimeError:  # no thread left to start ("can't start new thread"): none to join
            self._threads[slot] = None
            raise
        except BaseException:  # Ctrl-C inside start(): the thread most likely runs; keep it to join
            if not _started_soon(thread):
                self._threads[slot] = None
            raise

    def _worker(self, slot: int, first: bool) -> None:
        """A worker thread: build the replica, then serve batches until closed or dead."""
        replica = self._build(slot, first)
        if replica is None:
            return
        process = process_fn(replica)
        counters = self._counters[slot]
        batch: list[_Task] = []
        out: list[Outcome | None] = []
        try:
            while True:
                with self._lock:
                    while not self._queued and not self._closing:
                        self._idle += 1
                        self._has_work.wait()
                        self._idle -= 1
                        if self._wakeups:
                            self._wakeups -= 1
                    if not self._queued:
                        break
                    batch = self._take_batch(slot)
                    out = [None] * len(batch)
                if not batch:
                    continue
                t0 = time.perf_counter()
                try:
                    split = run_batch(process, [t.item for t in batch], out)
                finally:
                    counters.busy_s += time.perf_counter() - t0
                self._finish(slot, batch, out, split)
                batch, out = [], []
        except BaseException as death:  # noqa: BLE001 - any escape means this replica is gone
            self._on_death(slot, replica, batch, out, death)
            return
        close_replica(replica)

    def _build(self, slot: int, first: bool) -> Any | None:
        """Call the factory for ``slot``; retry with backoff on restarts; None if giving up."""
        failures = 0
        while True:
            if not first:
                with self._lock:
                    if self._cancelling or (self._closing and not self._queued):
                        return None
            try:
                with self._start_lock:
                    replica = self._factory(slot)
                process_fn(replica)
            except BaseException as error:  # noqa: BLE001 - a factory failure is reported, not raised here
                if first:
                    with self._lock:
                        self._start_errors.append((slot, error))
                        self._alive[slot] = False
                        self._live -= 1
                        self._started += 1
                        self._ready.notify_all()
                    return None
                failures += 1
                if failures >= self._max_start_failures:
                    self._retire(slot, error)
                    return None
                if self._stop.wait(self._restart_backoff_s * 2 ** (failures - 1)):
                    return None
                continue
            if first:
                with self._lock:
                    self._started += 1
                    self._ready.notify_all()
            return replica

    def _take_batch(self, slot: int) -> list[_Task]:
        """Up to batch_size same-key tasks: own head first, else steal from the busiest tail."""
        n = self._batch_size
        own = self._deques[slot]
        stolen = 0
        if own.count:
            key = own.oldest_key()
            taken = own.take(key, 1 if key is _SOLO else n, from_tail=False)
        else:
            victim = max(self._deques, key=lambda d: d.count)
            key = victim.largest_key()
            taken = victim.take(key, 1 if key is _SOLO else n, from_tail=True)
            stolen = len(taken)
        if key is not _SOLO and len(taken) < n:
            for other in sorted(self._deques, key=lambda d: d.count, reverse=True):
                if other is own or key not in other.fifos:
                    continue
                got = other.take(key, n - len(taken), from_tail=True)
                taken += got
                stolen += len(got)
                if len(taken) == n:
                    break
        self._counters[slot].steals += stolen
        self._queued -= len(taken)
        self._not_full.notify(len(taken))
        self._wake()
        batch = []
        for task in taken:
            if task.started or (task.future.set_running_or_notify_cancel() if task.future is not None
                                else not task.stream.cancelled):
                task.started = True
                batch.append(task)
            else:  # the caller cancelled it (or dropped its map stream) while it waited
                self._not_run += 1
        return batch

    def _finish(self, slot: int, batch: list[_Task], out: list[Outcome | None], split: bool) -> None:
        """Count a finished batch, then hand out its results."""
        c = self._counters[slot]
        c.batches += 1
        c.split_batches += split
        for task, outcome in zip(batch, out):
            c.items += 1
            if outcome[1] is None:
                c.work_units += task.units
            else:
                c.failed += 1
        c.last_done = time.perf_counter()
        self._deliver([(task, Result(task.index, task.item, value, error, slot, task.deaths + 1))
                       for task, (value, error) in zip(batch, out)])

    def _on_death(self, slot: int, replica: Any, batch: list[_Task], out: list[Outcome | None],
                  death: BaseException) -> None:
        """Re-queue (or fail) the dead replica's unresolved items, close it, start a successor."""
        c = self._counters[slot]
        c.restarts += 1
        done: list[tuple[_Task, Result]] = []
        requeue: list[_Task] = []
        for j, task in enumerate(batch):
            if task.future is not None and task.future.done():
                continue
            outcome = out[j] if j < len(out) else None
            attempts = task.deaths + 1
            if outcome is None:
                task.deaths = attempts
                if attempts < self._max_attempts:
                    task.key = _SOLO
                    requeue.append(task)
                    continue
                error = ReplicaDied(f"item {task.index} was in flight on {attempts} replicas "
                                    f"that died (last: {death!r})")
                error.__cause__ = death
                outcome = (None, error)
            c.items += 1
            c.failed += outcome[1] is not None
            done.append((task, Result(task.index, task.item, outcome[0], outcome[1], slot, attempts)))
        c.last_done = time.perf_counter()
        with self._lock:
            if self._cancelling:
                self._not_run += len(requeue)
                cancelled, requeue = requeue, []
            else:
                cancelled = []
                for task in reversed(requeue):
                    self._deques[slot].push(task, front=True)
                self._queued += len(requeue)
                self._max_queued = max(self._max_queued, self._queued)
                while self._wake():
                    pass
        self._deliver(done + [(task, _cancelled(task)) for task in cancelled])
        close_replica(replica)
        try:
            with self._lock:
                self._spawn(slot, first=False)
        except RuntimeError as error:  # no thread left for a successor: the slot is gone
            self._retire(slot, error)

    def _retire(self, slot: int, error: BaseException) -> None:
        """Give up on a slot whose factory keeps failing; fail everything if none is left."""
        with self._lock:
            self._alive[slot] = False
            self._live -= 1
            orphans: list[_Task] = []
            if self._live == 0:
                self._broken = error
                orphans = self._drain_all()
                self._not_full.notify_all()
        self._deliver([(t, Result(t.index, t.item, error=self._no_replica_error())) for t in orphans])

    # ---- helpers ---------------------------------------------------------------------
    def _next_slot(self) -> int:
        """Round-robin over live slots (lock held; at least one is live)."""
        for _ in range(self._n):
            slot = self._rr
            self._rr = (slot + 1) % self._n
            if self._alive[slot]:
                return slot
        return self._rr

    def _drain_all(self) -> list[_Task]:
        """Remove every waiting task (lock held)."""
        tasks = [t for d in self._deques for t in d.drain()]
        self._queued = 0
        self._not_run += len(tasks)
        self._not_full.notify_all()
        return tasks

    def _no_replica_error(self) -> ReplicaDied:
        error = ReplicaDied("no replica left: every replica died and could not be rebuilt")
        error.__cause__ = self._broken
        return error

    def _wake(self) -> bool:
        """Wake one idle worker if a batch's worth of queued items has none coming (lock held)."""
        if self._idle > self._wakeups and self._queued > self._wakeups * self._batch_size:
            self._wakeups += 1
            self._has_work.notify()
            return True
        return False

    @staticmethod
    def _deliver(pairs: list[tuple[_Task, Result]]) -> None:
        """Hand results to their futures or map streams (pool lock not held)."""
        streams: dict[_Stream, list[Result]] = {}
        for task, result in pairs:
            if task.future is not None:
                with contextlib.suppress(InvalidStateError):
                    task.future.set_result(result)
            else:
                streams.setdefault(task.stream, []).append(result)
        for stream, results in streams.items():
            stream.put(results)

    def _join(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.current_thread()
        while True:
            with self._lock:
                threads = [t for t in self._threads if t is not None and t is not me]
            for thread in threads:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            with self._lock:
                if all(t is None or t is me or not t.is_alive() for t in self._threads):
                    return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"replica threads still running {timeout} s after close()")


def _started_soon(thread: threading.Thread, wait_s: float = 5.0) -> bool:
    """Whether ``thread``, whose ``start()`` was interrupted, can be joined within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            thread.join(0)  # raises while the thread has not started
            return True
        except RuntimeError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
