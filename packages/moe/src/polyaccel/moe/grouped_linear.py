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

:func:`wgrad_window` goes further for a loop over micro-batches: at ~256 token rows per
expert, the weight-gradient kernel spends most of its time reading and writing ``.grad``, so
a micro-batch run with ``defer=True`` only keeps its ``(dy, x, offsets)`` and a later one
computes the gradient over all kept micro-batches in one kernel (one pass over ``.grad``
for several micro-batches; the kept activations cost their memory until then).
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
    autograd's accumulation) unless :func:`mark_caller_syncs_grad` marked ``w``."""
    return (torch.is_grad_enabled() and w.requires_grad and w.is_leaf
            and type(w) in (nn.Parameter, torch.Tensor)
            and not getattr(w, "_post_accumulate_grad_hooks", None)
            and not getattr(w, "_backward_hooks", None)
            and (getattr(w, "_polyaccel_caller_syncs_grad", False) or not _multi_process()))


def mark_caller_syncs_grad(w: torch.Tensor) -> None:
    """Declare that nothing hooks ``w``'s gradient accumulation in this multi-process job: its
    owner reduces ``w.grad`` itself after the backward (:mod:`polyaccel.moe.dense_replicas`),
    so the weight-gradient GEMM may write it directly."""
    w._polyaccel_caller_syncs_grad = True


def _multi_process() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclasses.dataclass
class _Window:
    """How :func:`grouped_linear`'s backward treats weight gradients, within :func:`wgrad_window`."""

    defer: bool
    overwrite: set[torch.Tensor]
    written: set[torch.Tensor] = dataclasses.field(default_factory=set)


_MODE: list[_Window] = []
_Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""One micro-batch's weight-gradient inputs: (dy, x, offsets, rows): ``x[rows]`` is the input
(``rows`` None: ``x`` itself)."""
_KEPT: dict[torch.Tensor, list[_Source]] = {}
"""weight -> the sources of micro-batches whose weight gradient is deferred."""


@contextlib.contextmanager
def wgrad_window(defer: bool = False, overwrite: Iterable[torch.Tensor] = ()) -> Iterator[set[torch.Tensor]]:
    """Within, the backward of :func:`grouped_linear`:

    - with ``defer``, keeps ``(dy, x, offsets)`` of each weight instead of computing its
      gradient (``.grad`` is left as it is; run the forward inside too, so that inputs given
      with ``gathered_from`` are kept in their small form);
    - without, computes the gradient of this micro-batch and of all kept ones in one kernel;
    - for a weight in ``overwrite``, writes that gradient over ``.grad`` instead of adding to
      it (the first gradient of an optimizer step: no need to zero ``.grad`` before).

    Yields the set of ``overwrite`` weights written. Kept micro-batches of a weight that no
    later backward used are computed by :func:`flush_wgrad`.
    """
    if _MODE:
        raise RuntimeError("wgrad_window does not nest")
    mode = _Window(defer, set(overwrite))
    _MODE.append(mode)
    try:
        yield mode.written
    finally:
        _MODE.clear()


def defers(i: int, n: int, window: int) -> bool:
    """Whether micro-batch ``i`` of ``n`` defers its weight gradients in windows of ``window``
    micro-batches (the last of each window, and of the step, computes them)."""
    return (i + 1) % window != 0 and i != n - 1


def kept_wgrad() -> dict[torch.Tensor, list[_Source]]:
    """A copy of what deferred micro-batches keep, per weight (see :func:`restore_kept_wgrad`)."""
    return {w: list(v) for w, v in _KEPT.items()}


def restore_kept_wgrad(kept: dict[torch.Tensor, list[_Source]]) -> None:
    """Make ``kept`` (from :func:`kept_wgrad`) what is deferred: a replayed CUDA graph wrote
    those tensors without running this module's Python."""
    _KEPT.clear()
    _KEPT.update({w: list(v) for w, v in kept.items()})


