"""ReplicaPool: work stealing, order, per-item errors, restarts, poison items, backpressure,
shutdown and metrics. Replicas are ToyReplicas whose device time is a GIL-releasing sleep."""

from __future__ import annotations

import functools
import itertools
import json
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polyaccel.core.runtime import (
    CancelledError,
    PoolClosed,
    ReplicaDied,
    ReplicaPool,
    ReplicaStartError,
)
from polyaccel.core.runtime.toy import ToyItem, ToyReplica

pytestmark = pytest.mark.timeout(60)


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("polyaccel-replica")}


@pytest.fixture(autouse=True)
def no_thread_leaks():
    """Every test also checks that the pools it made left no worker thread behind."""
    before = _pool_threads()
    yield
    assert _pool_threads() - before == set()


class Recorder(ToyReplica):
    """A ToyReplica that logs its batches' values and can be held at a gate before each batch."""

    def __init__(self, index: int, *, log: list | None = None, gate: threading.Event | None = None, **kw):
        super().__init__(index, **kw)
        self.log = log
        self.gate = gate

    def process(self, batch):
        if self.gate is not None:
            self.gate.wait()
        if self.log is not None:
            self.log.append((self.index, [item.value for item in batch]))
        return super().process(batch)


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def test_results_come_back_in_submission_order():
    rng = random.Random(0)
    # Early items are the slowest, so results finish out of order and must be put back.
    items = [ToyItem(i, seconds=0.002 * (i < 20) + rng.uniform(0, 0.001)) for i in range(200)]
    with ReplicaPool(ToyReplica, 4, batch_size=4, queue_capacity=16) as pool:
        results = list(pool.map(items))
    assert [r.index for r in results] == list(range(200))
    assert [r.item for r in results] == items
    assert [r.value for r in results] == [2 * i for i in range(200)]
    assert all(r.ok and r.attempts == 1 and r.replica in range(4) for r in results)


def test_slow_replica_work_is_stolen():
    # Replica 0 is 20x slower (100 ms per item). Without stealing it would hold its quarter
    # of the items (30 x 100 ms = 3 s); the three fast ones alone need 120 x 5 ms / 3 = 0.2 s,
    # plus at most one slow item (0.1 s) still running at the end. The ordered stream's window
    # must cover what the fast replicas do while one slow item holds the head (3 x 20 items);
    # the queue itself stays bounded at 16.
    items = [ToyItem(i, seconds=0.005) for i in range(120)]
    factory = functools.partial(ToyReplica, speeds={0: 0.05})
    with ReplicaPool(factory, 4, batch_size=1, queue_capacity=16) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(items, window=64))
        elapsed = time.perf_counter() - t0
        m = pool.metrics()
    assert all(r.ok for r in results) and [r.value for r in results] == [2 * i for i in range(120)]
    assert m.replicas[0].items <= 8, m.replicas
    assert sum(s.items for s in m.replicas[1:]) >= 112
    assert m.steals > 0 and sum(s.steals for s in m.replicas[1:]) > 0
    assert m.max_queue_depth <= 16
    assert elapsed < 0.8, f"took {elapsed:.2f} s; ideal ~0.3 s, without stealing ~3 s"


class Gated(ToyReplica):
    """Logs each batch's values (with its replica) after waiting at its replica's own gate."""

    def __init__(self, index: int, *, log: list, gates: dict[int, threading.Event]):
        super().__init__(index)
        self.log, self.gate = log, gates[index]

    def process(self, batch):
        self.gate.wait()
        self.log.append((self.index, [item.value for item in batch]))
        return super().process(batch)


def _submit_all_at_once(pool: ReplicaPool, items) -> list:
    """Queue every item before any worker can take one (white box: holds the pool's lock,
    which is reentrant, so the deques' contents are exactly the round-robin's)."""
    with pool._lock:
        return [pool.submit(item) for item in items]


