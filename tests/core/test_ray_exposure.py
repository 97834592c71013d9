"""A private in-process cluster (``init_local``) leaves nothing behind when its process ends:
no Ray process, and not its private folder of sessions, logs, spilled objects and sockets
(they piled up in /tmp, one ``ray-*`` folder per run, for good)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

DRIVER = textwrap.dedent("""
    import signal, sys, time
    # As in a user's shell: a SIGINT ignored by the pytest process (something in a full run
    # leaves it so) would be inherited, and the test's Ctrl-C would never arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from polyaccel.core.ray_local import init_local
    ray = init_local(num_cpus=1, log_to_driver=False)
    print(ray._private.worker._global_node.get_session_dir_path(), flush=True)
    how = sys.argv[1]
    if how == "shutdown":
        ray.shutdown()
    elif how == "exception":
        raise RuntimeError("the job failed")
    elif how == "sigint":
        time.sleep(120)  # until the test's Ctrl-C
    elif how == "hung_shutdown":  # ray.shutdown() never returns: the exit hook must not wait for it
        from polyaccel.core import ray_local
        ray_local.EXIT_WAIT_S = 2.0
        ray.shutdown = lambda *a, **k: time.sleep(600)
""")


def _ours(marker: str) -> list[str]:
    """The processes whose command line names ``marker`` (this test's folder)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in a for a in p.info["cmdline"] or ()):
                found.append(f"{p.pid} {' '.join(p.info['cmdline'])[:120]}")
        except psutil.Error:
            pass
    return found


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path (Ray's socket paths must fit 107 bytes; pytest's tmp_path is long)."""
    path = Path(tempfile.mkdtemp(prefix="rx-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["shutdown", "sigint", "hung_shutdown"])  # an exception leaves as Ctrl-C does
def test_private_cluster_leaves_no_folder_and_no_process(how: str, short_tmp: Path) -> None:
    tmp_path = short_tmp
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_TMPDIR=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "cfg"), RAY_USAGE_STATS_ENABLED="0")
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    try:
        session = Path(driver.stdout.readline().strip())
        assert session.is_dir() and session.is_relative_to(tmp_path), driver.stderr.read()[-2000:]
        if how == "sigint":
            driver.send_signal(signal.SIGINT)
        driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == (0 if how == "shutdown" else 1)  # KeyboardInterrupt: 1 too; a hung shutdown: 1
    deadline = time.monotonic() + 15  # the agents end a moment after the raylet
    while _ours(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ours(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["cfg"], "the cluster's private folder is left behind"
