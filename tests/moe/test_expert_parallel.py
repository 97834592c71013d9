"""Expert parallelism on the MoE mesh, orthogonal to data parallelism (FSDP2 or dense
replicas): gloo processes (this file re-run as a script, one process per rank) against one
process on the same global batch. Forward logits, loss, every parameter's gradient and a few
AdamW steps must match."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SEQ, PER_RANK = 8, 2  # tokens per sequence, sequences per rank


def _config():
    from polyaccel.moe.presets import tiny

    # 3 layers (one dense), 8 experts top-2, fp32; no aux loss so the loss is the token loss.
    return tiny("qwen3_moe", router_aux_loss_coef=0.0)


def _model(dispatcher: str = "nccl_a2a", grad_accumulation: str = "autograd"):
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.float32,
                                             backend=BackendConfig(backend="cpu", loss="standard",
                                                                   dispatcher=dispatcher,
                                                                   grad_accumulation=grad_accumulation))
    return model.train()


def _batch(world: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, _config().vocab_size, (world * PER_RANK, SEQ), generator=g)


def _loss(model, ids: torch.Tensor, n_global: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss summed over these rows / global target count, logits)."""
    out = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(float(n_global)), use_cache=False)
    return out.loss, out.logits


# --------------------------------------------------------------------------------------------
# Worker (one rank): python test_expert_parallel.py RANK WORLD JOBS (JSON: see _launch_all)
# --------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, ep: int, port: int, out: Path, dispatcher: str, ckpt: bool, steps: int,
            dense: str) -> None:
    """``dense``: ``fsdp`` (FSDP2 over the world, DTensor experts) or ``replicate``
    (polyaccel.moe.dense_replicas: whole dense weights, plain expert blocks, fused expert
    weight gradients, fixed-size allgather dispatch when ``dispatcher`` is allgather)."""
    import torch.distributed as dist

    from polyaccel.core.parallel import ParallelPlan
    from polyaccel.moe.dense_replicas import apply_dense_replicas
    from polyaccel.moe.expert_parallel import clip_grad_norm_
    from polyaccel.moe.parallelize import apply_fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    replicate = dense == "replicate"
    model = _model(dispatcher, grad_accumulation="fused" if replicate else "autograd")
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = ParallelPlan(dp=world, ep=ep)
    meshes = plan.build(world, "cpu")
    if replicate:
        sync = apply_dense_replicas(model, meshes, dispatcher=dispatcher,
                                    tokens_per_rank=PER_RANK * SEQ if dispatcher == "allgather" else None)
        scale = 1  # each rank's share of the global loss; GradientSync sums the gradients
        sync_grads = sync.all_reduce

        def clip(max_norm):
            from polyaccel.moe.optim import clip_coefficient

            norm = sync.grad_norm()
            coef = clip_coefficient(norm, max_norm)
            if coef is not None:
                torch._foreach_mul_([p.grad for p in model.parameters()], coef)
            return norm

        def full_grads():
            ep_group = meshes.moe["ep"].get_group()
            out_ = {}
            for n, p in model.named_parameters():
                if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    full = p.grad.new_empty((ep * p.shape[0], *p.shape[1:]))
                    dist.all_gather_into_tensor(full, p.grad.contiguous(), group=ep_group)
                    out_[n] = full
                else:
                    out_[n] = p.grad.clone()
            return out_
    else:
        apply_fsdp(model, plan, meshes, param_dtype=torch.float32)
        scale = world  # FSDP averages over the world: the global mean's gradient

        def sync_grads():
            pass  # FSDP reduced them in backward

        def clip(max_norm):
            return clip_grad_norm_(model.parameters(), max_norm)

        def full_grads():
            return {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    experts = model.model.layers[0].mlp.experts
    if replicate:
        from polyaccel.moe.grouped_linear import fusable

        assert fusable(experts.gate_up_proj)  # fused expert weight gradients in a multi-process job
    local = experts.gate_up_proj.to_local() if hasattr(experts.gate_up_proj, "to_local") else experts.gate_up_proj
    assert local.shape[0] == 8 // ep  # only this rank's experts

    ids = _batch(world)
    n_global = ids.shape[0] * (SEQ - 1)
    mine = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    loss, logits = _loss(model, mine, n_global)
    (loss * scale).backward()
    sync_grads()
    norm = clip(None)
    grads = full_grads()
    total = loss.detach().clone()
    dist.all_reduce(total)
    result = {"loss": total, "logits": logits.detach(), "grads": grads, "grad_norm": norm}

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        if step:
            opt.zero_grad()
            ids = _batch(world, step)
            loss, _ = _loss(model, ids[rank * PER_RANK:(rank + 1) * PER_RANK], n_global)
            (loss * scale).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            sync_grads()
        clip(1.0)
        opt.step()
        losses.append(float(total))
    result["losses"] = losses
    if replicate:
        from polyaccel.moe.ep_checkpoint import full_state_dict

        result["state"] = full_state_dict(model)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()



def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_all(tmp_path: Path, world: int, runs: dict[str, dict], timeout: float = 150) -> dict[str, list[dict]]:
    """Run every configuration of ``runs`` (name -> :func:`_worker`'s keyword arguments but rank,
    world, port and out) one after the other in one set of ``world`` gloo processes, each run
    in a process group of its own (a fresh port): one interpreter start-up and import (seconds
    per rank on 2 cores) for several runs. Returns each run's per-rank results."""
    import json

    jobs = [dict(kw, port=_free_port(), out=str(tmp_path / name)) for name, kw in runs.items()]
    for job in jobs:
        Path(job["out"]).mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), json.dumps(jobs)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return {name: [torch.load(tmp_path / name / f"rank{r}.pt", weights_only=False) for r in range(world)]
            for name in runs}


