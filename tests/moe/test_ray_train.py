"""``polyaccel-moe finetune --ray``: the same training function on 2 Ray Train workers (gloo)
in a local Ray cluster trains exactly like the in-process run on the same global batch."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from polyaccel.moe.ray_train import run_with_ray  # noqa: E402
from polyaccel.moe.train import finetune  # noqa: E402
from polyaccel.moe.train_config import load_config  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


FAST_RAY_TRAIN = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Test-speed settings of Ray Train (2.60), nothing these tests check: the controller polls the
workers every 0.5 s (2 s by default: a finished run or a dead worker is seen up to 2 s late),
and no preemption-watcher actor (one more process to start per worker group; it watches for
node drains, which never happen here)."""


def _start_private_cluster() -> None:
    from polyaccel.core.ray_local import init_local

    init_local(log_to_driver=False)  # as run_with_ray(address="local") starts it: loopback, token auth


def _stop_cluster() -> bool:
    ray.shutdown()
    return ray.is_initialized()


@pytest.fixture(scope="module")
def ray_driver():
    """A fresh interpreter holding one private local Ray cluster for this module's runs (started
    once: a cluster and a driver start-up cost about 15 s on 2 cores), stopped at the end.
    Fresh: Ray Data/Train keep process-global state across ray.init() calls, so another
    module's cluster in the pytest process must not leak into these runs. ``run_with_ray``
    reuses an initialised Ray (its documented behaviour), so each run trains on this cluster.
    Whether ``address="local"`` stops the cluster it starts itself is tests/moe/test_ray_exposure.py's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # inherited by the cluster's workers
        for k, v in FAST_RAY_TRAIN.items():
            mp.setenv(k, v)
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, initializer=_start_private_cluster) as pool:
            yield pool
            assert pool.submit(_stop_cluster).result(timeout=60) is False


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [[], ["parallel.ep=2", "parallel.dense=replicate"]],
                         ids=["fsdp", "ep2-dense-replicas"])
def test_two_ray_workers_match_one_process(tmp_path, monkeypatch, layout, ray_driver):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sets = ["train.max_steps=3", "log.progress_bar=false", "log.every_steps=1000"]
    single = finetune(load_config(TINY, [*sets, f"checkpoint.dir={tmp_path}/single/ck",
                                         f"output_dir={tmp_path}/single/out"]))
    cfg = load_config(TINY, [*sets, "train.micro_batch=1", f"checkpoint.dir={tmp_path}/ray/ck",
                             f"output_dir={tmp_path}/ray/out", *layout])
    # In ray_driver's fresh interpreter, on its private cluster (address="local": never one
    # another process started on this machine).
    summary = ray_driver.submit(run_with_ray, cfg, workers=2, address="local",
                                storage_path=str(tmp_path / "ray_results")).result(timeout=170)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single.losses),
                               rtol=1e-5, atol=1e-5)
    assert (tmp_path / "ray/out/config.json").is_file()
    assert os.path.isdir(summary["last_checkpoint"])


@pytest.mark.parametrize("sets, message", [
    (["train.lr=-1"], "train.lr must be a finite number >= 0, got -1.0"),
    (["parallel.ep=3"], "ep=3 must divide the number of ranks"),
    (["data.jsonl=missing.jsonl"], "missing.jsonl does not exist"),
    (["lora.r=0"], "lora: lora.r=0 must be a positive integer"),
])
def test_a_bad_config_exits_2_on_the_driver_before_ray_starts(tmp_path, capsys, monkeypatch, sets, message):
    """The driver checked nothing: each worker raised the ConfigError, Ray Train retried the
    group max_failures times and the CLI ended with a WorkerGroupError traceback, not exit 2."""
    from polyaccel.core import ray_local
    from polyaccel.moe.cli import main

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a config that cannot run")
    monkeypatch.setattr(ray_local, "init_local", no_ray)
    monkeypatch.setattr(ray_local, "connect", no_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    argv = [a for s in [f"checkpoint.dir={tmp_path}/ck", f"output_dir={tmp_path}/out", *sets] for a in ("--set", s)]
    code = main(["finetune", str(TINY), "--ray", "--workers", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not any((tmp_path / "ck").glob("step_*"))


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        run_with_ray(load_config(TINY), workers=0)


def _kill_a_worker_after(ckpt_dir: Path, step: int, killed: list[int], stop: threading.Event) -> None:
    """When checkpoint ``step`` exists, SIGKILL one Ray Train worker of this test's processes."""
    import psutil

    marker = ckpt_dir / f"step_{step:08d}"
    while not stop.is_set() and not killed:
        if marker.is_dir():
            for p in psutil.Process().children(recursive=True):
                try:
                    if "RayTrainWorker" in p.name() or "RayTrainWorker" in " ".join(p.cmdline()):
                        p.send_signal(signal.SIGKILL)
                        killed.append(p.pid)
                        return
                except psutil.Error:
                    pass
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(tmp_path, monkeypatch, ray_driver):
    """SIGKILL one of 2 Ray Train workers after checkpoint 3 of 8 (one per step): Ray Train
    restarts the group (max_failures bounded), it resumes from the newest checkpoint by itself,
    and the losses after it equal an uninterrupted run's. (8, not more: the kill lands within
    milliseconds of checkpoint 3, and every step after it costs a checkpoint upload.)"""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    steps = 8
    sets = [f"train.max_steps={steps}", "train.warmup_steps=0", "log.progress_bar=false",
            "log.every_steps=1000", "checkpoint.every_steps=1", "checkpoint.keep_last=0"]
    single = finetune(load_config(TINY, [*sets, f"checkpoint.dir={tmp_path}/single/ck",
                                         f"output_dir={tmp_path}/single/out"]))
    ckpt = tmp_path / "ray/ck"
    cfg = load_config(TINY, [*sets, "train.micro_batch=1", f"checkpoint.dir={ckpt}", f"output_dir={tmp_path}/ray/out"])
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_a_worker_after, args=(ckpt, 3, killed, stop), daemon=True)
    killer.start()
    try:
        summary = ray_driver.submit(run_with_ray, cfg, workers=2, address="local", max_failures=2,
                                    storage_path=str(tmp_path / "ray_results")).result(timeout=170)
    finally:
        stop.set()
        killer.join()
    assert killed, "no worker was killed"
    assert 3 <= summary["start_step"] < steps, summary  # resumed, not from scratch, not after the end
    assert summary["steps"] == steps
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single.losses[summary["start_step"]:]),
                               rtol=1e-5, atol=1e-5)
    assert summary["final_loss"] == pytest.approx(single.losses[-1], rel=1e-5)


def test_failures_must_be_bounded():
    with pytest.raises(ValueError, match="bounded"):
        run_with_ray(load_config(TINY), workers=1, max_failures=-1)
