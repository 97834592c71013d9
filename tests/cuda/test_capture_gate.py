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