# The two runs on 2 ranks share their processes, and so do the two on 4 ranks.
RUNS_2 = {"ep2_ckpt_adamw": dict(ep=2, dispatcher="nccl_a2a", ckpt=True, steps=3, dense="fsdp"),
          "dense_replicas_ep2": dict(ep=2, dispatcher="allgather", ckpt=True, steps=3, dense="replicate")}
RUNS_4 = {"dp4_ep2": dict(ep=2, dispatcher="allgather", ckpt=False, steps=0, dense="fsdp"),
          "dense_replicas_dp4_ep2": dict(ep=2, dispatcher="nccl_a2a", ckpt=False, steps=0, dense="replicate")}


@pytest.fixture(scope="module")
def on_2_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    return _launch_all(tmp_path_factory.mktemp("ep_2_ranks"), 2, RUNS_2)


@pytest.fixture(scope="module")
def on_4_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    return _launch_all(tmp_path_factory.mktemp("ep_4_ranks"), 4, RUNS_4)


def _reference(world: int, steps: int = 0) -> dict:
    """One process, the whole global batch, the plain mean loss."""
    model = _model()
    ids = _batch(world)
    loss, logits = _loss(model, ids, ids.shape[0] * (SEQ - 1))
    loss.backward()
    ref = {"loss": loss.detach(), "logits": logits.detach(),
           "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
           "grad_norm": torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        if step:
            opt.zero_grad()
            ids = _batch(world, step)
            loss, _ = _loss(model, ids, ids.shape[0] * (SEQ - 1))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    ref["losses"] = losses
    ref["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return ref


def _assert_matches(results: list[dict], ref: dict) -> None:
    tol = dict(rtol=1e-5, atol=1e-5)
    for r in results:
        torch.testing.assert_close(r["loss"], ref["loss"], **tol)
        torch.testing.assert_close(r["grad_norm"], ref["grad_norm"], **tol)
    torch.testing.assert_close(torch.cat([r["logits"] for r in results]), ref["logits"], **tol)
    assert results[0]["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name  # every parameter gets a gradient in this test
        for r in results:
            torch.testing.assert_close(r["grads"][name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.timeout(150)
def test_ep2_on_2_ranks_matches_one_process_with_checkpointing_and_adamw(on_2_ranks):
    """(a) + (c): world 2, dp 2, ep 2, all-to-all dispatcher, activation checkpointing (routing
    recomputed identically): logits, loss, all gradients and 3 AdamW steps match."""
    results = on_2_ranks["ep2_ckpt_adamw"]
    ref = _reference(world=2, steps=3)
    _assert_matches(results, ref)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(150)
def test_dp4_ep2_on_4_ranks_matches_one_process(on_4_ranks):
    """(b): FSDP over all 4 ranks for the rest, experts in 2 groups replicated over
    ep_shard=2: expert gradients averaged over the replicas at the right scale."""
    _assert_matches(on_4_ranks["dp4_ep2"], _reference(world=4))


@pytest.mark.timeout(150)
def test_dense_replicas_ep2_on_2_ranks_match_one_process(on_2_ranks):
    """Dense replicas: whole non-expert weights on both ranks, one expert block each, the
    fixed-size allgather dispatcher, fused expert weight gradients, activation checkpointing:
    gradients after GradientSync, the global norm, 3 clipped AdamW steps and the gathered
    final weights all match one process."""
    results = on_2_ranks["dense_replicas_ep2"]
    ref = _reference(world=2, steps=3)
    _assert_matches(results, ref)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    state = results[0]["state"]  # gathered on rank 0 (polyaccel.moe.ep_checkpoint.full_state_dict)
    assert state.keys() == ref["state"].keys()
    for name, t in ref["state"].items():
        # Adam turns fp32 round-off in near-zero gradients into ~1e-5 moves (lr 1e-2)
        torch.testing.assert_close(state[name], t, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.timeout(150)
def test_dense_replicas_dp4_ep2_sum_expert_grads_over_replicas(on_4_ranks):
    """4 ranks, ep=2: each expert block lives on 2 ranks (ep_shard=2), whose gradients
    GradientSync sums; all-to-all dispatcher."""
    _assert_matches(on_4_ranks["dense_replicas_dp4_ep2"], _reference(world=4))


def test_clear_errors_without_processes():
    """(f): experts not divisible by ep, ep not dividing the world, symm_mem on CPU, no DeepEP."""
    from polyaccel.core.parallel import ParallelPlan
    from polyaccel.moe import BackendConfig
    from polyaccel.moe.dispatchers import DispatcherUnavailable, make_dispatcher, require_symm_mem
    from polyaccel.moe.expert_parallel import check_expert_parallel

    model = _model()
    with pytest.raises(ValueError, match="8 experts per layer, which ep=3 does not divide"):
        check_expert_parallel(model, 3, 3)
    with pytest.raises(ValueError, match="ep=3 does not divide the world size 4"):
        check_expert_parallel(model, 3, 4)
    with pytest.raises(ValueError, match="ep=3 must divide"):
        ParallelPlan(dp=4, ep=3)
    with pytest.raises(DispatcherUnavailable, match="symm_mem' needs CUDA tensors"):
        require_symm_mem("cpu")
    with pytest.raises(DispatcherUnavailable, match="symm_mem' needs CUDA"):
        make_dispatcher("symm_mem", group=None, num_experts=8, device="cpu")
    with pytest.raises(ImportError, match="needs DeepEP"):
        BackendConfig(dispatcher="deepep")
    with pytest.raises(ValueError, match="dispatcher='nope' is not supported"):
        BackendConfig(dispatcher="nope")


if __name__ == "__main__":
    import json

    a = sys.argv[1:]
    for job in json.loads(a[2]):
        _worker(int(a[0]), int(a[1]), job["ep"], job["port"], Path(job["out"]), job["dispatcher"], job["ckpt"],
                job["steps"], job["dense"])
    sys.stdout.flush()
    os._exit(0)  # skips the gloo teardown, which at times aborts a finished worker (exit -6)


def test_experts_under_expert_parallelism_run_outside_torch_compile():
    """With a dispatcher (EP), a compiled decoder layer calls the experts eagerly, so their own
    FSDP2 unit's unshard hooks run; without one the experts are traced like the rest."""
    from polyaccel.moe.layers import call_experts

    class Probe(torch.nn.Module):
        def __init__(self, dispatcher):
            super().__init__()
            self.dispatcher = dispatcher
            self.compiling = None

        def forward(self, x, idx, w):
            self.compiling = torch.compiler.is_compiling()
            return x * 2

    x, idx, w = torch.randn(4, 3), torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
    for dispatcher, traced in ((object(), False), (None, True)):
        probe = Probe(dispatcher)
        torch._dynamo.reset()
        out = torch.compile(lambda a, b, c, m=probe: call_experts(m, a, b, c) + 1, backend="eager")(x, idx, w)
        torch.testing.assert_close(out, x * 2 + 1)
        assert probe.compiling is traced
