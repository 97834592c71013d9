"""``polyaccel.core.ray_local``: behaviour the other Ray tests left unpinned, found by hand
mutation testing (each test fails when one check of ``ray_local.py`` is weakened)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from polyaccel.core import ray_local


@pytest.mark.parametrize("loose", [0o640, 0o604, 0o620, 0o602])
def test_a_token_file_only_the_group_or_only_others_may_read_or_write_is_made_private(
        fresh_token: Path, loose: int) -> None:
    """Any access by group members alone (or by others alone) hands them the token."""
    ray_local.ensure_token()
    fresh_token.chmod(loose)
    ray_local.ensure_token()
    assert stat.S_IMODE(fresh_token.stat().st_mode) == 0o600


@pytest.mark.parametrize("loose", [0o750, 0o705, 0o770])
def test_a_token_folder_the_group_or_others_may_enter_is_made_private(fresh_token: Path, loose: int) -> None:
    fresh_token.parent.mkdir(parents=True)
    fresh_token.parent.chmod(loose)
    ray_local.ensure_token()
    assert stat.S_IMODE(fresh_token.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("var", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"])
def test_a_token_or_token_file_the_user_set_wins_and_no_file_is_made(fresh_token: Path, var: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, "x" * 64 if var == "RAY_AUTH_TOKEN" else "/somewhere/token")
    env = ray_local.auth_env()
    assert env == {"RAY_AUTH_MODE": "token"} and not fresh_token.exists()


def test_joining_a_cluster_keeps_the_auth_mode_the_user_set(fresh_token: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Joining someone else's cluster (``connect``) keeps an explicit ``RAY_AUTH_MODE``; only a
    cluster started here forces token authentication."""
    applied: list[dict[str, str]] = []
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: type("R", (), {"init": staticmethod(lambda **k: None)}))
    monkeypatch.setattr(ray_local, "_apply", applied.append)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray_local.connect("10.0.0.5:6379")
    assert "RAY_AUTH_MODE" not in applied[0]
    assert ray_local.local_cluster_env()["RAY_AUTH_MODE"] == "token"


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:6379", True), ("127.1.2.3:6379", True), ("localhost:6379", True), ("[::1]:6379", True),
    ("ray://127.0.0.1:10001", True), ("http://localhost:8265", True),
    ("10.0.0.5:6379", False), ("10.127.0.1:6379", False), ("ray://10.0.0.5:10001", False),
    ("node127.example.com:6379", False), ("127.evil.example:6379", False), ("", False), (None, False)])
def test_is_loopback_address(address: str | None, loopback: bool) -> None:
    assert ray_local.is_loopback_address(address) is loopback


class _Node:
    gcs_address = "127.0.0.1:40000"
    node_manager_port = 40001
    runtime_env_agent_port = 40002
    metrics_agent_port = 40003
    metrics_export_port = -1     # not served (Ray reports -1)
    dashboard_agent_listen_port = 0


def test_ports_ray_does_not_serve_are_not_checked() -> None:
    """-1 (not served, as when another process holds the dashboard agent's fixed port) and 0
    are left out: counted as "no listener", they would refuse every such cluster."""
    ray = type("R", (), {})()
    ray._private = type("P", (), {"worker": type("W", (), {"_global_node": _Node()})})
    assert ray_local._node_ports(ray) == {"GCS": 40000, "node manager": 40001, "runtime env agent": 40002,
                                          "metrics agent": 40003}


