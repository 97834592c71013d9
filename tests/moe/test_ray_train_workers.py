"""``finetune --ray --workers N`` on the private local cluster it starts, with fewer CPUs (or GPUs)
than N: Ray Train waited for the missing workers for ever (a worker group that cannot be placed
is a controller failure, which Ray Train retries without limit by default: the run never ended).
Now it is refused on the driver (exit 2) and the cluster stopped; a controller failure is
bounded like the workers' (``max_failures``)."""

from __future__ import annotations

from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.train.torch import TorchTrainer  # noqa: E402

from polyaccel.core import ray_local  # noqa: E402
from polyaccel.moe.cli import main  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


@pytest.fixture
def two_cpu_private_cluster(monkeypatch):
    """What run_with_ray sees after init_local on a 2-core machine (nothing is started); records
    whether the cluster was shut down and what Ray Train was given."""
    seen = {"initialized": False, "shutdown": False}

    def init_local(*args, **kwargs):
        seen["initialized"] = True

    def shutdown():
        seen["shutdown"] = True
    monkeypatch.setattr(ray_local, "init_local", init_local)
    monkeypatch.setattr(ray, "is_initialized", lambda: seen["initialized"])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "shutdown", shutdown)

    def fit(self):
        seen["failure_config"] = self.run_config.failure_config
        raise AssertionError("Ray Train started: it waits for workers the cluster cannot hold")
    monkeypatch.setattr(TorchTrainer, "fit", fit)
    return seen


def test_more_workers_than_the_private_cluster_s_cpus_is_refused(tmp_path, capsys, two_cpu_private_cluster):
    code = main(["finetune", str(TINY), "--ray", "--workers", "3", "--set", f"checkpoint.dir={tmp_path}/ck",
                 "--set", f"output_dir={tmp_path}/out"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--workers 3: the private local Ray cluster has 2 CPUs" in err and "--workers 2" in err, err
    assert two_cpu_private_cluster["shutdown"]


def test_controller_failures_are_bounded_like_the_workers(tmp_path, two_cpu_private_cluster):
    from polyaccel.moe.ray_train import run_with_ray
    from polyaccel.moe.train_config import load_config

    cfg = load_config(TINY, [f"checkpoint.dir={tmp_path}/ck", f"output_dir={tmp_path}/out"])
    with pytest.raises(AssertionError, match="Ray Train started"):
        run_with_ray(cfg, workers=2, max_failures=2)
    failure = two_cpu_private_cluster["failure_config"]
    assert failure.max_failures == 2 and failure.controller_failure_limit == 2
