"""Fixtures shared by the core tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest


@pytest.fixture
def fresh_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Ray token file of this test's own (not yet written), and none of the caller's Ray
    auth or address settings."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS",
              "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "cfg/polyaccel/ray_auth_token"


@pytest.fixture
def no_thread_leaks(request: pytest.FixtureRequest):
    """Fail the test if it leaves a thread running whose name starts with its module's
    ``_NAME`` (the pools' name), after waiting up to the module's ``THREAD_GRACE_S`` (0)."""
    prefix, grace = request.module._NAME, getattr(request.module, "THREAD_GRACE_S", 0.0)

    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith(prefix)}

    before = ours()
    yield
    deadline = time.monotonic() + grace
    while ours() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ours() - before == set()