def test_owner_takes_its_head_and_a_thief_the_busiest_tail():
    log: list = []
    gates = {i: threading.Event() for i in range(3)}
    with ReplicaPool(functools.partial(Gated, log=log, gates=gates), 3, queue_capacity=64) as pool:
        # Round-robin: deque 0 holds 0, 3, ..., 12; deque 1 holds 1, ..., 13; deque 2 holds 2, ..., 14.
        futures = _submit_all_at_once(pool, [ToyItem(i) for i in range(15)])
        _wait_until(lambda: pool.metrics().queue_depth == 12)  # each worker holds its own head
        gates[2].set()
        _wait_until(lambda: pool.metrics().queue_depth == 0)
        gates[0].set()
        gates[1].set()
        assert all(f.result().ok for f in futures)
    ran_by_2 = [values[0] for index, values in log if index == 2]
    # Its own deque oldest first, then one item at a time from the tail of the fuller deque.
    assert ran_by_2 == [2, 5, 8, 11, 14, 12, 13, 9, 10, 6, 7, 3, 4], ran_by_2
    assert pool.metrics().replicas[2].steals == 8


def test_short_batch_is_topped_up_from_another_deque_with_its_key():
    log: list = []
    items = [ToyItem(i) for i in range(10)]
    key = {item: "short" if item.value < 2 else "long" for item in items}
    with ReplicaPool(functools.partial(Recorder, log=log), 2, batch_size=4, queue_capacity=64,
                     batch_key=key.__getitem__) as pool:
        # Deque 0: 0 (short), 2, 4, 6, 8 (long); deque 1: 1 (short), 3, 5, 7, 9 (long).
        futures = _submit_all_at_once(pool, items)
        assert [f.result().value for f in futures] == [2 * i for i in range(10)]
    assert all(len({key[items[int(v)]] for v in values}) == 1 for _, values in log), log
    # Whichever worker runs first takes its own short item and the other deque's short one.
    assert sorted(log[0][1]) == [0, 1], log


def test_bad_item_fails_alone_and_its_batch_mates_succeed():
    log: list = []
    gate = threading.Event()
    bad = {5, 13}
    items = [ToyItem(i, fail=i in bad) for i in range(32)]
    factory = functools.partial(Recorder, log=log, gate=gate)
    with ReplicaPool(factory, 1, batch_size=8, queue_capacity=64) as pool:
        futures = [pool.submit(item) for item in items]  # all queued while the replica waits
        gate.set()
        results = [f.result() for f in futures]
        m = pool.metrics()
    for r in results:
        if r.index in bad:
            assert not r.ok and isinstance(r.error, ValueError) and str(r.item.value) in str(r.error)
            with pytest.raises(ValueError):
                r.unwrap()
        else:
            assert r.ok and r.unwrap() == 2 * r.index
    batches_with_5 = [values for _, values in log if 5 in values]
    assert any(len(values) > 1 for values in batches_with_5)  # 5 did share a batch...
    assert [5] in batches_with_5                                # ...and was retried alone
    assert m.split_batches == 2 and m.failed == 2 and m.done == 32


def test_returned_exception_fails_only_that_item():
    def factory(index):
        return lambda batch: [KeyError(x) if x % 3 == 0 else x + 1 for x in batch]

    with ReplicaPool(factory, 2, batch_size=4) as pool:
        results = list(pool.map(range(30)))
        assert pool.metrics().split_batches == 0
    for r in results:
        assert r.ok == (r.index % 3 != 0)
        assert isinstance(r.error, KeyError) if r.index % 3 == 0 else r.value == r.index + 1


class _DeviceLost(BaseException):
    """A process-level failure that is not an Exception (like a runtime abort)."""


@pytest.mark.parametrize("death", [ReplicaDied, _DeviceLost])
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_killed_replica_is_rebuilt_and_its_items_rerun(death, num_replicas):
    builds: list[tuple[int, str]] = []
    batch_no = itertools.count()
    killed: list[list[int]] = []

    class DiesOnce(ToyReplica):
        def process(self, batch):
            if next(batch_no) == 2:  # the third batch of the run kills its replica
                killed.append([item.value for item in batch])
                raise death("device lost")
            return super().process(batch)

    def factory(index):
        builds.append((index, threading.current_thread().name))
        return DiesOnce(index)

    items = [ToyItem(i, seconds=0.001) for i in range(40)]
    with ReplicaPool(factory, num_replicas, batch_size=4, restart_backoff_s=0.0) as pool:
        results = list(pool.map(items))
        m = pool.metrics()
    assert all(r.ok for r in results) and [r.value for r in results] == [2 * i for i in range(40)]
    assert len(killed) == 1 and killed[0]
    for r in results:
        assert r.attempts == (2 if r.index in killed[0] else 1)
    assert m.restarts == 1 and len(builds) == num_replicas + 1
    rebuilt_slot = next(s.index for s in m.replicas if s.restarts == 1)
    names = [name for index, name in builds if index == rebuilt_slot]
    assert len(names) == 2 and names[0] != names[1]  # the new replica got a fresh thread


