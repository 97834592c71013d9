"""``clitools.exit_process``: a rank of a multi-process run ends with the status its command
returned, its output flushed and its exit handlers run, even when the interpreter's teardown
would abort it (as the C++ destructors of torch.distributed's threads at times do: exit -6
in place of 0 or the run's error status)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch.distributed
    from polyaccel.core.clitools import exit_process

    class AbortsAtTeardown:  # stands in for a C++ object whose destructor calls std::terminate
        def __del__(self, abort=os.abort):
            abort()

    keep = AbortsAtTeardown()
    atexit.register(lambda: print("exit handler ran", file=sys.stderr))
    print("buffered output", end="")  # a pipe: block-buffered, only in the buffer
    exit_process(4)
""")


def _run(world: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT], env=dict(os.environ, WORLD_SIZE=world),
                          capture_output=True, text=True, timeout=120)


def test_a_rank_of_a_multi_process_run_ends_with_its_status_not_an_abort_at_teardown():
    run = _run("2")
    assert run.returncode == 4, run.stderr[-2000:]
    assert run.stdout == "buffered output" and "exit handler ran" in run.stderr


@pytest.mark.parametrize("world", ["1", "x"])
def test_a_single_process_exits_the_usual_way(world):
    run = _run(world)  # the usual teardown: here the stand-in aborts it
    assert run.returncode == -6 and run.stdout == "buffered output" and "exit handler ran" in run.stderr
