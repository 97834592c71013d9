"""How training ranks are laid out: a data-parallel mesh and, beside it, a MoE mesh.

Non-expert parameters are sharded (FSDP2) over the data-parallel mesh, optionally as HSDP
(``dp_replicate`` replicas of ``dp_shard`` shards). Experts live on a separate
``moe_mesh`` of shape ``(ep_shard, ep)`` spanning the *same* ranks: ``ep`` ranks split the
experts between them and ``ep_shard = world / ep`` ranks hold (an FSDP shard of) the same
experts. So expert parallelism is orthogonal to data parallelism: on 8 GPUs, dp=8 *and*
ep=8, rather than ep x dp = 8.

Rank order: ``ep`` is the innermost (fastest-varying) dimension of the MoE mesh, so an EP
group is ``ep`` consecutive ranks (one NVLink island first); ``dp_shard`` is innermost in
the data-parallel mesh.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelMeshes:
    """The meshes :meth:`ParallelPlan.build` returns.

    Attributes:
        dp: ``("dp_shard",)`` or, with HSDP, ``("dp_replicate", "dp_shard")``.
        moe: ``("ep_shard", "ep")``.
    """

    dp: torch.distributed.device_mesh.DeviceMesh
    moe: torch.distributed.device_mesh.DeviceMesh


@dataclasses.dataclass(frozen=True, slots=True)
class ParallelPlan:
    """Data and expert parallel degrees of a training job.

    Attributes:
        dp: data-parallel degree (ranks that see different data); must equal the world size
            (no tensor or pipeline parallelism yet).
        ep: expert-parallel degree; divides the world size and the number of experts.
        dp_replicate: HSDP replicas; ``dp_shard = dp // dp_replicate`` ranks shard each replica.
    """

    dp: int
    ep: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "ep", "dp_replicate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ParallelPlan.{name} must be a positive integer, got {v!r}")
        if self.dp % self.dp_replicate:
            raise ValueError(f"dp_replicate={self.dp_replicate} must divide dp={self.dp}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide the number of ranks (dp={self.dp}): "
                             f"expert parallelism reuses the data-parallel ranks")

    @property
    def dp_shard(self) -> int:
        """Ranks that shard one replica of the non-expert parameters."""
        return self.dp // self.dp_replicate

    @property
    def ep_shard(self) -> int:
        """Ranks holding the same experts (FSDP-sharded between them)."""
        return self.dp // self.ep

    def validate(self, world_size: int, num_experts: int | None = None) -> None:
        """Raise ``ValueError`` unless this plan fits ``world_size`` ranks (and the model's
        ``num_experts``, when known)."""
        if self.dp != world_size:
            raise ValueError(f"ParallelPlan(dp={self.dp}) needs exactly {self.dp} ranks, but the world "
                             f"size is {world_size}; set dp to the world size")
        if world_size % self.ep:
            raise ValueError(f"ep={self.ep} must divide the world size {world_size}")
        if num_experts is not None and num_experts % self.ep:
            raise ValueError(f"the model has {num_experts} experts, which ep={self.ep} does not divide; "
                             f"pick ep among {[e for e in range(1, world_size + 1) if num_experts % e == 0 and world_size % e == 0]}")

    def build(self, world_size: int | None = None, device_type: str | None = None) -> ParallelMeshes:
        """Create the data-parallel and MoE device meshes (torch.distributed must be initialised).

        :param world_size: defaults to ``torch.distributed.get_world_size()``.
        :param device_type: ``"cuda"``, ``"cpu"``...; defaults to cuda when available.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if not torch.distributed.is_initialized():
            raise RuntimeError("ParallelPlan.build needs torch.distributed initialised "
                               "(run under torchrun or Ray Train, or call init_process_group)")
        world_size = world_size or torch.distributed.get_world_size()
        self.validate(world_size)
        device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.dp_replicate > 1:
            dp_mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                       mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            dp_mesh = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        moe_mesh = init_device_mesh(device_type, (self.ep_shard, self.ep), mesh_dim_names=("ep_shard", "ep"))
        for mesh in (dp_mesh, moe_mesh):
            _flatten(mesh)
        return ParallelMeshes(dp=dp_mesh, moe=moe_mesh)


def _flatten(mesh) -> None:  # noqa: ANN001
    """Give a 2-D mesh a flattened view of its two dims, so a reduction over both (a gradient
    norm) is one collective, not two in a row (which DTensor warns about at every first use)."""
    names = mesh.mesh_dim_names or ()
    if len(names) == 2 and hasattr(mesh, "_flatten"):
        mesh[names]._flatten("_".join(names))
