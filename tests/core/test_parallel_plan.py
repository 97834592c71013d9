"""ParallelPlan: validation, and the meshes it builds on 4 gloo ranks (dp=4 with ep=2 gives a
(2, 2) moe_mesh over the same ranks; HSDP gives a (2, 2) data-parallel mesh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from polyaccel.core import ParallelPlan

_WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from polyaccel.core import ParallelPlan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for name, plan in {"ep2": ParallelPlan(dp=4, ep=2), "hsdp": ParallelPlan(dp=4, ep=4, dp_replicate=2)}.items():
        m = plan.build(device_type="cpu")
        out[name] = {
            "dp_shape": list(m.dp.shape), "dp_names": list(m.dp.mesh_dim_names),
            "moe_shape": list(m.moe.shape), "moe_names": list(m.moe.mesh_dim_names),
            "ep_group": m.moe["ep"].mesh.tolist(), "ep_shard_group": m.moe["ep_shard"].mesh.tolist(),
            "dp_shard_group": m.dp["dp_shard"].mesh.tolist(),
        }
        # The ep sub-mesh is a working process group: sum the ranks in it.
        import torch
        t = torch.tensor([rank])
        dist.all_reduce(t, group=m.moe["ep"].get_group())
        out[name]["ep_rank_sum"] = int(t)
        # A norm over a tensor sharded on both MoE dims (as a gradient norm is): one collective
        # over the flattened mesh, so DTensor does not warn about two in a row.
        import logging
        from torch.distributed.tensor import Shard, distribute_tensor
        said = []
        handler = logging.Handler()
        handler.emit = lambda record: said.append(record.getMessage())
        logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
        x = distribute_tensor(torch.arange(16.0).reshape(4, 4), m.moe, [Shard(0), Shard(1)])
        out[name]["norm"] = float(torch.linalg.vector_norm(x).full_tensor())
        out[name]["norm_warnings"] = [w for w in said if "sequential" in w]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    # Every rank done before any tears gloo down: a rank that left first once aborted another
    # ("terminate called without an active exception") on a loaded CI machine.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skips the gloo teardown, which at times aborts it anyway
""")


def test_degrees_and_validation():
    plan = ParallelPlan(dp=8, ep=8)
    assert (plan.dp_shard, plan.ep_shard) == (8, 1)  # EP orthogonal to DP: both 8 on 8 ranks
    assert ParallelPlan(dp=8, ep=2, dp_replicate=2).dp_shard == 4
    plan.validate(8, num_experts=128)
    with pytest.raises(ValueError, match="ep=3 must divide"):
        ParallelPlan(dp=8, ep=3)
    with pytest.raises(ValueError, match="dp_replicate=3 must divide dp=8"):
        ParallelPlan(dp=8, dp_replicate=3)
    with pytest.raises(ValueError, match="positive integer"):
        ParallelPlan(dp=0)
    with pytest.raises(ValueError, match="world size is 4"):
        ParallelPlan(dp=8).validate(4)
    with pytest.raises(ValueError, match="60 experts, which ep=8 does not divide"):
        ParallelPlan(dp=8, ep=8).validate(8, num_experts=60)


def test_build_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this interpreter")
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        ParallelPlan(dp=1).build()


def test_meshes_on_four_gloo_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]

    for r, got in enumerate(ranks):
        ep2 = got["ep2"]
        assert ep2["dp_shape"] == [4] and ep2["dp_names"] == ["dp_shard"]
        assert ep2["moe_shape"] == [2, 2] and ep2["moe_names"] == ["ep_shard", "ep"]
        assert ep2["ep_group"] == [r - r % 2, r - r % 2 + 1]  # ep innermost: consecutive ranks
        assert ep2["ep_shard_group"] == [r % 2, r % 2 + 2]
        assert ep2["dp_shard_group"] == [0, 1, 2, 3]
        assert ep2["ep_rank_sum"] == sum(ep2["ep_group"])
        for plan in ("ep2", "hsdp"):
            assert abs(got[plan]["norm"] - 1240 ** 0.5) < 1e-4 and got[plan]["norm_warnings"] == [], got[plan]

        hsdp = got["hsdp"]
        assert hsdp["dp_shape"] == [2, 2] and hsdp["dp_names"] == ["dp_replicate", "dp_shard"]
        assert hsdp["moe_shape"] == [1, 4] and hsdp["ep_group"] == [0, 1, 2, 3]
        assert hsdp["dp_shard_group"] == [r - r % 2, r - r % 2 + 1]
        assert hsdp["ep_rank_sum"] == 6
