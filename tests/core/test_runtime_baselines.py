"""The threaded and multi-process baselines return what ReplicaPool returns, in input order."""

from __future__ import annotations

import functools
import random
import threading

import pytest

from polyaccel.core.runtime import (
    ProcessPoolBaseline,
    ReplicaDied,
    ReplicaPool,
    ReplicaStartError,
    ThreadedQueueBaseline,
)
from polyaccel.core.runtime.toy import ToyItem, ToyReplica

pytestmark = pytest.mark.timeout(120)


def _workload(n: int = 80, seed: int = 0) -> list[ToyItem]:
    rng = random.Random(seed)
    return [ToyItem(i, seconds=rng.uniform(0, 0.001), fail=rng.random() < 0.1) for i in range(n)]


def _summary(results) -> list[tuple]:
    return [(r.index, r.item, r.value, type(r.error).__name__ if r.error else None, str(r.error or ""))
            for r in results]


def _baseline_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("polyaccel-baseline")}


@pytest.fixture(scope="module")
def process_baseline():
    """One process pool for the module: starting spawned processes costs seconds (imports)."""
    with ProcessPoolBaseline(functools.partial(ToyReplica, batch_overhead_s=0.0005), 2, batch_size=4,
                             queue_capacity=8) as baseline:
        yield baseline


@pytest.mark.parametrize("batch_size", [1, 4])
def test_threaded_baseline_matches_the_pool(batch_size):
    items = _workload()
    before = _baseline_threads()
    with ReplicaPool(ToyReplica, 3, batch_size=batch_size, queue_capacity=8) as pool:
        expected = _summary(pool.map(items))
    with ThreadedQueueBaseline(ToyReplica, 3, batch_size=batch_size, queue_capacity=8) as baseline:
        got = _summary(baseline.map(items))
    assert got == expected
    assert sum(e[3] is not None for e in expected) > 0  # the workload did have bad items
    assert _baseline_threads() == before


def test_process_baseline_matches_the_pool(process_baseline):
    items = _workload(seed=1)
    with ReplicaPool(ToyReplica, 2, batch_size=4) as pool:
        expected = _summary(pool.map(items))
    assert _summary(process_baseline.map(items)) == expected


def test_process_baseline_keeps_counting_across_maps(process_baseline):
    start = _summary(process_baseline.map([ToyItem(0)]))[0][0]
    results = list(process_baseline.map(ToyItem(i) for i in range(30)))
    assert [r.index for r in results] == list(range(start + 1, start + 31))
    assert [r.value for r in results] == [2 * i for i in range(30)]
    assert {r.replica for r in results} <= {0, 1}


@pytest.mark.parametrize("make", [ThreadedQueueBaseline, ReplicaPool], ids=["threaded", "pool"])
def test_batch_keys_and_a_lagging_partial_batch(make):
    """One item of a rare key among many of a common one still comes back in order (the
    baseline sends its partial batch once it lags) and batches never mix keys."""
    log: list[list[int]] = []

    class Logged(ToyReplica):
        def process(self, batch):
            log.append([int(item.value) for item in batch])
            return super().process(batch)

    items = [ToyItem(i) for i in range(200)]
    with make(Logged, 2, batch_size=8, batch_key=lambda item: item.value % 50 == 0, queue_capacity=4) as runtime:
        results = list(runtime.map(items))
    assert [r.value for r in results] == [2 * i for i in range(200)]
    assert all(len(b) <= 8 and len({v % 50 == 0 for v in b}) == 1 for b in log)
    assert sorted(v for b in log for v in b) == list(range(200))


def test_baselines_do_not_restart_a_dead_replica():
    items = [ToyItem(i, kill=i == 5) for i in range(12)]
    with ThreadedQueueBaseline(ToyReplica, 1, batch_size=4) as baseline:
        results = list(baseline.map(items))
    dead = [r.index for r in results if not r.ok]
    assert dead == [4, 5, 6, 7] and all(isinstance(results[i].error, ReplicaDied) for i in dead)


def test_threaded_baseline_start_failure_raises():
    def factory(index):
        if index == 2:
            raise MemoryError("no room for the model")
        return ToyReplica(index)

    before = _baseline_threads()
    with pytest.raises(ReplicaStartError, match="replica 2") as info:
        ThreadedQueueBaseline(factory, 3)
    assert isinstance(info.value.__cause__, MemoryError)
    assert _baseline_threads() == before