def kept_wgrad_tensors() -> list[torch.Tensor]:
    """The tensors deferred micro-batches hold (a CUDA graph capture keeps them alive)."""
    return [t for kept in _KEPT.values() for source in kept for t in source if t is not None]


def flush_wgrad() -> None:
    """Compute the weight gradients still deferred (into ``.grad``) and drop what they kept."""
    while _KEPT:
        w, kept = _KEPT.popitem()
        _write_wgrad(w, kept, overwrite=False)


_SUMSQ: dict[torch.Tensor, torch.Tensor] = {}
"""Weight -> one fp32 element that each write of its gradient here sets to the gradient's sum
of squares (:func:`track_grad_sumsq`)."""


def track_grad_sumsq(weights: Iterable[torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """From now on, every write of these weights' gradients by this module also records the
    gradient's sum of squares, formed in the weight-gradient kernel's epilogue: a gradient norm
    then needs no pass over them. Returns the records (weight -> 0-dim fp32 tensor, at fixed
    addresses, so a captured CUDA graph writes them too). A record is the gradient's only
    while nothing else has changed that gradient since this module last wrote it."""
    for w in weights:
        if w not in _SUMSQ:
            _SUMSQ[w] = torch.zeros((), dtype=torch.float32, device=w.device)
    return {w: _SUMSQ[w] for w in weights}


def _write_wgrad(w: torch.Tensor, sources: list[_Source], overwrite: bool) -> None:
    dys, offs = [s[0] for s in sources], [s[2] for s in sources]
    # Inputs kept small are gathered again here, one weight at a time (a gather in the GEMM's
    # loads measured 0.55 ms slower per window of four than these copies, 0.05 ms each).
    xs = [x if rows is None else x.index_select(0, rows) for _, x, _, rows in sources]
    sumsq = _SUMSQ.get(w)
    if w.grad is None:
        w.grad = ops.grouped_mm_wgrad(dys, xs, offs).to(w.dtype)
        if sumsq is not None:
            sumsq.copy_(w.grad.float().square().sum())
    else:
        ops.grouped_mm_wgrad(dys, xs, offs, out=w.grad, accumulate=not overwrite, sumsq=sumsq)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets, source, rows):  # noqa: ANN001, ANN205
        # In a window of several micro-batches (this one defers, or earlier ones wait for this
        # backward) keep the input small: the window's gradient gathers it again anyway.
        if source is not None and ((_MODE and _MODE[0].defer) or w in _KEPT):
            ctx.save_for_backward(source, offsets, rows)
        else:
            ctx.save_for_backward(x, offsets, None)
        ctx.weight = w
        return ops.grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, offsets, rows = ctx.saved_tensors
        w = ctx.weight
        dx = ops.grouped_mm(dy, w.detach().transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        mode = _MODE[0] if _MODE else None
        sources = _KEPT.pop(w, []) + [(dy, x, offsets, rows)]
        if mode is not None and mode.defer:
            _KEPT[w] = sources
            return dx, None, None, None, None
        overwrite = mode is not None and w in mode.overwrite and w not in mode.written
        _write_wgrad(w, sources, overwrite)
        if overwrite:
            mode.written.add(w)
        return dx, None, None, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                   gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``ops.grouped_mm(x, w, offsets)`` with the weight gradient accumulated into ``w.grad``
    in backward (see the module docstring); plain ``ops.grouped_mm`` when not :func:`fusable`.

    ``gathered_from=(source, rows)``: ``x`` is ``source[rows]`` (e.g. the token copies that
    ``ops.moe_permute`` sorted by expert, with ``rows = order // top_k``); in a window of
    several micro-batches (forward and backward inside :func:`wgrad_window`) the backward then
    keeps ``source`` and ``rows`` (alive anyway, ``1/top_k`` of the size) instead of ``x``.
    """
    if not fusable(w):
        return ops.grouped_mm(x, w, offsets)
    source, rows = gathered_from if gathered_from is not None else (None, None)
    return _GroupedLinear.apply(x, w, offsets, source, rows)
