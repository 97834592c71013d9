"""Token embedding whose weight gradient is added straight into ``.grad``.

Autograd's embedding backward writes a dense [V, H] gradient (zeros but for the batch's
tokens: 622 MB for a 151,936 x 2,048 bf16 table) and ``AccumulateGrad`` then reads it and
``.grad`` and writes ``.grad``: ~2 GB of memory traffic per micro-batch to add a few thousand
rows. Here the backward sums the rows of each distinct token in fp32 (sort, segment sums) and
adds those sums into the rows of ``.grad`` in place (the same two roundings as autograd's
path: the row sum to the parameter dtype, then the addition). No host synchronization, so a
CUDA graph can capture it.

Used by the polyaccel MoE models with ``BackendConfig(grad_accumulation="fused")`` where
:func:`~polyaccel.moe.grouped_linear.fusable` allows it (a plain leaf weight, no hooks, one
process) and the embedding module has no forward hooks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polyaccel.moe.grouped_linear import fusable


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx):  # noqa: ANN001, ANN205
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        add_rows_into_grad(w, ids.reshape(-1), dy.reshape(-1, w.shape[1]), ctx.padding_idx)
        return None, None, None


def add_rows_into_grad(w: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, padding_idx: int | None = None) -> None:
    """``w.grad[ids[i]] += rows[i]`` for all i (creating ``w.grad`` as zeros if missing), with
    each distinct id's rows summed in fp32 first; rows of ``padding_idx`` are dropped."""
    if padding_idx is not None:
        rows = rows.masked_fill((ids == padding_idx)[:, None], 0)
    sorted_ids, perm = ids.sort()
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment = starts.cumsum(0) - 1  # distinct id number of each sorted row
    sums = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device).index_add_(0, segment, rows[perm].float())
    # Segment s adds into row segment_ids[s]; the unused segments (zero sums) into row 0.
    segment_ids = torch.zeros_like(sorted_ids).scatter_(0, segment, sorted_ids)
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    w.grad.index_add_(0, segment_ids, sums.to(w.grad.dtype))


def embedding(ids: torch.Tensor, module: nn.Embedding) -> torch.Tensor:
    """``module(ids)``, with the weight gradient added into ``.grad`` in backward where
    nothing else watches it (see the module docstring); else plain ``module(ids)``."""
    if (module._forward_hooks or module._forward_pre_hooks or not fusable(module.weight)
            or module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        return module(ids)
    return _Embedding.apply(ids, module.weight, module.padding_idx)
