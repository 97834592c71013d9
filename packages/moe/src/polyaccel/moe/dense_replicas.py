"""Expert parallelism with the dense weights replicated: the fast layout on a few GPUs.

FSDP2 (:mod:`polyaccel.moe.parallelize`) shards every non-expert weight and gathers it back
for each layer's forward and backward. That saves memory, but it puts host-driven collectives
and hooks between the layers, so neither the CUDA-graphed micro-step nor FlatAdamW's flat
buffers can run under it. With ``parallel.dense: replicate`` every rank keeps a whole copy of
the non-expert weights (attention, norms, router, embeddings, LM head: 0.78 B parameters of
the 5.6 B in "qwen3-30b-a3b-L8", 6 GB with bf16 AdamW state) and only the experts are split:
rank ``(s, r)`` of the MoE mesh ``(ep_shard, ep)`` holds expert block ``r`` as plain
``[E / ep, ...]`` tensors, and the layer's dispatcher moves token copies to them and back.

Gradients. Each rank back-propagates the sum of its token losses over the *global* target
count, so the global loss is the sum of the ranks' losses. The dispatcher's backward already
brings every EP-group rank's contribution home to an expert block; after the step's last
micro-batch :meth:`GradientSync.all_reduce` sums the dense gradients over all ranks and the
expert gradients over the ``ep_shard`` replicas of each block (nothing when ``ep`` equals
the world size). Both then hold exactly the single-process gradient of the global batch, and
every rank's optimizer makes the same dense update.

Checkpoints. :func:`polyaccel.moe.ep_checkpoint.save_pretrained` (and ``full_state_dict``)
all-gathers the expert blocks into the whole ``[E, ...]`` tensors (a collective), which rank 0
writes as a standard Hugging Face checkpoint; the trainer saves the optimizer state per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyaccel.core.parallel import ParallelMeshes
from polyaccel.moe.dispatchers import make_dispatcher
from polyaccel.moe.expert_parallel import EXPERT_PARAMS, check_expert_parallel, expert_modules
from polyaccel.moe.grouped_linear import mark_caller_syncs_grad


class GradientSync:
    """Gradient all-reduces and the global gradient norm of a model laid out by
    :func:`apply_dense_replicas`.

    :param model: the model (its experts already hold this rank's block).
    :param ep_group, shard_group: the MoE mesh's ``ep`` and ``ep_shard`` process groups.
    """

    def __init__(self, model: nn.Module, ep_group: Any, shard_group: Any) -> None:
        self.model = model
        self.ep_group, self.shard_group = ep_group, shard_group
        self.ep = dist.get_world_size(ep_group)
        self.replicas = dist.get_world_size(shard_group)
        expert_ids = {id(getattr(m, name)) for m in expert_modules(model) for name in EXPERT_PARAMS}
        params = [p for p in model.parameters() if p.requires_grad]
        self.expert_params = [p for p in params if id(p) in expert_ids]
        self.dense_params = [p for p in params if id(p) not in expert_ids]

    def all_reduce(self) -> None:
        """Sum the dense gradients over all ranks and the expert gradients over each block's
        replicas, in place (call after the step's last backward, before clipping/stepping).
        Gradients that are adjacent in memory (FlatAdamW's flat buffer) go in one call."""
        if dist.get_world_size() > 1:
            for span in _adjacent_spans(_grads(self.dense_params)):
                dist.all_reduce(span)
        if self.replicas > 1:
            for span in _adjacent_spans(_grads(self.expert_params)):
                dist.all_reduce(span, group=self.shard_group)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (synchronized) gradients: the dense part once, each expert
        block once. Stays on the device (no host sync); clip with
        :func:`polyaccel.moe.optim.clip_coefficient` and ``step_scaled``."""
        sq_dense = _norm(_grads(self.dense_params)).square()
        sq_experts = _norm(_grads(self.expert_params)).square()
        if self.ep > 1:
            dist.all_reduce(sq_experts, group=self.ep_group)
        return (sq_dense + sq_experts).sqrt()


def apply_dense_replicas(model: nn.Module, meshes: ParallelMeshes, *, dispatcher: str | None = None,
                         tokens_per_rank: int | None = None) -> GradientSync:
    """Give every :class:`~polyaccel.moe.layers.Experts` of ``model`` this rank's ``E / ep``
    experts as plain parameters and a dispatcher over ``meshes.moe["ep"]``; the other weights
    stay whole on every rank. Returns the :class:`GradientSync` to call after each step's
    backward. Experts holding all E experts are sliced (as after a plain load); experts
    already holding ``E / ep`` are used as they are.

    :param dispatcher: a :data:`~polyaccel.moe.dispatchers.DISPATCHERS` name; default the
        model's ``backend_config.dispatcher``. ``"auto"`` here means ``allgather`` when
        ``tokens_per_rank`` is given (no host sync, capturable in a CUDA graph, and fewer bytes
        than the all-to-all while ep < top-k; measured on 2x H200), else the usual choice.
    :param tokens_per_rank: every rank's token count per micro-batch, when fixed (the trainer's
        ``micro_batch * seq_len``): lets the ``allgather`` dispatcher skip its per-call size
        exchange, so it never waits on the host and can be captured in a CUDA graph.
    """
    ep_mesh, shard_mesh = meshes.moe["ep"], meshes.moe["ep_shard"]
    ep = ep_mesh.size()
    check_expert_parallel(model, ep, meshes.moe.size())
    if dispatcher is None:
        dispatcher = getattr(getattr(model, "backend_config", None), "dispatcher", "auto")
    if dispatcher == "auto" and tokens_per_rank is not None:
        dispatcher = "allgather"
    rank = ep_mesh.get_local_rank()
    for experts in expert_modules(model):
        E = experts.num_experts
        E_local = E // ep
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            if p.shape[0] == E and ep > 1:
                local = p.detach()[rank * E_local:(rank + 1) * E_local].clone()
                setattr(experts, name, nn.Parameter(local, requires_grad=p.requires_grad))
            elif p.shape[0] != E_local:
                raise ValueError(f"{name} has {p.shape[0]} experts; expected all {E} or this rank's {E_local}")
        if ep > 1:
            experts.dispatcher = make_dispatcher(dispatcher, ep_mesh.get_group(), E, p.device,
                                                 tokens_per_rank=tokens_per_rank)
    for p in model.parameters():  # all reduced by GradientSync: kernels may write their .grad
        mark_caller_syncs_grad(p)
    return GradientSync(model, ep_mesh.get_group(), shard_mesh.get_group())


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The params' gradients, zeros for params that got none (every rank must send the same
    tensors in the same order)."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def _adjacent_spans(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Neighbours in ``tensors`` merged into one 1-D view where they lie back to back in one
    storage (FlatAdamW's flat gradient buffer). The order is the parameters' (the same on every
    rank, as is the buffer layout), so every rank makes the same collectives."""
    spans: list[torch.Tensor] = []
    start = None
    for t in tensors:
        if not t.is_contiguous():
            spans.append(t)
            start = None
            continue
        if (start is not None and t.dtype == start.dtype
                and t.untyped_storage().data_ptr() == start.untyped_storage().data_ptr()
                and t.data_ptr() == start.data_ptr() + spans[-1].numel() * t.element_size()):
            spans[-1] = _view(start, spans[-1].numel() + t.numel())
            continue
        start = t
        spans.append(t.view(-1))
    return spans


def _view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of ``first``'s storage, starting where ``first`` does."""
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,))


def _norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of ``tensors`` together, fp32, on their device (0 for none)."""
    if not tensors:
        return torch.zeros(())
    return torch.nn.utils.get_total_norm(tensors).float()


__all__ = ["GradientSync", "apply_dense_replicas"]
