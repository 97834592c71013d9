"""A Ray token file that others could read or write is not kept. ``ensure_token`` only took
their access away (chmod 0600) and kept the token in it: one that others may have read is
known to them, and one that others could write may hold a token of theirs (someone with write
access replaced its text), so every cluster started here afterwards let them in (and a member
of a cluster may send its driver pickles). The token is now replaced by a new one, with a
warning; a private file's token stays as it is."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from polyaccel.core import ray_local


@pytest.mark.parametrize("loose", [0o644, 0o640, 0o604, 0o622, 0o602, 0o660])
def test_a_token_others_could_read_or_write_is_replaced(fresh_token: Path, loose: int,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    ray_local.ensure_token()
    fresh_token.write_text("b" * 64)  # what someone with write access put there, or read
    fresh_token.chmod(loose)
    with caplog.at_level(logging.WARNING, logger=ray_local.__name__):
        assert ray_local.ensure_token() == fresh_token
    token = fresh_token.read_text()
    assert token != "b" * 64 and len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(fresh_token.stat().st_mode) == 0o600
    assert f"{fresh_token}" in caplog.text and "new token" in caplog.text
    assert [p.name for p in fresh_token.parent.iterdir()] == [fresh_token.name]  # no temporary left


def test_a_private_token_is_kept(fresh_token: Path, caplog: pytest.LogCaptureFixture) -> None:
    ray_local.ensure_token()
    token = fresh_token.read_text()
    with caplog.at_level(logging.WARNING, logger=ray_local.__name__):
        ray_local.ensure_token()
    assert fresh_token.read_text() == token and not caplog.text
