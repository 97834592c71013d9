"""The Ray clusters the project starts let nobody in: every listening socket of their processes
is on loopback, and clients without the cluster's token (HTTP job API and GCS) are refused.

Checked for both kinds: ``ray start --head`` as the README runs it (``start_head``) and the
private in-process cluster of ``make demo``, the ASR job and ``finetune --ray`` (``init_local``).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import os
import queue
import shlex
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from polyaccel.core import ray_local  # noqa: E402
from polyaccel.core.ray_local import LOOPBACK, LOOPBACK_ENV, ensure_token, local_cluster_env, start_head  # noqa: E402

AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def listening(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, ip, port) of every listening TCP socket of ``root`` and its descendants."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or getattr(addr, "ipv4_mapped", None) is not None and addr.ipv4_mapped.is_loopback


def assert_loopback_only(root: psutil.Process) -> None:
    socks = listening(root)
    assert any(name.startswith("gcs_server") for name, _, _ in socks), socks
    wide = [s for s in socks if not is_loopback(s[1])]
    assert not wide, f"listening beyond loopback: {wide}"


REFUSED = ("Unauthenticated", "InvalidAuthToken")  # what the GCS answers a client without the right token


def joins(gcs_address: str, home: Path, token: str | None = None, wait_s: float = 60) -> tuple[bool, str]:
    """Whether a driver in a clean process (no token, or ``token``) joins ``gcs_address``
    within ``wait_s``; a refused one fails or keeps retrying (about 20 s), so it is stopped as
    soon as the GCS's refusal shows in its output. Returns (joined, its output)."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / "cfg"), RAY_USAGE_STATS_ENABLED="0", **LOOPBACK_ENV)
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    code = f"import ray; ray.init(address={gcs_address!r}); print('JOINED', flush=True); ray.shutdown()"
    lines: queue.Queue[str | None] = queue.Queue()
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as p:
        def read() -> None:
            for line in p.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        out, deadline = [], time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            out.append(line)
            if "JOINED" in line or any(r in line for r in REFUSED):
                break
        if p.poll() is None:
            p.kill()
        p.wait()
    out = "".join(out)
    return "JOINED" in out, out[-2000:]


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def serves_metrics_without_token(port: int) -> bool:
    """Whether ``port`` answers ``GET /metrics`` (Prometheus's scrape) without the token. (The
    dashboard serves its static page, ``/``, to anyone; its API needs the token.)"""
    try:
        return http_status(f"http://{LOOPBACK}:{port}/metrics") == 200
    except (OSError, http.client.HTTPException):  # not HTTP (gRPC), or closed
        return False


def open_to_anyone(root: psutil.Process) -> set[int]:
    """The listening ports of ``root``'s tree that serve metrics to a client without the token."""
    return {port for _, _, port in listening(root) if serves_metrics_without_token(port)}


def session_port(session: Path, name: str) -> int:
    (f,) = session.glob(f"{name}_*")
    return int(f.read_text())