def test_items_of_a_dead_replica_go_back_to_the_head_of_its_deque_in_order():
    log: list = []
    died = threading.Event()

    class DiesOnFirstBatch(ToyReplica):
        def process(self, batch):
            log.append([item.value for item in batch])
            if not died.is_set():
                died.set()
                raise ReplicaDied("device lost")
            return super().process(batch)

    with ReplicaPool(DiesOnFirstBatch, 1, batch_size=2, restart_backoff_s=0.0) as pool:
        futures = _submit_all_at_once(pool, [ToyItem(i) for i in range(6)])
        assert [f.result().value for f in futures] == [2 * i for i in range(6)]
    # The dead batch [0, 1] reruns first, one item at a time and in order, then the rest.
    assert log == [[0, 1], [0], [1], [2, 3], [4, 5]], log


def test_poison_item_comes_back_as_an_error():
    items = [ToyItem(i, seconds=0.0005, kill=i == 10) for i in range(30)]
    with ReplicaPool(ToyReplica, 3, batch_size=4, max_attempts=3, restart_backoff_s=0.0) as pool:
        results = list(pool.map(items))
        m = pool.metrics()
    poison = results[10]
    assert not poison.ok and isinstance(poison.error, ReplicaDied) and poison.attempts == 3
    assert isinstance(poison.error.__cause__, ReplicaDied)
    assert all(r.ok and r.value == 2 * r.index for r in results if r.index != 10)
    assert m.restarts == 3 and m.failed == 1 and m.done == 30


def test_replica_that_cannot_be_rebuilt_is_retired_and_nothing_hangs():
    calls = itertools.count()

    def factory(index):
        if next(calls) > 0:
            raise OSError("device gone for good")
        return ToyReplica(index)

    items = [ToyItem(i, kill=i == 5) for i in range(12)]
    with ReplicaPool(factory, 1, batch_size=1, restart_backoff_s=0.001, max_start_failures=2) as pool:
        results = list(pool.map(items))
        late = pool.submit(ToyItem(99)).result(timeout=5)
        m = pool.metrics()
    assert all(r.ok for r in results[:5])
    assert all(isinstance(r.error, ReplicaDied) for r in results[5:])
    assert isinstance(late.error, ReplicaDied) and isinstance(late.error.__cause__, OSError)
    assert not m.replicas[0].alive


def test_factory_failure_at_start_raises():
    def factory(index):
        if index == 1:
            raise FileNotFoundError("model.safetensors")
        return ToyReplica(index)

    with pytest.raises(ReplicaStartError, match="replica 1") as info:
        ReplicaPool(factory, 3)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_factory_and_process_run_in_the_replica_thread():
    built: dict[int, threading.Thread] = {}
    used: set[tuple[int, threading.Thread]] = set()

    class Bound(ToyReplica):
        def process(self, batch):
            used.add((self.index, threading.current_thread()))
            return super().process(batch)

    def factory(index):
        built[index] = threading.current_thread()
        return Bound(index)

    with ReplicaPool(factory, 4, batch_size=2) as pool:
        list(pool.map(ToyItem(i, seconds=0.001) for i in range(64)))
    assert sorted(built) == [0, 1, 2, 3] and len(set(built.values())) == 4
    assert all(built[index] is thread for index, thread in used)


def test_map_bounds_the_items_it_holds():
    capacity, replicas, batch = 8, 2, 2
    window = capacity + replicas * batch
    produced = 0

    def source():
        nonlocal produced
        for i in range(300):
            produced += 1
            yield ToyItem(i, seconds=0.0002)

    held = []
    with ReplicaPool(ToyReplica, replicas, batch_size=batch, queue_capacity=capacity) as pool:
        for consumed, result in enumerate(pool.map(source())):
            held.append(produced - consumed)  # read from the source and not yet handed back
            assert result.index == consumed
            time.sleep(0.0005)  # a consumer slower than the pool
        m = pool.metrics()
    assert max(held) <= window
    assert max(held) >= capacity  # the bound was actually reached
    assert m.max_queue_depth <= capacity


