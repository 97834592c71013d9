"""Grouped linear layer whose weight gradient is accumulated straight into ``.grad``.

``grouped_linear(x, w, offsets)`` computes what ``ops.grouped_mm`` does; in backward the
expert weight gradient is written into ``w.grad`` by ``ops.grouped_mm_wgrad`` (into a new
tensor on the first micro-batch, added in place on later ones) and autograd gets ``None``
for ``w``. With gradient accumulation this removes one full write and two full reads of the
expert weights' size per micro-batch (Megatron-LM's "gradient accumulation fusion").

It applies only where nothing else watches the weight's gradient: a plain leaf parameter
(not a DTensor under FSDP2 / expert parallelism) with no gradient hooks, in a single-process
job (not under DDP); :func:`fusable` checks that, and callers take plain ``ops.grouped_mm``
otherwise. Like ``loss.backward()`` it writes ``.grad``; ``torch.autograd.grad`` with respect
to such a weight sees ``None`` (use ``BackendConfig(grad_accumulation="autograd")`` for that).

:func:`fused_backward` goes further for a training loop that owns the optimizer
(:class:`polyaccel.moe.graphed_step.GraphedMicroStep`): the last micro-batch's kernel also
takes the AdamW step, and the next step's first micro-batch writes over the old gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

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


@dataclasses.dataclass
class _Fused:
    """What :func:`grouped_linear`'s backward does differently for some weights, within
    :func:`fused_backward`."""

    step: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    keep_grad: bool
    overwrite: set[torch.Tensor]
    done: set[torch.Tensor] = dataclasses.field(default_factory=set)


_CTX: list[_Fused] = []


@contextlib.contextmanager
def fused_backward(step: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                   keep_grad: bool = False, overwrite: Iterable[torch.Tensor] = ()) -> Iterator[set[torch.Tensor]]:
    """Within, the backward of :func:`grouped_linear`:

    - for a weight in ``step`` (weight -> ``(exp_avg, exp_avg_sq, scalars)`` of a
      :class:`~polyaccel.moe.optim.FlatAdamW` step begun with ``begin_step``) also applies that
      AdamW step in the weight-gradient kernel's epilogue (``ops.grouped_mm_wgrad_adamw_``),
      then zeroes ``.grad`` (``keep_grad=True``: leaves it, for a next micro-batch that
      overwrites it). For the last micro-batch of a step, with no gradient clipping.
    - for a weight in ``overwrite`` writes its gradient over ``.grad`` instead of adding to it
      (the first micro-batch after a ``keep_grad`` step: no zeroing pass, no read).

    Yields the set of weights so handled; the caller takes care of the others.
    """
    if _CTX:
        raise RuntimeError("fused_backward does not nest")
    ctx = _Fused(dict(step or {}), keep_grad, set(overwrite))
    _CTX.append(ctx)
    try:
        yield ctx.done
    finally:
        _CTX.clear()


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
        fused = _CTX[0] if _CTX else None
        first = fused is not None and w in fused.overwrite and w not in fused.done
        if fused is not None and w in fused.step and w.grad is not None:  # (dx is computed before w changes)
            if w in fused.done:
                raise RuntimeError("fused_backward: a weight stepped in its backward was used twice")
            ops.grouped_mm_wgrad_adamw_(dy, x, offsets, w.grad, w.detach(), *fused.step[w],
                                        accumulate=not first, zero_grad=not fused.keep_grad)
            fused.done.add(w)
        elif w.grad is None:
            w.grad = ops.grouped_mm_wgrad(dy, x, offsets).to(w.dtype)
        else:
            ops.grouped_mm_wgrad(dy, x, offsets, out=w.grad, accumulate=not first)
            if first:
                fused.done.add(w)
        return dx, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``ops.grouped_mm(x, w, offsets)`` with the weight gradient accumulated into ``w.grad``
    in backward (see the module docstring); plain ``ops.grouped_mm`` when not :func:`fusable`."""
    if not fusable(w):
        return ops.grouped_mm(x, w, offsets)
    return _GroupedLinear.apply(x, w, offsets)
