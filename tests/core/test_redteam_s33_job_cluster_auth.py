"""A ``ray job submit`` driver on a cluster started without token authentication says so. The
driver of a Ray job inherits the head's environment (Ray adds ``RAY_JOB_CONFIG_JSON_ENV_VAR``),
so a head started with ``ray start`` but without ``eval "$(python -m polyaccel.core.ray_local
env)"`` shows up as a job whose ``RAY_AUTH_MODE`` is not ``token``: anyone who reaches that
cluster's ports submits jobs (runs code) on it. ``connect`` joined it without a word (and set
token mode for this process only, which such a head ignores); it now logs a warning naming
the fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from polyaccel.core import ray_local

JOB = {"RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": {}, "metadata": {}}', "RAY_ADDRESS": "127.0.0.1:6379"}


def _connect(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str]) -> str:
    monkeypatch.setattr(ray_local, "import_ray", lambda *a: type("R", (), {"init": staticmethod(lambda **k: None)}))
    monkeypatch.setattr(ray_local, "_apply", lambda values: None)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=ray_local.__name__):
        ray_local.connect()
    return caplog.text


@pytest.mark.parametrize("mode", [None, "disabled", "DISABLED"])
def test_a_job_on_a_cluster_without_token_auth_is_warned(fresh_token: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture, mode: str | None) -> None:
    said = _connect(monkeypatch, caplog, {**JOB, **({"RAY_AUTH_MODE": mode} if mode else {})})
    assert "without token authentication" in said and "ray_local env" in said
    assert f"RAY_AUTH_MODE={mode or 'unset'}" in said


@pytest.mark.parametrize("env", [{**JOB, "RAY_AUTH_MODE": "token"}, {"RAY_ADDRESS": "127.0.0.1:6379"}],
                         ids=["job-with-token", "not-a-job"])
def test_a_job_with_token_auth_or_a_plain_driver_is_not_warned(fresh_token: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture,
                                                               env: dict[str, str]) -> None:
    assert "without token authentication" not in _connect(monkeypatch, caplog, env)
