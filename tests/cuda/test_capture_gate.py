"""The CUDA backend's capture gate: a graph capture never overlaps a replica's GPU section,
and lazy captures from inside sections never deadlock (pure threading; runs on the CPU)."""

from __future__ import annotations

import threading
import time

from polyaccel.cuda.graphs import CaptureGate


def _run(*targets, timeout: float = 5.0) -> None:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "deadlock"


def test_a_capture_waits_for_sections_and_new_sections_wait_for_it() -> None:
    gate, log = CaptureGate(), []
    inside, capture_waiting = threading.Event(), threading.Event()

    def replica():
        with gate.work():
            log.append("work start")
            inside.set()
            capture_waiting.wait(2)
            time.sleep(0.1)
            log.append("work end")

    def capturer():
        inside.wait(2)
        capture_waiting.set()
        with gate.capture():
            log.append("capture")

    def late_replica():
        capture_waiting.wait(2)
        time.sleep(0.05)  # arrives while the capture waits: it must not slip in before it
        with gate.work():
            log.append("late work")

    _run(replica, capturer, late_replica)
    assert log == ["work start", "work end", "capture", "late work"]


def test_captures_from_inside_sections_never_deadlock_and_never_overlap() -> None:
    gate, state = CaptureGate(), {"capturing": 0, "inside": 0, "overlaps": 0}
    lock = threading.Lock()

    def replica():
        for _ in range(20):
            with gate.work():
                with lock:
                    state["inside"] += 1
                time.sleep(0.001)
                with lock:
                    state["inside"] -= 1
                with gate.capture():  # a lazy capture in the middle of a section
                    with lock:
                        state["capturing"] += 1
                        state["overlaps"] += state["capturing"] > 1 or state["inside"] > 0
                    time.sleep(0.001)
                    with lock:
                        state["capturing"] -= 1
                with gate.work():  # sections nest
                    pass

    _run(*[replica] * 4, timeout=10)
    assert state["overlaps"] == 0


class _Graph:
    replays = 0

    def replay(self) -> None:
        self.replays += 1


def _runner(*buffers):
    """A CudaGraphRunner over CPU buffers with a stand-in graph (no GPU needed)."""
    from polyaccel.cuda.graphs import CudaGraphRunner

    r = CudaGraphRunner.__new__(CudaGraphRunner)
    r.name, r.static_inputs, r.graph, r.static_outputs = "g", list(buffers), _Graph(), None
    return r


def test_graph_replay_refuses_inputs_of_another_shape_or_dtype() -> None:
    """copy_ broadcasts: a batch of 1 fed to a graph captured at batch 4 filled all 4 rows and
    replayed, returning 4 outputs for one input; floats were truncated into an integer buffer."""
    import pytest
    import torch

    r = _runner(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    for bad in ((torch.ones(1, 3), torch.ones(4, dtype=torch.int64)), (torch.ones(3), torch.ones(4, dtype=torch.int64)),
                (torch.ones(4, 3), torch.full((4,), 2.7))):
        with pytest.raises(ValueError, match="captured for"):
            r(*bad)
    assert r.graph.replays == 0 and r.static_inputs[0].sum() == 0
    r(torch.ones(4, 3, dtype=torch.float64), torch.ones(4, dtype=torch.int32))  # same-kind casts are fine
    assert r.graph.replays == 1 and r.static_inputs[0].sum() == 12


def test_a_capture_interrupted_while_waiting_leaves_the_gate_usable() -> None:
    """A KeyboardInterrupt (or any exception) in a capture's wait must not leave it counted as
    waiting: every later section would block forever."""
    gate = CaptureGate()

    class Interrupting(threading.Condition):
        def wait(self, timeout=None):
            raise KeyboardInterrupt

    release = threading.Event()

    def replica():
        with gate.work():
            release.wait(5)

    holder = threading.Thread(target=replica, daemon=True)
    holder.start()
    time.sleep(0.05)
    gate._cond = Interrupting(gate._cond._lock)
    try:
        with gate.capture():
            raise AssertionError("captured while a section was open")
    except KeyboardInterrupt:
        pass
    gate._cond = threading.Condition(gate._cond._lock)
    entered = []
    _run(lambda: entered.append(gate.work().__enter__()) or None, timeout=2)  # not blocked by a stale waiter
    assert entered == [None]
