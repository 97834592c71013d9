"""ReplicaPool behaviour the other runtime tests left unpinned, found by hand mutation testing
(each test fails when one line of ``runtime/pool.py`` is weakened)."""

from __future__ import annotations

import threading
import time

import pytest

from polyaccel.core.runtime import ReplicaPool, ReplicaStartError
from polyaccel.core.runtime.toy import ToyItem, ToyReplica

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("no_thread_leaks")]

_NAME = "polyaccel-s29"
THREAD_GRACE_S = 5.0


@pytest.mark.parametrize("arg", ["num_replicas", "queue_capacity", "batch_size", "max_attempts"])
def test_a_count_below_one_is_refused(arg: str) -> None:
    kwargs = {"num_replicas": 1, arg: 0}
    with pytest.raises(ValueError, match=arg):
        ReplicaPool(ToyReplica, name=_NAME, **kwargs)


def test_when_several_replicas_fail_to_start_the_lowest_slot_is_reported() -> None:
    def factory(i: int) -> ToyReplica:
        if i:
            time.sleep(0.05 * (3 - i))  # slot 2 fails first
            raise OSError(f"device {i} missing")
        return ToyReplica(i)

    with pytest.raises(ReplicaStartError, match=r"replica 1 failed to start: OSError\('device 1 missing'\)"):
        ReplicaPool(factory, 3, name=_NAME)



def test_map_yields_a_finished_result_while_the_input_still_trickles_in() -> None:
    """A slow input (lines from a pipe, files as they land): results come out as they finish,
    not only when the window fills or the input ends."""
    finished = threading.Event()

    def trickle():
        for i in range(4):
            yield ToyItem(i)
            time.sleep(0.2)
        finished.set()

    with ReplicaPool(ToyReplica, 1, name=_NAME) as pool:
        stream = pool.map(trickle())
        first = next(stream)
        early = not finished.is_set()
        rest = list(stream)
    assert early, "the first result waited for the whole input"
    assert [r.value for r in (first, *rest)] == [0, 2, 4, 6]


class _Gated(ToyReplica):
    def __init__(self, index: int, gate: threading.Event) -> None:
        super().__init__(index)
        self.gate = gate

    def process(self, batch):  # noqa: ANN001, ANN201
        self.gate.wait(10)
        return super().process(batch)


def test_a_submitter_blocked_on_a_full_queue_gets_pool_closed_when_the_pool_closes() -> None:
    """Backpressure must not outlive the pool: a producer thread waiting for room is told at
    once that the pool is closing, not left blocked until the replicas drain the queue."""
    from polyaccel.core.runtime import PoolClosed

    gate = threading.Event()
    pool = ReplicaPool(lambda i: _Gated(i, gate), 1, queue_capacity=1, name=_NAME)
    try:
        pool.submit(ToyItem(0))
        deadline = time.monotonic() + 5
        while pool.metrics().queue_depth and time.monotonic() < deadline:  # the worker holds item 0
            time.sleep(0.005)
        pool.submit(ToyItem(1))  # fills the queue
        outcome: list[BaseException | None] = []

        def produce() -> None:
            try:
                pool.submit(ToyItem(2))
                outcome.append(None)
            except PoolClosed as e:
                outcome.append(e)

        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(0.1)
        assert producer.is_alive(), "submit did not wait for room"
        closer = threading.Thread(target=pool.close)  # drains: the queued item waits for the gate
        closer.start()
        producer.join(5)
        assert not producer.is_alive() and isinstance(outcome[0], PoolClosed)
    finally:
        gate.set()
        pool.close()
    closer.join(5)
    assert not closer.is_alive()


def test_a_dead_replica_is_closed_before_its_successor_is_built() -> None:
    """A device that holds one model at a time (GPU memory): the successor's factory runs only
    after the dead replica's ``close()`` released it."""
    from polyaccel.core.runtime import ReplicaDied

    built: list[_Closable] = []
    open_at_build: list[int] = []

    class _Closable(ToyReplica):
        closed = False

        def process(self, batch):  # noqa: ANN001, ANN201
            if any(item.kill for item in batch) and len(built) == 1:
                time.sleep(0.05)  # the close that follows must not be raced by the successor
                raise ReplicaDied("device lost")
            return [2 * item.value for item in batch]

        def close(self) -> None:
            time.sleep(0.05)
            self.closed = True

    def factory(i: int) -> _Closable:
        open_at_build.append(sum(not r.closed for r in built))
        built.append(_Closable(i))
        return built[-1]

    with ReplicaPool(factory, 1, name=_NAME) as pool:
        result = pool.submit(ToyItem(1, kill=True)).result(10)
    assert result.error is None and result.value == 2 and result.attempts == 2
    assert open_at_build == [0, 0], "the successor was built while the dead replica was still open"


def test_a_replica_returning_more_results_than_items_fails_them_not_silently_drops_some() -> None:
    """One result per item: extra results mean the replica's output is misaligned (results of
    another batch, or a bug), so no result of that batch can be trusted."""
    class TooMany(ToyReplica):
        def process(self, batch):  # noqa: ANN001, ANN201
            return [2 * item.value for item in batch] + [0]

    with ReplicaPool(TooMany, 1, name=_NAME) as pool:
        result = pool.submit(ToyItem(1)).result(10)
    assert isinstance(result.error, ValueError) and "returned 2 results for a batch of 1" in str(result.error)


def test_throughput_after_the_work_is_done_does_not_decay_with_the_wall_clock() -> None:
    """Metrics read after a run (a benchmark's report) measure the run, not the time since."""
    with ReplicaPool(ToyReplica, 1, name=_NAME) as pool:
        list(pool.map(ToyItem(v, seconds=0.01) for v in range(5)))
        first = pool.metrics()
        time.sleep(0.2)
        later = pool.metrics()
    assert later.elapsed_s == first.elapsed_s and later.items_per_s == first.items_per_s
