"""Expert parallelism on the MoE mesh, orthogonal to data parallelism.

With ``ParallelPlan(dp=W, ep=P)`` every one of the W ranks is both a data-parallel rank (its
own micro-batches; non-expert parameters FSDP-sharded over all W) and an expert-parallel
rank: the MoE mesh ``(ep_shard, ep) = (W / P, P)`` splits the E experts of each layer into P
groups of ``E / P``; rank ``(s, r)`` holds group ``r``, replicated (FSDP-sharded) over the
``W / P`` ranks of its ``ep_shard`` column. On 4 ranks with ep=2::

    moe_mesh  ep=0   ep=1          rank 0: experts 0..E/2-1, dp shard 0/4 of the rest
    shard 0   r0     r1            rank 1: experts E/2..E-1, dp shard 1/4
    shard 1   r2     r3            rank 2: experts 0..E/2-1, dp shard 2/4 ...

Expert weights become DTensor ``Shard(0)`` over ``ep`` and get their own FSDP2 unit over
``ep_shard`` (``Shard(1)``), so block-level FSDP over ``dp`` leaves them alone.

Gradient scale. Each rank's loss is its share of the global mean, so FSDP's average over the
W data-parallel ranks gives the global gradient of the non-expert weights. An expert shard's
local gradient already *sums* the contributions of all P ranks of its EP group (the dispatcher's
backward brings them home); summing over its ``ep_shard`` replicas then covers every token
once per rank of the world, i.e. W times the per-rank scale. So the expert gradients are
reduced with a divide factor of W (not ``ep_shard``), and both kinds of weights see exactly
the single-process gradient of the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyaccel.core.parallel import ParallelMeshes
from polyaccel.moe.dispatchers import make_dispatcher
from polyaccel.moe.layers import Experts

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[Experts]:
    """The model's fused-experts modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, Experts)]


def check_expert_parallel(model: nn.Module, ep: int, world_size: int | None = None) -> None:
    """Raise ``ValueError`` unless ``ep`` divides every layer's expert count (and the world size)."""
    if world_size is not None and world_size % ep:
        raise ValueError(f"ep={ep} does not divide the world size {world_size}: expert parallelism "
                         f"reuses the data-parallel ranks, so ep must divide their number")
    for m in expert_modules(model):
        if m.num_experts % ep:
            raise ValueError(f"the model has {m.num_experts} experts per layer, which ep={ep} does not "
                             f"divide; pick an ep that divides both {m.num_experts} and the world size")


def apply_expert_parallel(model: nn.Module, meshes: ParallelMeshes, *, dispatcher: str | None = None,
                          mp_policy: Any = None, reshard_after_forward: bool = True) -> nn.Module:
    """Shard every :class:`Experts` of ``model`` over ``meshes.moe["ep"]`` in place; returns it.

    Experts holding all E experts are sliced to this rank's ``E / ep`` (as after a plain load);
    experts already holding ``E / ep`` (as :func:`polyaccel.moe.ep_checkpoint.load_expert_parallel`
    loads them) are used as they are. Each becomes an FSDP2 unit over ``ep_shard`` whose gradients
    are divided by the world size (see the module docstring), so call this *before* the
    block-level ``fully_shard`` over ``meshes.dp``. A no-op when ``ep == 1``.

    :param dispatcher: a :data:`polyaccel.moe.dispatchers.DISPATCHERS` name; default the model's
        ``backend_config.dispatcher`` (or ``"auto"``).
    :param mp_policy: FSDP2 ``MixedPrecisionPolicy`` for the expert units (match the blocks').
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    ep_mesh, shard_mesh = meshes.moe["ep"], meshes.moe["ep_shard"]
    ep = ep_mesh.size()
    world = meshes.moe.size()
    if ep == 1:
        return model
    check_expert_parallel(model, ep, world)
    if dispatcher is None:
        dispatcher = getattr(getattr(model, "backend_config", None), "dispatcher", "auto")
    rank = ep_mesh.get_local_rank()
    # gloo has no PREMUL_SUM: reduce with SUM and scale after. (Not on one rank: torch 2.13's
    # single-rank path would then divide twice.)
    force_sum = shard_mesh.size() > 1 and dist.get_backend(shard_mesh.get_group()) == "gloo"
    for experts in expert_modules(model):
        E = experts.num_experts
        E_local = E // ep
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            if isinstance(p, DTensor):
                raise RuntimeError(f"{name} is already a DTensor: apply_expert_parallel was called twice")
            if p.shape[0] == E:
                local = p.detach()[rank * E_local:(rank + 1) * E_local].clone()
            elif p.shape[0] == E_local:
                local = p.detach()
            else:
                raise ValueError(f"{name} has {p.shape[0]} experts; expected all {E} or this rank's {E_local}")
            dt = DTensor.from_local(local.contiguous(), ep_mesh, [Shard(0)], run_check=False)  # global [E, ...]
            setattr(experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))
        experts.dispatcher = make_dispatcher(dispatcher, ep_mesh.get_group(), E, local.device)
        kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
        fully_shard(experts, mesh=shard_mesh, shard_placement_fn=lambda _p: Shard(1),
                    reshard_after_forward=reshard_after_forward, **kwargs)
        experts.set_gradient_divide_factor(float(world))
        if force_sum:
            experts.set_force_sum_reduction_for_comms(True)
    return model


def clip_grad_norm_(parameters: Any, max_norm: float | None, norm_type: float = 2.0) -> torch.Tensor:
    """Global gradient norm (clipped to ``max_norm`` when given) for parameters that live on
    different device meshes (FSDP's dp mesh and the experts' MoE mesh), where
    ``torch.nn.utils.clip_grad_norm_`` would mix meshes. Returns the norm before clipping as
    a plain tensor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    parts = []
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, norm_type)
        parts.append((n.full_tensor() if isinstance(n, DTensor) else n).float())
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    if norm_type == float("inf"):
        total = torch.stack([p.to(device) for p in parts]).max()
    else:
        total = torch.stack([p.to(device) ** norm_type for p in parts]).sum() ** (1.0 / norm_type)
    if max_norm:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        if coef < 1.0:
            for gs in groups.values():
                torch._foreach_mul_(gs, coef)
    return total


__all__ = ["EXPERT_PARAMS", "apply_expert_parallel", "check_expert_parallel", "clip_grad_norm_", "expert_modules"]