def _init_local_with_a_fake_ray(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Run ``init_local(1)`` against a fake Ray; return the keyword arguments of its ``ray.init`` calls."""
    calls: list[dict] = []
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: type("R", (), {"init": staticmethod(
        lambda **k: calls.append(k))}))
    monkeypatch.setattr(ray_local, "_node_ports", lambda ray: {})
    monkeypatch.setattr(ray_local, "_apply", lambda env: None)
    monkeypatch.setattr(ray_local, "_owned_temp_dirs", [])
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    ray_local.init_local(1)
    return calls


def test_init_local_starts_no_dashboard_unless_asked(fresh_token: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _init_local_with_a_fake_ray(tmp_path, monkeypatch)
    assert calls[0]["include_dashboard"] is False


def test_a_port_held_through_ipv6_is_seen_as_another_process_s() -> None:
    """A dual-stack ``[::]`` listener gets the cluster clients' ``127.0.0.1`` connections as
    well; it shows in ``/proc/net/tcp6`` only."""
    import os
    import socket
    import subprocess
    import sys

    if not os.path.exists("/proc/net/tcp6"):
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::", 0))
        except OSError:
            pytest.skip("cannot bind IPv6 here")
        s.listen()
        port = s.getsockname()[1]
        with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as other:
            try:
                assert ray_local.port_owners({"GCS": port}, other.pid) == {"GCS": f"uid {os.getuid()}"}
                with pytest.raises(ray_local.PortTakenError, match=rf":{port} \(GCS\) is held by uid"):
                    ray_local.check_ports_are_ours({"GCS": port}, other.pid)
            finally:
                other.stdin.close()


def test_a_port_nobody_listens_on_is_refused_too() -> None:
    """A port the cluster reports but nobody listens on is free for anyone to take next."""
    import os

    port = ray_local.free_port()
    with pytest.raises(ray_local.PortTakenError, match=rf":{port} \(GCS\) has no listener"):
        ray_local.check_ports_are_ours({"GCS": port}, os.getpid())


def test_the_session_s_port_files_give_only_the_ports_served(tmp_path: Path) -> None:
    session = tmp_path / "session_latest"
    session.mkdir()
    for name, value in (("gcs_server_port_abc", "41000"), ("metrics_export_port_abc", "-1"),
                        ("dashboard_agent_listen_port_abc", "0"), ("node_manager_port_abc", "junk")):
        (session / name).write_text(value)
    assert ray_local._session_ports(str(tmp_path)) == {"gcs_server_port": 41000}


class _Head:
    pid = 1

    def poll(self) -> None:
        return None


def test_start_head_waits_until_every_port_is_the_cluster_s_own(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The GCS up and the dashboard answering is not enough: a port not yet listened on (Ray
    still starting that server) could still be taken; the cluster is handed out only once
    every port is held by its processes."""
    rounds = iter([{"gcs_server_port": "ours", "--ray-client-server-port": "none"},
                   {"gcs_server_port": "ours", "--ray-client-server-port": "ours"}])
    asked = []
    monkeypatch.setattr(ray_local, "_session_ports", lambda temp: {"gcs_server_port": 41000})
    monkeypatch.setattr(ray_local, "port_owners", lambda ports, root: asked.append(1) or next(rounds))
    monkeypatch.setattr(ray_local, "_answers_http", lambda url: True)
    monkeypatch.setattr(ray_local.time, "sleep", lambda s: None)
    picked = {"--dashboard-port": 41001, "--ray-client-server-port": 41002}
    assert ray_local._wait_until_up(_Head(), picked, str(tmp_path), 60, tmp_path / "log") == 41000
    assert len(asked) == 2


def test_start_head_fails_at_once_with_ray_s_log_when_ray_start_exits(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray start`` that exits (a bad flag, a port in use) is reported with its log right away,
    not after the whole start timeout."""
    class Exited(_Head):
        def poll(self) -> int:
            return 1

    log = tmp_path / "head.log"
    log.write_text("ray: error: no such option --frobnicate\n")
    monkeypatch.setattr(ray_local, "_session_ports", lambda temp: {})
    monkeypatch.setattr(ray_local, "port_owners", lambda ports, root: dict.fromkeys(ports, "none"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="ray start failed or timed out:\nray: error: no such option"):
        ray_local._wait_until_up(Exited(), {"--dashboard-port": 1}, str(tmp_path), 15, log)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("argv", [[], ["envv"], ["env", "extra"]])
def test_the_env_command_refuses_anything_else_with_its_usage(argv: list[str], fresh_token: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert ray_local.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "usage: python -m polyaccel.core.ray_local env\n" and not fresh_token.exists()


def test_the_exit_watchdog_never_counts_this_process_among_the_cluster_s() -> None:
    """``_give_up`` SIGKILLs every process naming the cluster's folder: this process among them
    would die before the folder is removed and before its own exit status is set."""
    import os
    import subprocess
    import sys

    own = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode()  # this interpreter's path
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", own + "-marker"],
                          stdin=subprocess.PIPE) as child:
        try:
            found = ray_local._processes_naming(own)
            assert child.pid in found and os.getpid() not in found
        finally:
            child.stdin.close()


def test_the_dashboard_counts_as_up_when_it_refuses_a_request_without_the_token() -> None:
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer((ray_local.LOOPBACK, 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert ray_local._answers_http(f"http://{ray_local.LOOPBACK}:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert not ray_local._answers_http(f"http://{ray_local.LOOPBACK}:{ray_local.free_port()}")


def test_loopback_reaches_a_process_that_imported_ray_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray reads its cluster flag once, at import: without the patch a driver that imported Ray
    first would resolve 127.0.0.1 to the machine's external address and serve there."""
    import sys
    import types

    constants = types.SimpleNamespace(ENABLE_RAY_CLUSTER=True)
    monkeypatch.setitem(sys.modules, "ray._private.ray_constants", constants)
    monkeypatch.setitem(sys.modules, "ray._raylet", None)
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    ray_local._apply(dict(ray_local.LOOPBACK_ENV))
    assert constants.ENABLE_RAY_CLUSTER is False
    assert __import__("os").environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def test_init_local_remembers_its_private_folder_for_removal_at_exit(fresh_token: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _init_local_with_a_fake_ray(tmp_path, monkeypatch)
    assert ray_local._owned_temp_dirs == [str(Path(calls[0]["_temp_dir"]).parent)]
