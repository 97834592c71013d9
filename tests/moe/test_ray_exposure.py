"""``finetune --ray`` lets nobody in and leaves nothing running.

- On a loopback-only cluster the workers' process group listens on loopback only: torch's
  rendezvous ``TCPStore`` (no authentication; rank 0 hosts it) bound every interface
  (``::``), and gloo took the interface the host name resolves to (or ``GLOO_SOCKET_IFNAME``).
- The private cluster ``run_with_ray`` starts is shut down when the run ends, trained or not.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or getattr(addr, "ipv4_mapped", None) is not None and addr.ipv4_mapped.is_loopback


def _exposed_interface() -> str | None:
    """A non-loopback interface with an IPv4 address: where gloo goes when told to (or when the
    host name resolves to it)."""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return name
    return None


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(XDG_CONFIG_HOME=str(tmp / "cfg"), RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0",
               OMP_NUM_THREADS="1")
    # Test speed only: Ray Train's controller polls every 0.5 s (not 2), no preemption-watcher actor.
    env.update(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5", RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0")
    if env.get("PYTHONPATH"):  # the child runs in ``tmp``
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep))
    iface = _exposed_interface()
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


def _run(code: str, tmp: Path, timeout: float, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**_env(tmp), **env}, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path (Ray's socket paths must fit 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rx-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"

LISTENING = textwrap.dedent("""
    import ipaddress

    def is_loopback(ip):
        addr = ipaddress.ip_address(ip)
        return addr.is_loopback or addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback

    def listening():
        import psutil
        return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN]
""")


@pytest.mark.timeout(60)
def test_worker_process_group_listens_on_loopback_only(short_tmp: Path) -> None:
    """What a Ray Train worker on a loopback node does before its process group is set up,
    then the group as Ray Train sets it up (env://, rank 0 hosting the store); no Ray."""
    out = _run(LISTENING + textwrap.dedent("""
        import os, socket, ray.util, torch, torch.distributed as dist
        ray.util.get_node_ip_address = lambda: "127.0.0.1"  # a worker of a loopback-only cluster
        from polyaccel.moe.ray_train import keep_rendezvous_on_loopback
        keep_rendezvous_on_loopback()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=1)
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        print("LISTENING", listening())
        dist.destroy_process_group()
    """), short_tmp, 50)
    socks = eval(out.split("LISTENING", 1)[1])
    assert socks, "no store and no gloo socket seen"
    assert all(is_loopback(ip) for ip, _ in socks), f"listening beyond loopback: {socks}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_run_with_ray_workers_listen_on_loopback_only_and_the_cluster_is_stopped(short_tmp: Path) -> None:
    """run_with_ray on a private cluster, two gloo workers running a stand-in for the training
    function that looks at its own sockets once every rank is up. After it returns, the
    cluster it started is stopped (a library call left it running until the process ended),
    and the run state Ray Train kept (no storage_path given) is gone, not left in ~/ray_results."""
    code = LISTENING + textwrap.dedent("""
        import tempfile
        from pathlib import Path
        import ray, ray.train
        import torch.distributed as dist
        from polyaccel.moe import ray_train
        from polyaccel.moe.train_config import load_config

        def stand_in(loop_config):
            assert dist.get_world_size() == 2
            dist.barrier()  # every rank's sockets are up before anyone looks
            wide = [s for s in listening() if not is_loopback(s[0])]
            assert not wide, f"rank {dist.get_rank()} listens beyond loopback: {wide}"
            with tempfile.TemporaryDirectory() as d:
                Path(d, ray_train.SUMMARY_FILE).write_text('{"final_loss": 0.5}')
                ray.train.report({"final_loss": 0.5}, checkpoint=ray.train.Checkpoint.from_directory(d))

        ray_train._train_worker = stand_in
        cfg = load_config(TINY, ["train.max_steps=1", "checkpoint.dir=ck", "output_dir=out"])
        summary = ray_train.run_with_ray(cfg, workers=2, address="local", use_gpu=False, max_failures=0)
        print("SUMMARY", summary, "STILL_UP", ray.is_initialized())
    """).replace("TINY", repr(str(TINY)))
    home, scratch = short_tmp / "home", short_tmp / "scratch"
    home.mkdir()
    scratch.mkdir()
    out = _run(code, short_tmp, 140, HOME=str(home), TMPDIR=str(scratch))
    assert "SUMMARY {'final_loss': 0.5} STILL_UP False" in out, out[-3000:]
    # no storage_path given: Ray Train's run state went to a private folder, removed with the cluster
    assert not (home / "ray_results").exists() and not list(scratch.glob("polyaccel-ray-train-*"))