def test_submit_blocks_while_the_queue_is_full():
    gate = threading.Event()
    with ReplicaPool(functools.partial(Recorder, gate=gate), 1, queue_capacity=3) as pool:
        first = pool.submit(ToyItem(0))
        _wait_until(lambda: pool.metrics().queue_depth == 0)  # the replica holds it, at the gate
        futures = [pool.submit(ToyItem(i)) for i in (1, 2, 3)]
        blocked = threading.Thread(target=lambda: futures.append(pool.submit(ToyItem(4))))
        blocked.start()
        blocked.join(0.2)
        assert blocked.is_alive() and pool.metrics().queue_depth == 3
        gate.set()
        blocked.join(5)
        assert not blocked.is_alive()
        assert [f.result().value for f in [first, *futures]] == [0, 2, 4, 6, 8]


def test_close_drains_by_default():
    with ReplicaPool(ToyReplica, 2, queue_capacity=100) as pool:
        futures = [pool.submit(ToyItem(i, seconds=0.001)) for i in range(40)]
    assert all(f.done() and f.result().ok for f in futures)
    with pytest.raises(PoolClosed):
        pool.submit(ToyItem(0))
    pool.close()  # a second close is harmless


def test_close_with_cancel_pending_cancels_waiting_items():
    gate = threading.Event()
    pool = ReplicaPool(functools.partial(Recorder, gate=gate), 1, queue_capacity=10)
    futures = [pool.submit(ToyItem(i)) for i in range(5)]
    _wait_until(lambda: pool.metrics().queue_depth == 4)
    closer = threading.Thread(target=pool.close, kwargs={"cancel_pending": True})
    closer.start()
    _wait_until(lambda: all(f.done() for f in futures[1:]))
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert futures[0].result().ok
    assert all(isinstance(f.result().error, CancelledError) for f in futures[1:])
    assert pool.metrics().cancelled == 4


def test_abandoned_map_cancels_what_it_had_not_yielded():
    with ReplicaPool(ToyReplica, 2, queue_capacity=8) as pool:
        stream = pool.map(ToyItem(i, seconds=0.02) for i in range(1000))
        first = [next(stream) for _ in range(5)]
        stream.close()
    assert [r.value for r in first] == [0, 2, 4, 6, 8]
    m = pool.metrics()
    assert m.submitted < 100 and m.done + m.cancelled == m.submitted
    assert m.cancelled >= 4  # the window held ~10 items of 20 ms; at most two were running


def test_batches_share_a_batch_key():
    log: list = []
    with ReplicaPool(functools.partial(Recorder, log=log), 3, batch_size=5, queue_capacity=32,
                     batch_key=lambda item: item.value % 3) as pool:
        results = list(pool.map(ToyItem(i, seconds=0.0003) for i in range(150)))
    assert [r.value for r in results] == [2 * i for i in range(150)]
    assert all(len(values) <= 5 and len({v % 3 for v in values}) == 1 for _, values in log)
    assert sum(len(values) for _, values in log) == 150
    assert any(len(values) > 1 for _, values in log)


def test_submit_from_many_threads():
    with ReplicaPool(ToyReplica, 3, batch_size=3, queue_capacity=4) as pool:
        futures: dict[int, list] = {}

        def producer(k):
            futures[k] = [pool.submit(ToyItem(1000 * k + i)) for i in range(60)]

        producers = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        for k, fs in futures.items():
            assert [f.result().value for f in fs] == [2 * (1000 * k + i) for i in range(60)]
        assert len({f.result().index for fs in futures.values() for f in fs}) == 240


def test_concurrent_maps_each_get_their_own_stream_in_order():
    outputs: dict[int, list] = {}

    def consume(k):
        outputs[k] = [r.value for r in pool.map(ToyItem(1000 * k + i, seconds=0.0002) for i in range(80))]

    with ReplicaPool(ToyReplica, 3, batch_size=4, queue_capacity=8) as pool:
        consumers = [threading.Thread(target=consume, args=(k,)) for k in range(3)]
        for t in consumers:
            t.start()
        for t in consumers:
            t.join(30)
    assert outputs == {k: [2 * (1000 * k + i) for i in range(80)] for k in range(3)}


def test_trickling_items_are_not_left_waiting():
    """Items arriving one at a time to idle workers each get a worker (no lost wake-up)."""
    def slowly():
        for i in range(40):
            time.sleep(0.001)
            yield ToyItem(i)

    with ReplicaPool(ToyReplica, 4, batch_size=8, queue_capacity=64) as pool:
        results = list(pool.map(slowly(), window=2))
    assert [r.value for r in results] == [2 * i for i in range(40)]


