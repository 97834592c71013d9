"""Data parallelism for a Hugging Face decoder: FSDP2 per decoder layer plus the root.

Each decoder layer (the classes in the model's ``_no_split_modules``) becomes one FSDP2 unit,
so its parameters are all-gathered just before it runs and freed after; the root unit holds
the embeddings, final norm and LM head. With ``ep > 1`` the experts are first sharded over the
MoE mesh (:mod:`polyaccel.moe.expert_parallel`) and the layer units leave them alone.
"""

from __future__ import annotations

import torch
from torch import nn

from polyaccel.core.parallel import ParallelMeshes, ParallelPlan


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder blocks: modules whose class is named in
    ``_no_split_modules`` (Transformers' convention), else the entries of the longest
    ``ModuleList`` called ``layers`` (``model.model.layers``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        lists = [m for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] == "layers"]
        layers = list(max(lists, key=len)) if lists else []
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules, "
                         "no ModuleList named 'layers'); cannot place FSDP units")
    return layers


def apply_fsdp(model: nn.Module, plan: ParallelPlan, meshes: ParallelMeshes, *,
               param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over ``meshes.dp`` and return it.

    Computation runs in ``param_dtype`` and gradients are reduced in ``reduce_dtype``
    (``MixedPrecisionPolicy``); the sharded parameters keep the dtype they had. Gradients are
    averaged over the data-parallel ranks. During gradient accumulation call
    ``model.set_requires_gradient_sync(is_last_micro_batch)``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if plan.ep > 1:  # experts: DTensor Shard(0) over "ep", own FSDP units over "ep_shard" (first)
        from polyaccel.moe.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them.
        fully_shard(layer, mesh=meshes.dp, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=meshes.dp, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
