"""Token dispatchers: move each token copy to the rank that holds its expert, and back.

Under expert parallelism the ``ep`` ranks of an EP group each hold ``E / ep`` experts (rank
``r`` holds global experts ``r * E_local ... (r + 1) * E_local - 1``). A dispatcher turns the
router's choice on every rank into, on every rank, the rows its own experts must process,
grouped by local expert so one grouped GEMM pair runs them; ``combine`` brings the expert
outputs back to the tokens' ranks and applies the top-k weights.

    x [T, H], idx [T, k], w [T, k]
      --dispatch-->  x_local [R, H] (rows grouped by local expert), counts [E_local], handle
      --experts--->  y_local [R, H]
      --combine--->  out [T, H] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])

Implementations (``BackendConfig.dispatcher``):

- ``nccl_a2a``: sort copies by global expert, exchange per-expert counts (one host sync for
  the split sizes), ``all_to_all_single`` there and back. Traffic per rank ~ T * k * H.
- ``allgather``: all-gather the tokens of the EP group, run local experts on the copies routed
  to them, reduce-scatter the partial outputs. Traffic per rank ~ ep * T * H both ways; what
  NeMo AutoModel does without DeepEP; kept as a comparison baseline.
- ``symm_mem``: NVSHMEM ``torch.ops.symm_mem.all_to_all_vdev_2d`` (rank-major in, expert-major
  out, counts stay on the GPU: no host sync) and ``all_to_all_vdev_2d_offset`` back. CUDA +
  NVSHMEM only.
- ``deepep``: DeepEP's ``deep_ep.Buffer`` dispatch/combine (UCCL-EP offers the same API).

Every collective is wrapped in an autograd function whose backward is the reverse collective
(all-to-all with swapped splits, all-gather <-> reduce-scatter), so gradients reach the
experts' ranks and come back to the tokens' ranks. Dispatch is deterministic in its inputs,
so activation-checkpoint recompute sends the same rows.

Shape legend: T tokens on this rank, k experts per token, H hidden, E experts, E_local = E/ep,
R rows received by this rank's experts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from polyaccel.core import ops

DISPATCHERS = ("auto", "nccl_a2a", "allgather", "symm_mem", "deepep")


class DispatcherUnavailable(RuntimeError):
    """The requested dispatcher cannot run here (wrong device, library not installed)."""


# ---------------------------------------------------------------------------------------------
# Differentiable collectives
# ---------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):  # noqa: ANN001
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:  # noqa: ANN001
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _GatherRows(torch.autograd.Function):
    """All-gather equal-sized [T, ...] blocks into [ep * T, ...]; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        return _reduce_scatter_rows(grad, ctx.group), None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum [ep * T, ...] over the group and keep this rank's [T, ...]; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: ANN001
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        out = grad.new_empty((dist.get_world_size(ctx.group) * grad.shape[0], *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:  # noqa: ANN001
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


# ---------------------------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------------------------


class TokenDispatcher:
    """Dispatch/combine of token copies over one EP process group.

    :param group: the EP process group (``moe_mesh["ep"].get_group()``); its size is ``ep``.
    :param num_experts: E, the model's total (global) number of experts; ``ep`` divides it.
    """

    name: ClassVar[str] = "base"
    sync_free: bool = False
    """True when dispatch and combine never wait on the host (CUDA-graph capturable)."""

    def __init__(self, group: Any, num_experts: int) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over ep={self.ep_size} ranks; "
                             f"ep must divide the number of experts")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Send token copies to their experts' ranks.

        x [T, H], idx [T, k] (global expert ids), w [T, k] -> (x_local [R, H] with rows grouped
        by local expert, counts [E_local] (rows per local expert; rows past ``counts.sum()``
        may exist and must not be read), handle for :meth:`combine`). A handle may carry
        ``gathered_from = (source, rows)`` when ``x_local`` is ``source[rows]`` (see
        :func:`polyaccel.moe.grouped_linear.grouped_linear`).
        """
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor:
        """Return expert outputs y [R, H] to the tokens' ranks; weighted sum -> [T, H]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} ep={self.ep_size} rank={self.ep_rank} experts={self.num_experts}>"


# ---------------------------------------------------------------------------------------------
# nccl_a2a: all_to_all_single with a split-size exchange
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _A2AHandle:
    order: torch.Tensor          # [T*k] flat (token * k + slot) index of each sorted row
    weights: torch.Tensor        # [T, k]
    send_splits: list[int]       # rows sent to each EP rank
    recv_splits: list[int]       # rows received from each EP rank
    to_source_order: torch.Tensor  # [R] expert-major row -> its source-major position


class AllToAllDispatcher(TokenDispatcher):
    """``all_to_all_single`` dispatcher (NCCL on GPUs, gloo on CPU).

    1. sort the T*k copies by global expert (= by destination rank, then local expert);
    2. all-to-all the per-expert counts [E] -> counts from each source [ep, E_local], and take
       the split sizes to the host (the one sync per layer);
    3. all-to-all the rows; they arrive source-major, and a stable sort by local expert makes
       them expert-major for the grouped GEMM. ``combine`` runs the same steps backwards.
    """

    name = "nccl_a2a"

    def dispatch(self, x, idx, w):  # noqa: ANN001
        ep, E_local = self.ep_size, self.num_local_experts
        x_sorted, order, counts = ops.moe_permute(x, idx, self.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=self.group)
        recv_counts = recv_counts.view(ep, E_local)  # [source rank, local expert]
        sizes = torch.stack([counts.view(ep, E_local).sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = sizes[0], sizes[1]
        x_recv = _AllToAll.apply(x_sorted, recv_splits, send_splits, self.group)  # source-major
        expert_of_row = torch.arange(E_local, device=x.device).repeat(ep).repeat_interleave(
            recv_counts.reshape(-1), output_size=x_recv.shape[0])
        to_expert_order = torch.argsort(expert_of_row, stable=True)
        to_source_order = torch.empty_like(to_expert_order)
        to_source_order[to_expert_order] = torch.arange(to_expert_order.numel(), device=x.device)
        handle = _A2AHandle(order, w, send_splits, recv_splits, to_source_order)
        return x_recv.index_select(0, to_expert_order), recv_counts.sum(0), handle

    def combine(self, y, handle):  # noqa: ANN001
        y_recv = y.index_select(0, handle.to_source_order)
        y_sorted = _AllToAll.apply(y_recv, handle.send_splits, handle.recv_splits, self.group)
        return ops.moe_unpermute(y_sorted, handle.order, handle.weights)


# ---------------------------------------------------------------------------------------------
# allgather: all-gather tokens, reduce-scatter outputs (the comparison baseline)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _GatherHandle:
    order: torch.Tensor    # [ep*T*k] flat index of each sorted row
    weights: torch.Tensor  # [ep*T, k]; the combine skips copies routed to other ranks' experts
    valid_rows: torch.Tensor  # rows of x_local that belong to local experts (the rest: dropped copies)
    tokens: int            # T per rank
    padded: int            # T padded to the group's largest T
    gathered_from: tuple[torch.Tensor, torch.Tensor]  # (x_all, row of each copy): x_local's source


class AllGatherDispatcher(TokenDispatcher):
    """Every rank sees every token of its EP group and computes its own experts' part.

    Tokens, routing and weights are all-gathered ([ep * T, ...]); copies routed to other
    ranks' experts are dropped (``moe_permute``: sorted last, never computed); the weighted partial outputs
    [ep * T, H] are reduce-scattered, summing each token's experts across ranks. Ranks may
    hold different T (padded to the largest; one small all-gather of sizes per call, read on
    the host) unless ``tokens_per_rank`` fixes T for every rank and call: then nothing waits
    on the host and the dispatch can be captured in a CUDA graph.

    Each token crosses to every other rank once, not once per expert copy: (ep - 1) * T * H
    per rank and direction against about T * k * (ep - 1) / ep * H for the all-to-all, so for
    ep < k (top-8 on 2-4 GPUs) this moves fewer bytes.
    """

    name = "allgather"

    def __init__(self, group: Any, num_experts: int, tokens_per_rank: int | None = None) -> None:
        super().__init__(group, num_experts)
        self.tokens_per_rank = tokens_per_rank
        self.sync_free = tokens_per_rank is not None

    def dispatch(self, x, idx, w):  # noqa: ANN001
        E_local, T = self.num_local_experts, x.shape[0]
        if self.tokens_per_rank is not None:
            if T != self.tokens_per_rank:
                raise ValueError(f"allgather dispatcher built for {self.tokens_per_rank} tokens per rank and "
                                 f"call got {T}: every rank must send the same fixed number of tokens")
            padded = T
        else:
            sizes = torch.tensor([T], device=x.device)
            all_sizes = sizes.new_empty(self.ep_size)
            dist.all_gather_into_tensor(all_sizes, sizes, group=self.group)
            padded = int(all_sizes.max())
        if padded > T:
            pad = padded - T
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            idx = torch.cat([idx, idx.new_zeros(pad, idx.shape[1])])
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
        x_all = _GatherRows.apply(x, self.group)
        w_all = _GatherRows.apply(w, self.group)
        idx_all = torch.empty((self.ep_size * padded, idx.shape[1]), dtype=idx.dtype, device=idx.device)
        dist.all_gather_into_tensor(idx_all, idx.contiguous(), group=self.group)
        local = idx_all - self.ep_rank * E_local
        is_local = (local >= 0) & (local < E_local)
        # Copies for other ranks' experts get id E_local: moe_permute drops them (sorted last,
        # not counted, no gradient) and the combine skips their rows, which are never computed.
        local = torch.where(is_local, local, E_local)
        x_sorted, order, counts = ops.moe_permute(x_all, local, E_local)
        rows = torch.div(order, idx.shape[1], rounding_mode="floor").to(torch.int32)
        handle = _GatherHandle(order, w_all, counts.sum(), T, padded, (x_all, rows))
        return x_sorted, counts, handle

    def combine(self, y, handle):  # noqa: ANN001
        partial = ops.moe_unpermute(y, handle.order, handle.weights, num_valid=handle.valid_rows)  # [ep*T_pad, H]
        return _ReduceScatterRows.apply(partial, self.group)[:handle.tokens]


# ---------------------------------------------------------------------------------------------
# symm_mem: NVSHMEM all_to_all_vdev_2d (GPU only, no host sync)
# ---------------------------------------------------------------------------------------------


def require_symm_mem(device: torch.device | str) -> None:
    """Raise :class:`DispatcherUnavailable` unless NVSHMEM symmetric memory can run on ``device``."""
    device = torch.device(device)
    if device.type != "cuda":
        raise DispatcherUnavailable(
            f"dispatcher='symm_mem' needs CUDA tensors (NVSHMEM symmetric memory), but the model is on "
            f"{device.type!r}; use dispatcher='nccl_a2a' (works on any torch.distributed backend)")
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:  # pragma: no cover - torch builds without distributed
        raise DispatcherUnavailable(f"dispatcher='symm_mem' needs torch.distributed symmetric memory ({e})") from e
    if not symm_mem.is_nvshmem_available():
        raise DispatcherUnavailable(
            "dispatcher='symm_mem' needs NVSHMEM, which this PyTorch build or machine lacks: "
            "pip install nvidia-nvshmem-cu12 (PyTorch >= 2.8 CUDA wheels load it), or use "
            "dispatcher='nccl_a2a'")


class _SymmBuffers:
    """Symmetric-memory buffers of one dispatcher, allocated once for every rank alike.

    ``rows_in`` rows leave a rank per call (T * k); at most ``ep * rows_in`` (+ alignment
    padding per local expert) arrive. Symmetric buffers must have the same shape on every rank,
    so the capacity is agreed on the first call (the largest T * k of the group, or ``max_rows``
    if larger; one all-reduce, the only host sync) and later calls must fit in it.
    """

    def __init__(self, group: Any, ep: int, experts: int, align: int, max_rows: int | None) -> None:
        self.group, self.ep, self.experts, self.align, self.max_rows = group, ep, experts, align, max_rows
        self.group_name = group.group_name
        self.key: tuple[int, int, torch.dtype] | None = None

    def get(self, rows_in: int, hidden: int, dtype: torch.dtype, device: torch.device) -> _SymmBuffers:
        import torch.distributed._symmetric_memory as symm_mem

        if self.key is not None:
            if rows_in > self.key[0] or (hidden, dtype) != self.key[1:]:
                raise RuntimeError(
                    f"symm_mem dispatcher buffers hold {self.key[0]} rows of {self.key[1]} {self.key[2]}; this "
                    f"call needs {rows_in} rows of {hidden} {dtype}. Build the dispatcher with a larger "
                    "max_rows (tokens per rank x top-k)")
            return self
        capacity = torch.tensor([max(rows_in, self.max_rows or 0)], device=device)
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=self.group)
        rows_in = int(capacity)
        rows_out = self.ep * rows_in + self.experts * self.align
        n_splits = self.ep * self.experts

        def alloc(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            t = symm_mem.empty(shape, dtype=dt, device=device)
            symm_mem.rendezvous(t, self.group_name)
            return t

        self.send = alloc((rows_in, hidden), dtype)           # rank-major rows
        self.recv = alloc((rows_out, hidden), dtype)          # expert-major rows
        self.in_splits = alloc((n_splits,), torch.int64)
        self.out_splits_offsets = alloc((2, n_splits), torch.int64)
        self.back_splits_offsets = alloc((2, n_splits), torch.int64)
        self.key = (rows_in, hidden, dtype)
        return self


_SHARED_BUFFERS: dict[tuple[str, int, int], _SymmBuffers] = {}


class _SymmDispatch(torch.autograd.Function):
    """rank-major x_sorted -> expert-major rows (``all_to_all_vdev_2d``); backward is the
    ``_offset`` variant with the forward's output layout as its input layout."""

    @staticmethod
    def forward(ctx, x_sorted, counts, bufs: _SymmBuffers):  # noqa: ANN001
        rows = x_sorted.shape[0]
        bufs.send[:rows].copy_(x_sorted)
        bufs.in_splits.copy_(counts)
        bufs.recv.zero_()  # alignment padding is read by the grouped GEMM: keep it finite
        torch.ops.symm_mem.all_to_all_vdev_2d(bufs.send, bufs.recv, bufs.in_splits, bufs.out_splits_offsets,
                                              bufs.group_name, major_align=bufs.align)
        layout = bufs.out_splits_offsets.clone()
        ctx.bufs, ctx.rows = bufs, rows
        ctx.save_for_backward(layout)
        ctx.mark_non_differentiable(layout)
        return bufs.recv.clone(), layout

    @staticmethod
    def backward(ctx, grad, _):  # noqa: ANN001
        (layout,) = ctx.saved_tensors
        bufs = ctx.bufs
        bufs.recv.copy_(grad)
        bufs.out_splits_offsets.copy_(layout)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(bufs.recv, bufs.send, bufs.out_splits_offsets,
                                                     bufs.back_splits_offsets, bufs.group_name)
        return bufs.send[:ctx.rows].clone(), None, None


class _SymmCombine(torch.autograd.Function):
    """expert-major rows (layout from dispatch) -> rank-major rows in x_sorted order
    (``all_to_all_vdev_2d_offset``); backward re-dispatches with ``all_to_all_vdev_2d``."""

    @staticmethod
    def forward(ctx, y, layout, counts, rows: int, bufs: _SymmBuffers):  # noqa: ANN001
        bufs.recv.copy_(y)
        bufs.out_splits_offsets.copy_(layout)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(bufs.recv, bufs.send, bufs.out_splits_offsets,
                                                     bufs.back_splits_offsets, bufs.group_name)
        ctx.bufs = bufs
        ctx.save_for_backward(counts)
        return bufs.send[:rows].clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        (counts,) = ctx.saved_tensors
        bufs = ctx.bufs
        bufs.send[:grad.shape[0]].copy_(grad)
        bufs.in_splits.copy_(counts)
        bufs.recv.zero_()
        torch.ops.symm_mem.all_to_all_vdev_2d(bufs.send, bufs.recv, bufs.in_splits, bufs.out_splits_offsets,
                                              bufs.group_name, major_align=bufs.align)
        return bufs.recv.clone(), None, None, None, None


@dataclasses.dataclass(slots=True)
class _SymmHandle:
    order: torch.Tensor
    weights: torch.Tensor
    layout: torch.Tensor   # [2, E_local * ep] splits and offsets of the expert-major rows
    counts: torch.Tensor   # [E] rows this rank sent to each global expert
    rows: int              # T * k


class SymmMemDispatcher(TokenDispatcher):
    """NVSHMEM dispatcher: split counts never leave the GPU.

    ``all_to_all_vdev_2d`` takes the copies sorted by global expert (rank-major) and writes them
    expert-major on the experts' ranks, each local expert's block starting at a multiple of
    ``align`` rows (grouped-GEMM friendly), with the received splits/offsets written on the
    device. The grouped GEMM's group ends are derived from those offsets on the device, and
    ``all_to_all_vdev_2d_offset`` sends the outputs back. Buffers are symmetric (allocated once,
    for the largest T * k seen).

    :param align: row alignment of each local expert's block (``major_align``).
    :param max_rows: capacity in rows (tokens per rank x top-k) of the symmetric buffers;
        default the largest of the first call across the group.
    """

    name = "symm_mem"
    sync_free = True  # after the first call, which agrees on the buffers' capacity

    def __init__(self, group: Any, num_experts: int, device: torch.device | str = "cuda", align: int = 16,
                 max_rows: int | None = None) -> None:
        require_symm_mem(device)
        super().__init__(group, num_experts)
        local = num_experts // max(1, dist.get_world_size(self.group))
        if local > SYMM_MEM_MAX_LOCAL_EXPERTS:
            raise DispatcherUnavailable(
                f"symm_mem: {local} experts per rank, but torch.ops.symm_mem.all_to_all_vdev_2d takes at most "
                f"{SYMM_MEM_MAX_LOCAL_EXPERTS}; use dispatcher='nccl_a2a' or a larger ep")
        if not isinstance(align, int) or align < 1:
            raise ValueError(f"align must be a positive int, got {align!r}")
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NVSHMEM")
        self.group_name = self.group.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self.align = align
        # One set of buffers per EP group, shared by all layers: layers run one after another
        # and every op copies its result out of them.
        key = (self.group_name, self.num_local_experts, align)
        if key not in _SHARED_BUFFERS:
            _SHARED_BUFFERS[key] = _SymmBuffers(self.group, self.ep_size, self.num_local_experts, align, max_rows)
        self._bufs = _SHARED_BUFFERS[key]

    def dispatch(self, x, idx, w):  # noqa: ANN001
        require_symm_mem(x.device)
        x_sorted, order, counts = ops.moe_permute(x, idx, self.num_experts)
        bufs = self._bufs.get(x_sorted.shape[0], x.shape[1], x.dtype, x.device)
        x_local, layout = _SymmDispatch.apply(x_sorted, counts, bufs)
        splits, offsets = layout[0].view(self.num_local_experts, self.ep_size), layout[1].view(
            self.num_local_experts, self.ep_size)
        # Local expert e's block starts at offsets[e, 0] (aligned); its grouped-GEMM group runs
        # to the next block's start, the last one to its aligned end. Padding rows are zeros.
        starts = offsets[:, 0]
        last_end = offsets[-1, -1] + splits[-1, -1]
        last_end = (last_end + self.align - 1) // self.align * self.align
        ends = torch.cat([starts[1:], last_end.view(1)])
        counts_local = torch.diff(ends, prepend=ends.new_zeros(1))
        return x_local, counts_local, _SymmHandle(order, w, layout, counts, x_sorted.shape[0])

    def combine(self, y, handle):  # noqa: ANN001
        bufs = self._bufs
        y_sorted = _SymmCombine.apply(y, handle.layout, handle.counts, handle.rows, bufs)
        return ops.moe_unpermute(y_sorted, handle.order, handle.weights)


# ---------------------------------------------------------------------------------------------
# deepep: DeepEP / UCCL-EP Buffer
# ---------------------------------------------------------------------------------------------


def require_deep_ep() -> Any:
    """Import and return ``deep_ep``, or raise :class:`DispatcherUnavailable` saying what to install."""
    if importlib.util.find_spec("deep_ep") is None:
        raise DispatcherUnavailable(
            "dispatcher='deepep' needs DeepEP (module 'deep_ep'), which is not installed: build it from "
            "https://github.com/deepseek-ai/DeepEP (needs NVSHMEM and Hopper GPUs) or install UCCL-EP, "
            "which provides the same deep_ep.Buffer API; or use dispatcher='nccl_a2a'")
    import deep_ep

    return deep_ep


class _DeepEPDispatch(torch.autograd.Function):
    """``Buffer.dispatch``; its backward is ``Buffer.combine`` with the dispatch handle."""

    @staticmethod
    def forward(ctx, x, w, idx, dispatcher: DeepEPDispatcher):  # noqa: ANN001
        buf = dispatcher.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, dispatcher.num_experts)
        recv_x, recv_idx, recv_w, recv_per_expert, handle, _ = buf.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_w, recv_idx, handle

    @staticmethod
    def backward(ctx, grad_x, grad_w, _idx, _handle):  # noqa: ANN001
        buf = ctx.dispatcher.buffer
        gx, gw, _ = buf.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w)
        return gx, gw, None, None


class _DeepEPCombine(torch.autograd.Function):
    """``Buffer.combine`` (sums each token's partial outputs across ranks); backward is
    ``Buffer.dispatch`` with the cached handle."""

    @staticmethod
    def forward(ctx, y, handle, dispatcher: DeepEPDispatcher):  # noqa: ANN001
        out, _, _ = dispatcher.buffer.combine(y.contiguous(), handle)
        ctx.dispatcher, ctx.handle = dispatcher, handle
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        recv, _, _, _, _, _ = ctx.dispatcher.buffer.dispatch(grad.contiguous(), handle=ctx.handle)
        return recv, None, None


@dataclasses.dataclass(slots=True)
class _DeepEPHandle:
    handle: Any
    order: torch.Tensor
    weights: torch.Tensor  # [R_tokens, k] received weights; the combine skips other ranks' experts
    valid_rows: torch.Tensor  # rows of x_local that belong to local experts


class DeepEPDispatcher(TokenDispatcher):
    """DeepEP normal-mode dispatcher: each token travels once per destination rank (not once
    per expert copy), NVLink/RDMA kernels, received tokens carry their local expert ids
    (-1 for experts elsewhere). Local copies are then sorted by expert as usual.

    :param num_nvl_bytes: NVLink buffer size per rank (DeepEP's ``Buffer`` argument).
    """

    name = "deepep"

    def __init__(self, group: Any, num_experts: int, num_nvl_bytes: int = 1 << 30) -> None:
        deep_ep = require_deep_ep()
        super().__init__(group, num_experts)
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes, 0)

    def dispatch(self, x, idx, w):  # noqa: ANN001
        if not x.is_cuda:
            raise DispatcherUnavailable("dispatcher='deepep' needs CUDA tensors")
        recv_x, recv_w, recv_idx, handle = _DeepEPDispatch.apply(x, w.float(), idx.long(), self)
        E_local = self.num_local_experts
        is_local = recv_idx >= 0
        local = torch.where(is_local, recv_idx, E_local)  # dropped by moe_permute (see allgather)
        x_sorted, order, counts = ops.moe_permute(recv_x, local, E_local)
        return x_sorted, counts, _DeepEPHandle(handle, order, recv_w, counts.sum())

    def combine(self, y, handle):  # noqa: ANN001
        partial = ops.moe_unpermute(y, handle.order, handle.weights, num_valid=handle.valid_rows)
        return _DeepEPCombine.apply(partial, handle.handle, self)


