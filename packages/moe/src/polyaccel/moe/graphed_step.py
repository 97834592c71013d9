"""Training micro-steps (forward + backward) captured once as CUDA graphs and replayed, with
the expert weight gradients of several micro-batches computed in one pass.

An MoE step launches thousands of kernels (per layer: norms, rotary, attention, router,
sort, two grouped GEMMs, combine, and all their backward kernels); eager PyTorch spends
host time on each, and at ~4k tokens per micro-batch the GPU waits for the host between many
of them. Replaying a graph launches the whole micro-step at once.

:class:`GraphedMicroStep` runs the first ``warmup`` calls of each kind eagerly (doing real
work: they compile, autotune and allocate), captures the next one and replays it from then
on. Each call copies the batch into the graph's static input buffers. Gradients accumulate
into the parameters' existing ``.grad`` tensors, which therefore must stay the same tensors
across steps: use :class:`polyaccel.moe.optim.FlatAdamW` (whose ``zero_grad`` keeps them) or
``optimizer.zero_grad(set_to_none=False)``. Missing gradients are created as zeros.

Told where a call stands in the optimizer step (``micro_batch=(i, n)``), it also:

- computes the expert weight gradients (weights with fused accumulation,
  :mod:`polyaccel.moe.grouped_linear`) once per ``wgrad_window`` micro-batches, over all their
  token rows (:func:`~polyaccel.moe.grouped_linear.wgrad_window`): the micro-batches in
  between keep their expert activations and output gradients alive until then (memory:
  about ``2 * top_k * (3 * intermediate + hidden)`` bytes per token and MoE layer for each kept
  micro-batch, in bf16);
- writes the step's first expert weight gradients over ``.grad`` instead of adding them to
  the zeros the optimizer left (no read of ``.grad``).

Each position in the window is its own graph kind; the graphs of deferring micro-batches hold
what they keep in graph memory that the next ones read.

Requirements for the graphs (off CUDA every call runs eagerly, said once in the log, so the
same loop runs on the CPU): a CUDA device; every call with the same batch shapes and keys (a call with
other shapes runs eagerly, with a one-time warning); no host synchronization in the
model's forward or backward (polyaccel MoE models have none on one device; a padded
``attention_mask`` stays a mask under capture). Not for FSDP2, whose collectives and hooks
run on the host; expert parallelism over dense replicas (:mod:`polyaccel.moe.dense_replicas`)
works with a dispatcher that never waits on the host (its NCCL calls are captured).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polyaccel.core.graphs import cuda_graph_capture
from polyaccel.moe.grouped_linear import (
    defers,
    flush_wgrad,
    fusable,
    kept_wgrad,
    kept_wgrad_tensors,
    restore_kept_wgrad,
    track_grad_sumsq,
    wgrad_window,
)

logger = logging.getLogger(__name__)

class _Captured:
    """One kind of micro-step: its eager call count, graph, static inputs and loss, and
    what it leaves deferred (its graph writes those tensors)."""

    def __init__(self) -> None:
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.loss: torch.Tensor | None = None
        self.kept: dict = {}


def expert_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The trainable expert weights of ``model`` whose gradients the weight-gradient GEMM writes."""
    return [p for m in model.modules() if getattr(m, "fuse_wgrad", False)
            for p in m.parameters(recurse=False) if p.requires_grad]


def overwritten_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """The expert weights whose gradients a :class:`GraphedMicroStep` of ``model`` writes over
    at each step's first micro-batch (while they stay plain, hook-free leaves; one that stops
    being one is zeroed by the micro-step itself), known before the micro-step is built."""
    return [p for p in expert_weights(model) if fusable(p)]


