"""Grouped linear layer whose weight gradient is accumulated straight into ``.grad``.

``grouped_linear(x, w, offsets)`` computes what ``ops.grouped_mm`` does; in backward the
expert weight gradient is written into ``w.grad`` by ``ops.grouped_mm_wgrad`` (into a new
tensor on the first micro-batch, added in place on later ones) and autograd gets ``None``
for ``w``. With gradient accumulation this removes one full write and two full reads of the
expert weights' size per micro-batch (Megatron-LM's "gradient accumulation fusion").

It applies only where nothing else watches the weight's gradient: a plain leaf parameter
(not a DTensor under FSDP2 / expert parallelism) with no gradient hooks, in a single-process
job (not under DDP); :func:`fusable` checks that, and callers take plain ``ops.grouped_mm``
otherwise. Like ``loss.backward()``
it writes ``.grad``; ``torch.autograd.grad`` with respect to such a weight sees ``None``
(use ``BackendConfig(grad_accumulation="autograd")`` for that).
"""

from __future__ import annotations

import torch
from torch import nn

from polyaccel.core import ops


def fusable(w: torch.Tensor) -> bool:
    """Whether ``w``'s gradient may be accumulated inside the weight-gradient GEMM: a plain
    leaf parameter with no gradient hooks, in a single-process job (DDP reduces gradients from
    hooks on autograd's accumulator that a tensor does not show, so any multi-process job keeps
    autograd's accumulation)."""
    return (torch.is_grad_enabled() and w.requires_grad and w.is_leaf
            and type(w) in (nn.Parameter, torch.Tensor)
            and not getattr(w, "_post_accumulate_grad_hooks", None)
            and not getattr(w, "_backward_hooks", None)
            and not _multi_process())


def _multi_process() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, offsets)
        ctx.weight = w
        return ops.grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, offsets = ctx.saved_tensors
        w = ctx.weight
        dx = ops.grouped_mm(dy, w.detach().transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        if w.grad is None:
            w.grad = ops.grouped_mm_wgrad(dy, x, offsets).to(w.dtype)
        else:
            ops.grouped_mm_wgrad(dy, x, offsets, out=w.grad)
        return dx, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``ops.grouped_mm(x, w, offsets)`` with the weight gradient accumulated into ``w.grad``
    in backward (see the module docstring); plain ``ops.grouped_mm`` when not :func:`fusable`."""
    if not fusable(w):
        return ops.grouped_mm(x, w, offsets)
    return _GroupedLinear.apply(x, w, offsets)
