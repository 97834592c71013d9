"""Fixtures shared by the test packages."""

import socket

import pytest
import torch


@pytest.fixture
def free_port():
    """A callable returning a free TCP port on the loopback interface (tests never leave it)."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for in-process models: on a shared 2-core machine the small decode
    ops lose more to thread hand-offs than they gain (4-5x slower with 2 threads under load).
    Restored when the module's tests are done."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