class GraphedMicroStep:
    """``loss = step(**batch)`` runs ``model(**batch, **forward_kwargs).loss.backward()`` (or
    ``loss_fn(**batch).backward()``) and returns the loss (detached); after ``warmup`` eager
    calls, as one CUDA graph replay.

    :param model: the model, in train mode; on a CUDA device for graphs (elsewhere eager).
    :param warmup: eager calls of each kind before its capture (compilation, autotuning).
    :param wgrad_window: micro-batches whose expert weight gradients one kernel computes
        (calls must then pass ``micro_batch``); 1 computes them in every micro-batch.
    :param loss_fn: ``loss_fn(**batch) -> loss`` to back-propagate instead of
        ``model(**batch, **forward_kwargs).loss`` (e.g. a scaled loss; it may read tensors of
        the batch such as ``num_items_in_batch``, which are then graph inputs too).
    :param forward_kwargs: extra keyword arguments of every forward (e.g. ``use_cache=False``).
    :param grad_accum: micro-batches per optimizer step, for calls that pass no ``micro_batch``
        (a plain loop): the step then counts them itself; with ``wgrad_window="auto"`` it also
        sizes the window (:func:`polyaccel.moe.fast_path.auto_window`, from the first batch).
    """

    def __init__(self, model: nn.Module, warmup: int = 2, wgrad_window: int | str = 1,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *, grad_accum: int | None = None,
                 **forward_kwargs: Any) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup} must be >= 1: the first calls compile and autotune, "
                             "which cannot happen during capture")
        if wgrad_window != "auto" and wgrad_window < 1:
            raise ValueError(f"wgrad_window={wgrad_window} must be >= 1 or 'auto'")
        if grad_accum is not None and grad_accum < 1:
            raise ValueError(f"grad_accum={grad_accum} must be >= 1")
        device = next(model.parameters()).device
        #: False off CUDA: every call then runs eagerly (said once), the same arithmetic
        self.graphs = device.type == "cuda"
        if not self.graphs:
            from polyaccel.moe.fast_path import say_once

            say_once(f"GraphedMicroStep runs eagerly: the model is on {device.type}, CUDA graphs need CUDA")
        self.model, self.warmup, self.wgrad_window, self.grad_accum = model, warmup, wgrad_window, grad_accum
        self.loss_fn = loss_fn or (lambda **batch: model(**batch, **forward_kwargs).loss)
        self.kinds: dict[tuple[int, bool, bool], _Captured] = {}
        self._next = 0  # the micro-batch index expected next
        self._kept_by: _Captured | None = None  # the kind whose graph wrote what is deferred now
        self._pool: Any = None
        self._warned = False
        self._experts = expert_weights(model)
        self._sumsq = track_grad_sumsq(self._experts)
        self._completed = False  # the last call was the last micro-batch of a step
        self._promised = False  # overwritten_params was read: calls must say where steps start

    def __call__(self, micro_batch: tuple[int, int] | None = None, **batch: torch.Tensor) -> torch.Tensor:
        """One micro-batch. ``micro_batch=(i, n)``: the ``i``-th of the ``n`` micro-batches of
        this optimizer step (needed with ``wgrad_window > 1``): after call ``n - 1`` every
        gradient is complete; call 0 expects the gradients zeroed by the optimizer."""
        if self.wgrad_window == "auto":
            self.wgrad_window = self._auto_window(batch)
        if micro_batch is None and self.grad_accum is not None:
            micro_batch = (self._next, self.grad_accum)
        if micro_batch is None and self._promised:
            raise ValueError("GraphedMicroStep: an optimizer was told it writes the expert gradients over "
                             "(overwritten_params), which needs to know where each step starts: pass "
                             "micro_batch=(i, n) to every call or build it with grad_accum=n")
        if micro_batch is not None and micro_batch[0] == 0:
            self._zero_unfusable_experts()
        self._completed = False
        kind_key = self._kind_key(micro_batch)
        loss = self._run(kind_key, batch)
        self._completed = micro_batch is not None and micro_batch[0] == micro_batch[1] - 1
        return loss

    def expert_grad_sumsq(self) -> dict[torch.Tensor, torch.Tensor] | None:
        """After the last micro-batch of a step: each expert weight's gradient's sum of squares
        (weight -> 0-dim fp32 device tensor), formed where the weight-gradient kernel stored
        that gradient, so a clipping norm need not read the expert gradients again
        (``FlatAdamW.grad_norm(known_sumsq=...)``). None mid-step, or when some expert weight's
        gradient came from autograd instead (not :func:`~polyaccel.moe.grouped_linear.fusable`).
        Valid until those gradients change (the optimizer's step or zeroing)."""
        if not self._completed or not all(fusable(p) for p in self._experts):
            return None
        return dict(self._sumsq)

    def _run(self, kind_key: tuple[int, bool, bool], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One call of kind ``kind_key``: eager, captured or replayed."""
        kind = self.kinds.setdefault(kind_key, _Captured())
        kind.calls += 1
        # A graph reads what the graph of the kind before it kept; after anything else
        # (an eager call) the deferred tensors are others, so run eagerly until the window ends.
        before = self.kinds.get((kind_key[0] - 1, True, False)) if kind_key[0] else None
        ready = (before is not None and self._kept_by is before) if kind_key[0] else not kept_wgrad_tensors()
        if not self.graphs or not ready or (kind.graph is not None and not self._matches(kind, batch)):
            return self._eager(batch, kind_key)
        if kind.graph is None:
            self._ensure_grads()
            if kind.calls <= self.warmup:
                return self._eager(batch, kind_key)
            self._capture(kind, batch, kind_key)
        else:
            for name, t in batch.items():
                kind.inputs[name].copy_(t, non_blocking=True)
        kind.graph.replay()
        restore_kept_wgrad(kind.kept)
        self._kept_by = kind if kind_key[1] else None
        return kind.loss.clone()

    @property
    def overwritten_params(self) -> list[torch.Tensor]:
        """The weights whose gradients a call with ``micro_batch=(0, n)`` writes over (or
        zeroes): an optimizer need not zero them (``FlatAdamW(grads_overwritten=...)``)."""
        self._promised = True
        return overwritten_params(self.model)

    # ---- internals --------------------------------------------------------------------------
    def _auto_window(self, batch: dict[str, torch.Tensor]) -> int:
        from polyaccel.moe.fast_path import auto_window

        ids = batch.get("input_ids")
        config = getattr(self.model, "config", None)
        if ids is None or config is None or not self.grad_accum or not self._experts or not ids.is_cuda:
            return 1
        total = torch.cuda.get_device_properties(ids.device).total_memory
        return auto_window(config, tokens_per_micro_batch=ids.numel(), grad_accum=self.grad_accum,
                           device_bytes=total)

    def _kind_key(self, micro_batch: tuple[int, int] | None) -> tuple[int, bool, bool]:
        """(micro-batches deferred before this one, this one defers, this one writes over the
        expert grads), checking that calls come in order."""
        if micro_batch is None:
            if self.wgrad_window > 1:
                raise ValueError(f"wgrad_window={self.wgrad_window}: pass micro_batch=(i, n) to every call")
            return 0, False, False
        i, n = micro_batch
        if not 0 <= i < n or i != self._next:
            raise ValueError(f"micro_batch={micro_batch}: expected micro-batch {self._next} of a step "
                             f"(0 <= i < n, in order)")
        self._next = 0 if i == n - 1 else i + 1
        defer = defers(i, n, self.wgrad_window)
        return i % self.wgrad_window, defer, not defer and i < self.wgrad_window

    def _forward_backward(self, batch: dict[str, torch.Tensor], key: tuple[int, bool, bool]) -> torch.Tensor:
        _, defer, overwrite = key
        targets = overwritten_params(self.model) if overwrite else []
        with wgrad_window(defer, targets) as written:
            loss = self.loss_fn(**batch)
            loss.backward()
        for p in targets:  # a weight that got no gradient this step: zero, not stale
            if p not in written and p.grad is not None:
                p.grad.zero_()
                if p in self._sumsq:
                    self._sumsq[p].zero_()
        if not defer:
            flush_wgrad()
        return loss.detach()

    def _zero_unfusable_experts(self) -> None:
        """At a step's first micro-batch, zero the expert weights that stopped being plain leaves
        (hooked since the optimizer was told they are written over): autograd adds into them."""
        for p in self._experts:
            if p.grad is not None and not fusable(p):
                p.grad.zero_()

    def _eager(self, batch: dict[str, torch.Tensor], key: tuple[int, bool, bool]) -> torch.Tensor:
        self._kept_by = None
        return self._forward_backward(batch, key)

    def _ensure_grads(self) -> None:
        """Give every trainable parameter a ``.grad`` (zeros if missing): a graph replays the
        in-place accumulation into these exact tensors."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _matches(self, kind: _Captured, batch: dict[str, torch.Tensor]) -> bool:
        ok = batch.keys() == kind.inputs.keys() and all(
            t.shape == kind.inputs[k].shape and t.dtype == kind.inputs[k].dtype for k, t in batch.items())
        if not ok and not self._warned:
            logger.warning("GraphedMicroStep: batch shapes %s differ from the captured %s; running such "
                           "batches eagerly", {k: tuple(t.shape) for k, t in batch.items()},
                           {k: tuple(t.shape) for k, t in kind.inputs.items()})
            self._warned = True
        return ok

    def _capture(self, kind: _Captured, batch: dict[str, torch.Tensor], key: tuple[int, bool, bool]) -> None:
        """Record this kind's graph (nothing runs: the caller replays it). All kinds share
        one memory pool: they run one after another, and what a deferring kind keeps stays
        referenced (``kind.kept``), so no later capture reuses it."""
        for name, t in batch.items():
            if not (torch.is_tensor(t) and t.is_cuda):
                raise ValueError(f"GraphedMicroStep needs CUDA tensors; {name!r} is "
                                 f"{t.device if torch.is_tensor(t) else type(t).__name__}")
        kind.inputs = {name: t.clone() for name, t in batch.items()}
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph_capture(graph, pool=self._pool):
            kind.loss = self._forward_backward(kind.inputs, key)
        self._pool = self._pool if self._pool is not None else graph.pool()
        kind.kept = kept_wgrad()
        kind.graph = graph
