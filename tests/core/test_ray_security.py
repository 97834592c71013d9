"""The Ray clusters the project starts let nobody in: every listening socket of their processes
is on loopback, and clients without the cluster's token (HTTP job API and GCS) are refused.

Checked for both kinds: ``ray start --head`` as the README runs it (``start_head``) and the
private in-process cluster of ``make demo``, the ASR job and ``finetune --ray`` (``init_local``).
"""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from polyaccel.core.ray_local import LOOPBACK_ENV, ensure_token, local_cluster_env, start_head  # noqa: E402

AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


@pytest.fixture
def fresh_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A token file of this test's own, and none of the caller's Ray auth settings."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for k in AUTH_VARS:
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "cfg/polyaccel/ray_auth_token"


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


def joins(gcs_address: str, home: Path, token: str | None = None, wait_s: float = 60) -> tuple[bool, str]:
    """Whether a driver in a clean process (no token, or ``token``) joins ``gcs_address``
    within ``wait_s``; a refused one fails or keeps retrying. Returns (joined, its output)."""
    env = {k: v for k, v in os.environ.items() if k not in AUTH_VARS}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / "cfg"), RAY_USAGE_STATS_ENABLED="0", **LOOPBACK_ENV)
    if token is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    code = f"import ray; ray.init(address={gcs_address!r}); print('JOINED', flush=True); ray.shutdown()"
    with subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as p:
        try:
            out, _ = p.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    return "JOINED" in out, out[-2000:]


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_token_file_is_private_and_stable(fresh_token: Path) -> None:
    path = ensure_token()
    assert path == fresh_token and stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert len(token) == 64 and ensure_token().read_text() == token
    path.chmod(0o644)
    ensure_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_local_env_turns_auth_on_even_when_disabled(fresh_token: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    env = local_cluster_env()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(fresh_token)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_start_head_is_loopback_only_and_needs_the_token(fresh_token: Path, tmp_path: Path) -> None:
    with start_head(num_cpus=1) as head:
        assert_loopback_only(psutil.Process(head.proc.pid))
        token = Path(head.env.get("RAY_AUTH_TOKEN_PATH", os.devnull)).read_text()
        jobs = f"{head.dashboard_url}/api/jobs/"
        assert http_status(jobs) == 401
        assert http_status(jobs, {"Authorization": "Bearer not-the-token"}) == 403
        assert http_status(jobs, {"Authorization": f"Bearer {token}"}) == 200
        for wrong in (None, "0" * 64):
            joined, out = joins(head.gcs_address, tmp_path / "stranger", wrong, wait_s=30)
            assert not joined, out
            assert "Authentication" in out or "Unauthenticated" in out, out
        assert joins(head.gcs_address, tmp_path / "friend", token)[0], "the right token must get in"


INIT_LOCAL = textwrap.dedent("""
    import sys, time
    from polyaccel.core.ray_local import init_local
    ray = init_local(num_cpus=1, log_to_driver=False)
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    ray.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_in_process_cluster_is_loopback_only_and_needs_the_token(fresh_token: Path, tmp_path: Path) -> None:
    driver = subprocess.Popen([sys.executable, "-c", INIT_LOCAL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    try:
        gcs_address = driver.stdout.readline().strip()
        assert gcs_address.startswith("127.0.0.1:"), gcs_address
        assert_loopback_only(psutil.Process(driver.pid))
        joined, out = joins(gcs_address, tmp_path / "stranger", wait_s=30)
        assert not joined, out
    finally:
        driver.stdin.close()
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
