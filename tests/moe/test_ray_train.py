"""``polyaccel-moe finetune --ray``: the same training function on 2 Ray Train workers (gloo)
in a local Ray cluster trains exactly like the in-process run on the same global batch."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from polyaccel.moe.ray_train import run_with_ray  # noqa: E402
from polyaccel.moe.train import finetune  # noqa: E402
from polyaccel.moe.train_config import load_config  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [[], ["parallel.ep=2", "parallel.dense=replicate"]],
                         ids=["fsdp", "ep2-dense-replicas"])
def test_two_ray_workers_match_one_process(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sets = ["train.max_steps=3", "log.progress_bar=false", "log.every_steps=1000"]
    single = finetune(load_config(TINY, [*sets, f"checkpoint.dir={tmp_path}/single/ck",
                                         f"output_dir={tmp_path}/single/out"]))
    cfg = load_config(TINY, [*sets, "train.micro_batch=1", f"checkpoint.dir={tmp_path}/ray/ck",
                             f"output_dir={tmp_path}/ray/out", *layout])
    # In a fresh interpreter: Ray Data/Train keep process-global state across ray.init() calls,
    # so another test's cluster in this process must not leak into this one. address="local":
    # a cluster of our own, never one another process started on this machine.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        summary = pool.submit(run_with_ray, cfg, workers=2, address="local",
                              storage_path=str(tmp_path / "ray_results")).result(timeout=170)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(single.losses),
                               rtol=1e-5, atol=1e-5)
    assert (tmp_path / "ray/out/config.json").is_file()
    assert os.path.isdir(summary["last_checkpoint"])


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        run_with_ray(load_config(TINY), workers=0)