# ---------------------------------------------------------------------------------------------
# Selection
# ---------------------------------------------------------------------------------------------

_CLASSES: dict[str, type[TokenDispatcher]] = {
    c.name: c for c in (AllToAllDispatcher, AllGatherDispatcher, SymmMemDispatcher, DeepEPDispatcher)}


# PyTorch's NVSHMEM ``all_to_all_vdev_2d`` handles at most this many experts per rank
# (NUM_TILES = THREADS_PER_BLOCK / A2AV_TILE_SIZE in its kernel; seen failing with 64 on an H200).
SYMM_MEM_MAX_LOCAL_EXPERTS = 16


def resolve_dispatcher(name: str, device: torch.device | str, local_experts: int | None = None) -> str:
    """The concrete dispatcher ``name`` means on ``device``: ``"auto"`` is ``symm_mem`` on CUDA
    with NVSHMEM when each rank holds at most ``SYMM_MEM_MAX_LOCAL_EXPERTS`` experts, else
    ``nccl_a2a``; explicit names are checked and returned."""
    if name not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {name!r}; choose one of {', '.join(map(repr, DISPATCHERS))}")
    if name != "auto":
        return name
    if local_experts is not None and local_experts > SYMM_MEM_MAX_LOCAL_EXPERTS:
        return "nccl_a2a"
    try:
        require_symm_mem(device)
        return "symm_mem"
    except DispatcherUnavailable:
        return "nccl_a2a"


def make_dispatcher(name: str, group: Any, num_experts: int, device: torch.device | str = "cpu", *,
                    tokens_per_rank: int | None = None) -> TokenDispatcher:
    """Build the dispatcher ``name`` (see :data:`DISPATCHERS`) over the EP process ``group``.

    :param tokens_per_rank: the fixed token count of every rank's calls, if it is fixed (the
        ``allgather`` dispatcher then skips its size exchange).

    Raises :class:`DispatcherUnavailable` with what to install when it cannot run here.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    name = resolve_dispatcher(name, device, local_experts=num_experts // max(1, world))
    if name == "symm_mem":
        return SymmMemDispatcher(group, num_experts, device=device)
    if name == "allgather":
        return AllGatherDispatcher(group, num_experts, tokens_per_rank=tokens_per_rank)
    return _CLASSES[name](group, num_experts)


__all__ = ["DISPATCHERS", "AllGatherDispatcher", "AllToAllDispatcher", "DeepEPDispatcher", "DispatcherUnavailable",
           "SymmMemDispatcher", "TokenDispatcher", "make_dispatcher", "require_deep_ep", "require_symm_mem",
           "resolve_dispatcher"]
