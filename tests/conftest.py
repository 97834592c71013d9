"""Fixtures shared by the test packages."""

import socket

import pytest


@pytest.fixture
def free_port():
    """A callable returning a free TCP port on the loopback interface (tests never leave it)."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick
