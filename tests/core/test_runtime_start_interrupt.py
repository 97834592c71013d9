"""Ctrl-C while a ReplicaPool builds its replicas (a model load): the constructor raised
KeyboardInterrupt and left the replicas already built never closed and their worker threads
waiting for work for ever (nothing could close a pool the caller never got). Now it closes the
pool (every built replica closed once, every thread ended) and re-raises."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from polyaccel.core import ReplicaPool


@pytest.mark.timeout(30)
def test_ctrl_c_while_replicas_start_closes_the_built_ones_and_ends_every_thread():
    built, closed = [], []

    class SlowToLoad:
        def __init__(self, index: int) -> None:
            self.index = index
            if index == 1:  # Ctrl-C while this one still loads (no timer: the same order under any load)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)
            built.append(index)

        def process(self, batch):
            return batch

        def close(self) -> None:
            closed.append(self.index)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a shell
    try:
        with pytest.raises(KeyboardInterrupt):
            ReplicaPool(SlowToLoad, 2, name="start-interrupt")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(built) == [0, 1] and sorted(closed) == [0, 1]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("start-interrupt")]


@pytest.mark.timeout(30)
def test_ctrl_c_inside_thread_start_still_joins_and_closes_that_replica(monkeypatch):
    """The signal can land while ``Thread.start()`` waits for the new thread: that thread runs
    and builds its replica, so the pool must keep it to join and close (it was dropped)."""
    built, closed = [], []

    class SlowToLoad:
        def __init__(self, index: int) -> None:
            self.index = index
            time.sleep(0.5)
            built.append(index)

        def process(self, batch):
            return batch

        def close(self) -> None:
            closed.append(self.index)

    real_start = threading.Thread.start

    def start_then_interrupt(thread):
        real_start(thread)
        if thread.name == "start-in-start-1":
            raise KeyboardInterrupt

    monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        ReplicaPool(SlowToLoad, 3, name="start-in-start")
    assert sorted(built) == [0, 1] and sorted(closed) == [0, 1]
    assert not [t.name for t in threading.enumerate() if t.name.startswith("start-in-start")]
