"""The two naive runtimes :class:`ReplicaPool` is benchmarked against.

Both take the same replica factory, ``batch_size`` and ``batch_key``, return the same
:class:`Result` records in input order, and retry a failing batch one item at a time, so
their results equal the pool's and only the speed differs. What they do the common way:

- :class:`ThreadedQueueBaseline`: N Python threads sharing one ``queue.Queue`` of batches.
- :class:`ProcessPoolBaseline`: one process per replica (``multiprocessing``, spawn context),
  a shared task queue and a result queue; items and results are pickled.

The calling thread cuts the input into batches (per ``batch_key``), keeps at most
``queue_capacity + num_replicas * batch_size`` items outstanding and puts results back in
order. Neither restarts a replica: a batch whose replica raises :class:`ReplicaDied` comes
back as errors. One ``map`` at a time per instance.
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from polyaccel.core.runtime.replica import Outcome, ReplicaFactory, close_replica, process_fn, run_batch
from polyaccel.core.runtime.results import ReplicaStartError, Result

__all__ = ["ProcessPoolBaseline", "ThreadedQueueBaseline"]

_Batch = list[tuple[int, Any]]  # (submission index, item)


def _batches(items: Iterable[Any], start: int, batch_size: int, batch_key: Callable[[Any], Hashable] | None,
             max_lag: int) -> Iterator[_Batch]:
    """Cut ``items`` into batches of one key; a partial batch is sent once it is ``max_lag``
    items older than the newest item, so the reorder buffer stays bounded."""
    partial: dict[Hashable, _Batch] = {}  # insertion order == order of each batch's first index
    for i, item in enumerate(items, start):
        key = batch_key(item) if batch_key is not None else None
        batch = partial.setdefault(key, [])
        batch.append((i, item))
        if len(batch) == batch_size:
            yield partial.pop(key)
        while partial:
            oldest_key, oldest = next(iter(partial.items()))
            if i - oldest[0][0] < max_lag:
                break
            yield partial.pop(oldest_key)
    yield from partial.values()


def _serve(factory: ReplicaFactory, index: int, tasks: Any, results: Any, portable: bool) -> None:
    """A baseline worker (thread or process): build replica ``index``, then run batches."""
    try:
        replica = factory(index)
        process = process_fn(replica)
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        results.put(("ready", index, _portable_error(error) if portable else error))
        return
    results.put(("ready", index, None))
    try:
        while (task := tasks.get()) is not None:
            batch_id, items = task
            if portable:
                items = pickle.loads(items)
            out: list[Outcome | None] = [None] * len(items)
            try:
                run_batch(process, items, out)
            except BaseException as error:  # noqa: BLE001 - the naive runtime just reports it
                out = [o if o is not None else (None, error) for o in out]
            results.put(("done", batch_id, index, _dumps_outcomes(out) if portable else out))
    finally:
        close_replica(replica)


def _portable_error(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _dumps_outcomes(out: list[Outcome]) -> bytes:
    try:
        return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        safe = []
        for value, error in out:
            try:
                pickle.dumps((value, error))
                safe.append((value, error))
            except Exception as pickling_error:
                safe.append((None, RuntimeError(f"result could not be pickled: {pickling_error!r}")))
        return pickle.dumps(safe, protocol=pickle.HIGHEST_PROTOCOL)


class _OrderedBaseline:
    """Batching, bounded outstanding work and in-order results, shared by both baselines."""

    def __init__(self, num_replicas: int, batch_size: int, batch_key: Callable[[Any], Hashable] | None,
                 queue_capacity: int) -> None:
        if num_replicas < 1 or batch_size < 1 or queue_capacity < 1:
            raise ValueError("num_replicas, batch_size and queue_capacity must be >= 1")
        self._n = num_replicas
        self._batch_size = batch_size
        self._batch_key = batch_key
        self._window = queue_capacity + num_replicas * batch_size
        self._submitted = 0
        self._batch_ids = itertools.count()
        self._closed = False

    # subclasses: send a batch; receive (batch_id, replica, outcomes) or None when nothing is ready
    def _put(self, batch_id: int, items: list[Any]) -> None:
        raise NotImplementedError

    def _get(self, block: bool) -> tuple[int, int, list[Outcome]] | None:
        raise NotImplementedError

    def map(self, items: Iterable[Any]) -> Iterator[Result]:
        """Run ``items`` through the replicas; yield their :class:`Result`s in input order."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        outstanding: dict[int, _Batch] = {}
        ready: dict[int, Result] = {}
        held = 0  # items sent and not yet yielded
        next_out = self._submitted

        def absorb(block: bool) -> bool:
            message = self._get(block)
            if message is None:
                return False
            batch_id, replica, outcomes = message
            for (i, item), (value, error) in zip(outstanding.pop(batch_id, ()), outcomes):
                ready[i] = Result(i, item, value, error, replica)
            return True

        def in_order() -> Iterator[Result]:
            nonlocal next_out, held
            while next_out in ready:
                held -= 1
                next_out += 1
                yield ready.pop(next_out - 1)

        for batch in _batches(self._counting(items), self._submitted, self._batch_size, self._batch_key,
                              max(1, self._window // 2)):
            while held >= self._window:
                absorb(block=True)
                yield from in_order()
            batch_id = next(self._batch_ids)
            outstanding[batch_id] = batch
            held += len(batch)
            self._put(batch_id, [item for _, item in batch])
            while absorb(block=False):
                pass
            yield from in_order()
        while outstanding:
            absorb(block=True)
            yield from in_order()
        yield from in_order()

    def _counting(self, items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            self._submitted += 1
            yield item

    def _wait_ready(self, get_message: Callable[[], tuple]) -> None:
        errors = []
        for _ in range(self._n):
            _, index, error = get_message()
            if error is not None:
                errors.append((index, error))
        if errors:
            self.close()
            index, error = min(errors, key=lambda e: e[0])
            raise ReplicaStartError(f"replica {index} failed to start: {error!r}") from error

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> _OrderedBaseline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ThreadedQueueBaseline(_OrderedBaseline):
    """N Python threads sharing one ``queue.Queue`` of batches: the naive threaded runtime.

    Same arguments as :class:`ReplicaPool` (factory called in each thread with its index).
    """

    def __init__(self, replica_factory: ReplicaFactory, num_replicas: int, *, batch_size: int = 1,
                 batch_key: Callable[[Any], Hashable] | None = None, queue_capacity: int = 1024) -> None:
        super().__init__(num_replicas, batch_size, batch_key, queue_capacity)
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=_serve, name=f"polyaccel-baseline-{i}", daemon=True,
                                          args=(replica_factory, i, self._tasks, self._results, False))
                         for i in range(num_replicas)]
        for thread in self._threads:
            thread.start()
        self._wait_ready(self._results.get)

    def _put(self, batch_id: int, items: list[Any]) -> None:
        self._tasks.put((batch_id, items))

    def _get(self, block: bool) -> tuple[int, int, list[Outcome]] | None:
        try:
            _, batch_id, replica, outcomes = self._results.get(block)
        except queue.Empty:
            return None
        return batch_id, replica, outcomes

    def close(self) -> None:
        """Stop the threads after the batches already queued; join them."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join()


class ProcessPoolBaseline(_OrderedBaseline):
    """One process per replica (spawn context); items and results pickled: the multi-process runtime.

    The factory must be picklable (a module-level function or a ``functools.partial`` of
    one); each process calls it with its replica index. A process that dies makes ``map``
    raise ``RuntimeError`` (the naive runtime does not recover).
    """

    def __init__(self, replica_factory: ReplicaFactory, num_replicas: int, *, batch_size: int = 1,
                 batch_key: Callable[[Any], Hashable] | None = None, queue_capacity: int = 1024,
                 start_method: str = "spawn") -> None:
        super().__init__(num_replicas, batch_size, batch_key, queue_capacity)
        ctx = multiprocessing.get_context(start_method)
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_serve, args=(replica_factory, i, self._tasks, self._results, True),
                                   name=f"polyaccel-baseline-{i}", daemon=True)
                       for i in range(num_replicas)]
        for proc in self._procs:
            proc.start()
        try:
            self._wait_ready(lambda: self._get_message(block=True))
        except BaseException:
            self.close()
            raise

    def _get_message(self, block: bool) -> tuple | None:
        while True:
            try:
                return self._results.get(block, timeout=0.5 if block else None)
            except queue.Empty:
                if not block:
                    return None
            dead = [p for p in self._procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"baseline process {dead[0].name} died (exit code {dead[0].exitcode})")

    def _put(self, batch_id: int, items: list[Any]) -> None:
        self._tasks.put((batch_id, pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)))

    def _get(self, block: bool) -> tuple[int, int, list[Outcome]] | None:
        message = self._get_message(block)
        if message is None:
            return None
        _, batch_id, replica, payload = message
        try:
            outcomes = pickle.loads(payload)
        except Exception as error:
            outcomes = itertools.repeat((None, RuntimeError(f"result could not be unpickled: {error!r}")))
        return batch_id, replica, outcomes

    def close(self, timeout: float = 30.0) -> None:
        """Stop the processes after the batches already queued; join (or terminate) them."""
        if self._closed:
            return
        self._closed = True
        for _ in self._procs:
            self._tasks.put(None)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            while proc.is_alive() and time.monotonic() < deadline:
                # A child cannot exit while its result queue holds unread data: keep reading.
                try:
                    self._results.get(timeout=0.05)
                except queue.Empty:
                    pass
                proc.join(0.05)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        self._tasks.close()
        self._results.close()
        self._tasks.join_thread()
        self._results.join_thread()