def test_token_file_is_private_and_stable(fresh_token: Path) -> None:
    path = ensure_token()
    assert path == fresh_token and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert len(token) == 64 and ensure_token().read_text() == token
    path.chmod(0o644)
    ensure_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_token_folder_is_made_private_and_one_of_another_user_refused(fresh_token: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whoever may write in the token's folder can swap the file for one whose token they know
    (and then join every cluster started here); whoever owns the file knows the token."""
    fresh_token.parent.mkdir(parents=True, mode=0o777)
    fresh_token.parent.chmod(0o777)
    ensure_token()
    assert stat.S_IMODE(fresh_token.parent.stat().st_mode) == 0o700
    other = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: other)
    with pytest.raises(PermissionError, match="another user"):
        ensure_token()


def test_token_file_left_empty_is_replaced(fresh_token: Path) -> None:
    """A kill between creating the file and writing the token left it empty (Ray refuses an
    empty token, so every later cluster would fail to start): the next call writes one."""
    fresh_token.parent.mkdir(parents=True)
    fresh_token.touch(mode=0o600)
    assert ensure_token() == fresh_token
    token = fresh_token.read_text()
    assert len(token) == 64 and int(token, 16) >= 0 and stat.S_IMODE(fresh_token.stat().st_mode) == 0o600
    assert ensure_token().read_text() == token
    assert [p.name for p in fresh_token.parent.iterdir()] == [fresh_token.name]  # no temporary file left


def test_a_token_another_process_made_meanwhile_is_never_replaced(fresh_token: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes making the first token at once: the one that loses the race keeps the
    winner's token (a cluster may already run with it), never replaces it with its own."""
    real_mkstemp = ray_local.tempfile.mkstemp

    def racing_mkstemp(**kwargs):  # the other process writes its token just before ours lands
        fresh_token.write_text("a" * 64)
        return real_mkstemp(**kwargs)

    monkeypatch.setattr(ray_local.tempfile, "mkstemp", racing_mkstemp)
    assert ensure_token().read_text() == "a" * 64
    assert [p.name for p in fresh_token.parent.iterdir()] == [fresh_token.name]


def test_env_command_output_survives_eval(fresh_token: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`eval "$(python -m polyaccel.core.ray_local env)"`: values are shell-quoted."""
    odd = tmp_path / "my config $(touch pwned)"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(odd))
    assert ray_local.main(["env"]) == 0
    exports = dict(shlex.split(line)[1].split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert exports["RAY_AUTH_TOKEN_PATH"] == str(odd / "polyaccel/ray_auth_token")
    assert exports["RAY_AUTH_MODE"] == "token" and exports["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


class _FakeRay:
    """Records what ``ray.init`` was asked for (no cluster is started)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def init(self, **kwargs) -> None:
        self.calls.append(kwargs)


@pytest.mark.parametrize("how", ["argument", "RAY_ADDRESS"])
def test_connect_to_local_starts_a_private_loopback_cluster(how: str, fresh_token: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`--address local` (or RAY_ADDRESS=local): plain ray.init would start a cluster on every
    interface, keeping RAY_AUTH_MODE=disabled; connect() starts it as init_local does."""
    fake, applied = _FakeRay(), {}
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_node_ports", lambda ray: {})
    monkeypatch.setattr(ray_local, "_apply", applied.update)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    if how == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", "local")
    ray_local.connect("local" if how == "argument" else None, logging_level="WARNING")
    (call,) = fake.calls
    assert call["address"] == "local" and call["_node_ip_address"] == LOOPBACK
    assert call["dashboard_host"] == LOOPBACK and call["logging_level"] == "WARNING"
    assert applied["RAY_AUTH_MODE"] == "token" and applied["RAY_AUTH_TOKEN_PATH"] == str(fresh_token)
    assert applied["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


def test_init_local_keeps_its_files_out_of_the_shared_tmp_ray(fresh_token: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's default temp dir /tmp/ray and every session, logs and sockets folder in it are
    0777 without a sticky bit: another local user could read the logs or swap the raylet's
    socket. A private cluster's files go in a fresh folder only its owner can enter."""
    fake = _FakeRay()
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_node_ports", lambda ray: {})
    monkeypatch.setattr(ray_local, "_apply", lambda env: None)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    ray_local.init_local(1)
    ray_local.init_local(1)
    dirs = [Path(c["_temp_dir"]).parent for c in fake.calls]  # Ray makes _temp_dir itself 0777
    assert dirs[0] != dirs[1] and all(d.parent == tmp_path for d in dirs)
    for d in dirs:
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert not any(d.iterdir())


def test_a_job_starts_its_own_cluster_only_without_an_address_or_with_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_local.starts_private_cluster(None) and ray_local.starts_private_cluster("local")
    assert not ray_local.starts_private_cluster("10.0.0.5:6379")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # under `ray job submit`
    assert not ray_local.starts_private_cluster(None) and ray_local.starts_private_cluster("local")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_local.starts_private_cluster(None) and not ray_local.starts_private_cluster("10.0.0.5:6379")


def test_connect_never_starts_a_cluster_of_its_own(fresh_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An address from the caller or RAY_ADDRESS is joined, never ray.init(None)'s new cluster."""
    fake, applied = _FakeRay(), []
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_apply", applied.append)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    ray_local.connect()
    ray_local.connect("auto")
    ray_local.connect("10.0.0.5:6379")  # an explicit address beats RAY_ADDRESS, as in Ray
    assert [c["address"] for c in fake.calls] == ["127.0.0.1:6379", "127.0.0.1:6379", "10.0.0.5:6379"]
    assert all("_node_ip_address" not in c for c in fake.calls)
    assert all(env["RAY_AUTH_MODE"] == "token" for env in applied)
    # A cluster on loopback is joined from loopback, another one is not.
    assert ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in env for env in applied] == [True, True, False]


@pytest.mark.parametrize("address, env_address", [(None, None), ("auto", None), (None, "auto"), ("", "")])
def test_connect_never_guesses_a_cluster_another_user_could_advertise(
        address: str | None, env_address: str | None, fresh_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's "auto" (also what ray.init does without an address) joins the cluster named in
    /tmp/ray/ray_current_cluster (Ray makes /tmp/ray 0777, no sticky bit: any local user can
    write it) or any gcs_server process on the machine, whoever runs it: their cluster gets our
    token and sends this driver pickles. connect() refuses to guess."""
    fake = _FakeRay()
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: fake)
    monkeypatch.setattr(ray_local, "_apply", lambda env: None)
    if env_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env_address)
    with pytest.raises(ValueError, match="address"):
        ray_local.connect(address)
    assert fake.calls == []


def test_local_env_turns_auth_on_even_when_disabled(fresh_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env = local_cluster_env()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(fresh_token)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_start_head_is_loopback_only_and_needs_the_token(fresh_token: Path, tmp_path: Path) -> None:
    with start_head(num_cpus=1) as head:
        assert_loopback_only(psutil.Process(head.proc.pid))
        (temp,) = [a.split("=", 1)[1] for a in head.proc.args if a.startswith("--temp-dir=")]
        # No metrics server without a token but the dashboard agent's (no switch in Ray 2.60).
        metrics_export = session_port(Path(temp, "session_latest"), "metrics_export_port")
        assert open_to_anyone(psutil.Process(head.proc.pid)) == {metrics_export}
        above = Path(temp).parent.stat()  # Ray makes the temp dir itself 0777
        assert above.st_uid == os.getuid() and stat.S_IMODE(above.st_mode) == 0o700, temp
        token = Path(head.env.get("RAY_AUTH_TOKEN_PATH", os.devnull)).read_text()
        jobs = f"{head.dashboard_url}/api/jobs/"
        assert http_status(jobs) == 401
        assert http_status(jobs, {"Authorization": "Bearer not-the-token"}) == 403
        assert http_status(jobs, {"Authorization": f"Bearer {token}"}) == 200
        for wrong in (None, "0" * 64):
            joined, out = joins(head.gcs_address, tmp_path / "stranger", wrong, wait_s=30)
            assert not joined, out
            assert any(r in out for r in REFUSED), out  # refused by the GCS, not merely slow
        assert joins(head.gcs_address, tmp_path / "friend", token)[0], "the right token must get in"
        # The token is never on a command line (``ps`` shows them to every user) nor in a log.
        procs = [head.proc.pid, *(p.pid for p in psutil.Process(head.proc.pid).children(recursive=True))]
        for pid in procs:
            with contextlib.suppress(psutil.Error):
                assert token not in " ".join(psutil.Process(pid).cmdline()), pid
        for f in Path(temp).rglob("*"):
            with contextlib.suppress(OSError):
                assert not f.is_file() or token.encode() not in f.read_bytes(), f


INIT_LOCAL = textwrap.dedent("""
    import sys, time
    from polyaccel.core.ray_local import init_local
    ray = init_local(num_cpus=1, log_to_driver=False)
    print(ray.get_runtime_context().gcs_address, flush=True)
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    ray.shutdown()
""")


@pytest.fixture
def agent_port_taken() -> Iterator[socket.socket | None]:
    """Another process's listener on the dashboard agent's fixed port (52365, which ``ray.init``
    cannot change), or None where something holds it already."""
    s = socket.socket()
    try:
        s.bind((LOOPBACK, ray_local.DASHBOARD_AGENT_PORT))
    except OSError:
        s.close()
        yield None
        return
    s.listen(16)
    s.setblocking(False)
    yield s
    s.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_in_process_cluster_is_loopback_only_and_needs_the_token(fresh_token: Path, tmp_path: Path,
                                                                 agent_port_taken: socket.socket | None) -> None:
    """Also: nothing serves a client without the token but the dashboard agent's metrics, and
    the agent's fixed port, held by another process, is left alone (never connected to)."""
    driver = subprocess.Popen([sys.executable, "-c", INIT_LOCAL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        gcs_address = driver.stdout.readline().strip()
        assert gcs_address.startswith("127.0.0.1:"), gcs_address
        session = Path(driver.stdout.readline().strip())
        private = [p for p in session.parents if p.stat().st_uid == os.getuid()
                   and not stat.S_IMODE(p.stat().st_mode) & 0o077]
        assert private, f"{session}: every folder above it lets other users in"
        assert_loopback_only(psutil.Process(driver.pid))
        assert open_to_anyone(psutil.Process(driver.pid)) == {session_port(session, "metrics_export_port")}
        joined, out = joins(gcs_address, tmp_path / "stranger", wait_s=30)
        assert not joined, out
        assert any(r in out for r in REFUSED), out  # refused by the GCS, not merely slow
        if agent_port_taken is not None:
            assert session_port(session, "dashboard_agent_listen_port") == -1  # Ray serves it nowhere
            with pytest.raises(BlockingIOError):
                agent_port_taken.accept()
    finally:
        driver.stdin.close()
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