def test_metrics():
    items = [ToyItem(i, seconds=0.001, units=0.5 * i, fail=i == 7) for i in range(40)]
    with ReplicaPool(ToyReplica, 2, batch_size=4, work_units=lambda item: item.units) as pool:
        assert pool.metrics().elapsed_s == 0.0
        list(pool.map(items))
        m = pool.metrics()
    assert (m.submitted, m.done, m.failed, m.cancelled, m.queue_depth) == (40, 40, 1, 0, 0)
    assert m.work_units == pytest.approx(sum(0.5 * i for i in range(40) if i != 7))
    assert m.work_units_per_s == pytest.approx(m.work_units / m.elapsed_s)
    assert m.items_per_s == pytest.approx(40 / m.elapsed_s) and m.elapsed_s > 0.005
    assert sum(s.items for s in m.replicas) == 40 and sum(s.batches for s in m.replicas) >= 10
    assert all(0 < s.busy_s and 0 < s.utilization <= 1.0 for s in m.replicas if s.items)
    json.dumps(m.as_dict())


_KIND = st.sampled_from(["ok"] * 8 + ["fail", "kill"])


@settings(max_examples=25, deadline=None)
@given(jobs=st.lists(st.tuples(st.floats(0, 0.002), _KIND), max_size=40),
       replicas=st.integers(1, 4), batch_size=st.integers(1, 6), capacity=st.integers(1, 10),
       keys=st.integers(1, 3), slow=st.booleans())
def test_property_every_item_comes_back_once_in_order(jobs, replicas, batch_size, capacity, keys, slow):
    items = [ToyItem(i, seconds=s, fail=kind == "fail", kill=kind == "kill") for i, (s, kind) in enumerate(jobs)]
    factory = functools.partial(ToyReplica, speeds={0: 0.2} if slow else None)
    with ReplicaPool(factory, replicas, batch_size=batch_size, queue_capacity=capacity,
                     batch_key=lambda item: int(item.value) % keys, restart_backoff_s=0.0) as pool:
        results = list(pool.map(items))
        m = pool.metrics()
    assert [r.index for r in results] == list(range(len(items)))
    for item, r in zip(items, results):
        assert r.item is item
        if item.kill:
            assert isinstance(r.error, ReplicaDied) and r.attempts == 3
        elif item.fail:
            assert isinstance(r.error, ValueError)
        else:
            assert r.ok and r.value == 2 * item.value
    assert m.done == len(items) and m.queue_depth == 0 and m.max_queue_depth <= capacity + replicas * batch_size


def test_a_replica_thread_that_cannot_start_raises_that_error_and_leaves_no_thread(monkeypatch) -> None:
    """When the system has no thread left for a replica (``--replicas 100000``), the pool
    raises that error after closing the replicas already started; close() used to join the
    thread that never started and raise "cannot join thread before it is started" instead."""
    real_start = threading.Thread.start
    started = []

    def start(self: threading.Thread) -> None:
        if self.name.startswith("polyaccel-replica") and len(started) == 2:
            raise RuntimeError("can't start new thread")
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ReplicaPool(ToyReplica, 4, batch_size=2)


def test_a_successor_thread_that_cannot_start_retires_the_slot_and_nothing_hangs(monkeypatch) -> None:
    """A replica dies and the system has no thread left for its successor: the slot is retired
    (the last one: every waiting item fails with ReplicaDied naming the cause), where the slot
    stayed 'alive' with no worker and its queued items waited for ever."""
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if self.name.startswith("polyaccel-replica") and "." in self.name:  # a successor
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    items = [ToyItem(i, kill=i == 3) for i in range(8)]
    with ReplicaPool(ToyReplica, 1, batch_size=1, restart_backoff_s=0.0) as pool:
        results = list(pool.map(items))
        late = pool.submit(ToyItem(99)).result(timeout=5)
        m = pool.metrics()
    assert all(r.ok for r in results[:3])
    assert all(isinstance(r.error, ReplicaDied) for r in results[3:])
    assert isinstance(late.error, ReplicaDied) and "can't start new thread" in repr(late.error.__cause__)
    assert not m.replicas[0].alive and not _pool_threads()
