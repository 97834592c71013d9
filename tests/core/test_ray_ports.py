"""A Ray cluster we start uses only ports its own processes hold: a port another local process
listens on (taken between picking it and Ray binding it, or before) is refused, never used,
so the cluster's clients never talk to (and send the token to) someone else's server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from polyaccel.core import ray_local

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="checks ports through /proc (Linux)")

LISTEN_TREE = textwrap.dedent("""
    import socket, subprocess, sys
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    if sys.argv[1] == "child":  # a grandchild listens too
        kid = subprocess.Popen([sys.executable, "-c", sys.argv[2], "grandchild", ""], stdout=subprocess.PIPE, text=True)
        print(s.getsockname()[1], kid.stdout.readline().strip(), flush=True)
    else:
        print(s.getsockname()[1], flush=True)
    sys.stdin.read()
""")


ORPHAN = textwrap.dedent("""
    import os, socket, time
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    pid = os.fork()
    if pid:  # the parent leaves: the listener is nobody's descendant
        print(s.getsockname()[1], pid, flush=True)
        os._exit(0)
    time.sleep(120)
""")


@pytest.fixture
def orphan_listener() -> Iterator[int]:
    """The port of a listener in a process outside this process's tree (ended after the test)."""
    with subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True) as parent:
        port, pid = (int(v) for v in parent.stdout.readline().split())
    yield port
    os.kill(pid, signal.SIGKILL)


class Squatter:
    """A listening loopback socket of this process (not of the cluster): answers HTTP with 401,
    as a dashboard would, and records every request it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind((ray_local.LOOPBACK, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.open = True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.open:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.requests.append(conn.recv(65536))
                    conn.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.open = False
        self.sock.close()


@pytest.fixture
def squatter() -> Iterator[Squatter]:
    s = Squatter()
    yield s
    s.close()


def test_port_owners_tells_the_tree_s_sockets_from_another_process_s(squatter: Squatter) -> None:
    """A child and its child listen (the "cluster"); this process's socket is another's."""
    tree = subprocess.Popen([sys.executable, "-c", LISTEN_TREE, "child", LISTEN_TREE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        child, grandchild = (int(p) for p in tree.stdout.readline().split())
        free = ray_local.free_port()
        owners = ray_local.port_owners({"a": child, "b": grandchild, "c": squatter.port, "d": free}, tree.pid)
        assert owners == {"a": "ours", "b": "ours", "c": f"uid {os.getuid()}", "d": "none"}
        ray_local.check_ports_are_ours({"a": child, "b": grandchild}, tree.pid)
        with pytest.raises(ray_local.PortTakenError, match=rf"127\.0\.0\.1:{squatter.port} \(dashboard\) is held by uid"):
            ray_local.check_ports_are_ours({"a": child, "dashboard": squatter.port}, tree.pid)
    finally:
        tree.stdin.close()
        tree.wait(timeout=30)


class _FakeNodeRay:
    """``ray`` whose ``init`` starts nothing; records ``shutdown``."""

    def __init__(self) -> None:
        self.stopped = False

    def init(self, **kwargs) -> None:
        pass

    def shutdown(self) -> None:
        self.stopped = True


def test_init_local_stops_and_refuses_a_cluster_whose_port_another_process_holds(
        orphan_listener: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process cluster's processes are this process and its descendants; a port its node
    reports that another process listens on stops the cluster."""
    fake = _FakeNodeRay()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # its private folder
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_apply", lambda env: None)
    monkeypatch.setattr(ray_local, "_owned_temp_dirs", [])
    monkeypatch.setattr(ray_local, "_node_ports", lambda ray: {"runtime env agent": orphan_listener})
    with pytest.raises(ray_local.PortTakenError, match=rf":{orphan_listener} \(runtime env agent\) is held by"):
        ray_local.init_local(1)
    assert fake.stopped


def _ours(marker: str) -> list[int]:
    return ray_local._processes_naming(marker)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ray_local.PICKED_PORT_FLAGS)
def test_start_head_refuses_a_port_another_process_took(flag: str, squatter: Squatter, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The ports we pick for ``ray start`` (dashboard, client server) are free when picked; another
    process binds one before Ray does. Before: the dashboard's clients (``ray job submit``, with
    the token) were pointed at it, or the client server's port was left to it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # set by an earlier cluster of this process: a fresh token
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    real = ray_local.free_port
    picks = iter(ray_local.PICKED_PORT_FLAGS)
    monkeypatch.setattr(ray_local, "free_port", lambda: squatter.port if next(picks) == flag else real())
    with pytest.raises(ray_local.PortTakenError, match=rf"127\.0\.0\.1:{squatter.port} \({flag}\) is held by"):
        with ray_local.start_head(num_cpus=1, timeout=60):
            pass
    token = (tmp_path / "cfg/polyaccel/ray_auth_token").read_bytes()
    assert not any(token in r for r in squatter.requests)
    deadline = time.monotonic() + 15
    while _ours(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ours(str(tmp_path)), "the refused cluster's processes are left running"
    assert [p.name for p in tmp_path.iterdir()] == ["cfg"], "the refused cluster's folder is left behind"


def test_start_head_lets_ray_bind_every_port_it_can() -> None:
    """A port Ray's server binds itself (0) cannot be taken before it; the GCS port was picked
    by us, and Ray's own startup sent the token to whoever took it (seen: 33 connections)."""
    assert "--port" in ray_local.SELF_BOUND_PORT_FLAGS
    assert not set(ray_local.SELF_BOUND_PORT_FLAGS) & set(ray_local.PICKED_PORT_FLAGS)
    assert set(ray_local.PICKED_PORT_FLAGS) == {"--dashboard-port", "--ray-client-server-port"}
