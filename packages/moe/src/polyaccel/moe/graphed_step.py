"""Training micro-steps (forward + backward) captured once as CUDA graphs and replayed, with
the optimizer step optionally overlapped with the last micro-batch's backward.

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

With ``optimizer=`` a :class:`~polyaccel.moe.optim.FlatAdamW`, ``step(..., optimizer_step=True)``
also performs the optimizer step: AdamW is memory-bound and the backward mostly compute-bound,
so each block's update runs on a side stream while the backward goes on through the blocks
before it. The update of block ``i + 1`` starts when block ``i``'s first weight gradient is
accumulated (autograd runs every accumulation of block ``i + 1`` before any of block ``i``);
the last block's trigger also starts the head (final norm, LM head); block 0 and what is
left (embeddings) follow the backward. Expert weights with fused gradient accumulation take
their step inside their own weight-gradient kernel instead
(:func:`polyaccel.moe.grouped_linear.fused_backward`), which leaves their gradient in place;
the next micro-batch (the first of the next step) writes over it instead of adding to it, so
the expert gradients are neither zeroed nor read back between steps. No gradient clipping
fits between the backward and such a step.

Requirements: a CUDA device; every call with the same batch shapes and keys (a call with
other shapes runs eagerly, with a one-time warning); no host synchronization in the
model's forward or backward (polyaccel MoE models have none on one device; a padded
``attention_mask`` stays a mask under capture). Not for FSDP2 / expert parallelism, whose
collectives and hooks run on the host.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from polyaccel.moe.grouped_linear import fusable, fused_backward

logger = logging.getLogger(__name__)


class _Captured:
    """One kind of micro-step: its eager call count, graph, static inputs and loss."""

    def __init__(self) -> None:
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.loss: torch.Tensor | None = None


class GraphedMicroStep:
    """``loss = step(**batch)`` runs ``model(**batch, **forward_kwargs).loss.backward()`` (or
    ``loss_fn(**batch).backward()``) and returns the loss (detached); after ``warmup`` eager
    calls, as one CUDA graph replay.

    :param model: the model, on a CUDA device, in train mode.
    :param warmup: eager calls of each kind before its capture (compilation, autotuning).
    :param optimizer: a :class:`~polyaccel.moe.optim.FlatAdamW` over the model's parameters,
        for ``optimizer_step=True`` calls.
    :param blocks: the modules whose updates overlap the backward, in forward order (default:
        ``model.model.layers``).
    :param loss_fn: ``loss_fn(**batch) -> loss`` to back-propagate instead of
        ``model(**batch, **forward_kwargs).loss`` (e.g. a scaled loss; it may read tensors of
        the batch such as ``num_items_in_batch``, which are then graph inputs too).
    :param forward_kwargs: extra keyword arguments of every forward (e.g. ``use_cache=False``).
    """

    def __init__(self, model: nn.Module, warmup: int = 2, optimizer: Any = None,
                 blocks: list[nn.Module] | None = None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, **forward_kwargs: Any) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup} must be >= 1: the first calls compile and autotune, "
                             "which cannot happen during capture")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"GraphedMicroStep replays CUDA graphs; the model is on {device}. "
                             "Run the step eagerly there (model(**batch).loss.backward()).")
        self.model, self.warmup, self.forward_kwargs = model, warmup, forward_kwargs
        self.loss_fn = loss_fn or (lambda **batch: model(**batch, **forward_kwargs).loss)
        self.optimizer = optimizer
        self.kinds: dict[tuple[bool, bool], _Captured] = {}
        self._stale = False  # expert grads still hold the last step's values (see _OverlappedUpdate)
        self._pool: Any = None
        self._warned = False
        self._overlap: _OverlappedUpdate | None = None
        if optimizer is not None:
            if getattr(model, "is_gradient_checkpointing", False):
                raise ValueError("GraphedMicroStep(optimizer=...) updates weights during the backward, which "
                                 "activation checkpointing would then recompute with: turn one off")
            if not hasattr(optimizer, "begin_step"):
                raise TypeError(f"optimizer_step needs a polyaccel.moe.optim.FlatAdamW, got {type(optimizer).__name__}")
            if blocks is None:
                blocks = list(getattr(getattr(model, "model", None), "layers", None) or [])
            self._overlap = _OverlappedUpdate(model, optimizer, blocks, device)

    def __call__(self, optimizer_step: bool = False, **batch: torch.Tensor) -> torch.Tensor:
        """One micro-batch; with ``optimizer_step`` (needs ``optimizer``) also the optimizer
        step that ends this accumulation: do not call ``optimizer.step()`` then. Afterwards the
        dense gradients are zero and the expert gradients still hold this step's values (the
        next call writes over them)."""
        if optimizer_step and self._overlap is None:
            raise ValueError("optimizer_step=True needs GraphedMicroStep(..., optimizer=FlatAdamW(...))")
        mode = (optimizer_step, self._stale)
        self._stale = optimizer_step and self._overlap is not None
        kind = self.kinds.setdefault(mode, _Captured())
        kind.calls += 1
        if kind.graph is not None and not self._matches(kind, batch):
            return self._eager(batch, mode)
        if kind.graph is None:
            self._ensure_grads()
            if kind.calls <= self.warmup:
                return self._eager(batch, mode)
            self._capture(kind, batch, mode)
        else:
            for name, t in batch.items():
                kind.inputs[name].copy_(t, non_blocking=True)
        if optimizer_step:
            self.optimizer.begin_step()
        kind.graph.replay()
        return kind.loss.clone()

    # ---- internals --------------------------------------------------------------------------
    def _forward_backward(self, batch: dict[str, torch.Tensor], mode: tuple[bool, bool]) -> torch.Tensor:
        """``mode``: (this call ends the step, the expert grads are stale from the last one)."""
        with self._overlap.armed(*mode) if self._overlap is not None else contextlib.nullcontext():
            loss = self.loss_fn(**batch)
            loss.backward()
        return loss.detach()

    def _eager(self, batch: dict[str, torch.Tensor], mode: tuple[bool, bool]) -> torch.Tensor:
        if mode[0]:
            self.optimizer.begin_step()
        return self._forward_backward(batch, mode)

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

    def _capture(self, kind: _Captured, batch: dict[str, torch.Tensor], mode: tuple[bool, bool]) -> None:
        """Record this kind's graph (nothing runs: the caller replays it). All kinds share
        one memory pool: they never run at the same time."""
        for name, t in batch.items():
            if not (torch.is_tensor(t) and t.is_cuda):
                raise ValueError(f"GraphedMicroStep needs CUDA tensors; {name!r} is "
                                 f"{t.device if torch.is_tensor(t) else type(t).__name__}")
        kind.inputs = {name: t.clone() for name, t in batch.items()}
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            kind.loss = self._forward_backward(kind.inputs, mode)
        self._pool = self._pool if self._pool is not None else graph.pool()
        kind.graph = graph


class _OverlappedUpdate:
    """Runs a FlatAdamW step piece by piece on a side stream during one backward."""

    def __init__(self, model: nn.Module, optimizer: Any, blocks: list[nn.Module], device: torch.device) -> None:
        self.optimizer = optimizer
        self.stream = torch.cuda.Stream(device=device)
        # Weights of modules with fused weight-gradient accumulation (experts) take their step
        # in their own backward kernel (grouped_linear.fused_backward); the rest here.
        self.in_backward = [p for m in model.modules() if getattr(m, "fuse_wgrad", False)
                            for p in m.parameters(recurse=False) if p.requires_grad]
        skip = {id(p) for p in self.in_backward}
        trainable = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
        in_blocks = [[p for p in b.parameters() if p.requires_grad and id(p) not in skip] for b in blocks]
        seen = {id(p) for ps in in_blocks for p in ps}
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        embed_ids = {id(p) for p in embed.parameters()} if embed is not None else set()
        head = [p for p in trainable if id(p) not in seen and id(p) not in embed_ids]
        # Block i's trigger starts block i+1's update (the last block's: the head's).
        self.pieces = [optimizer.pieces(in_blocks[i + 1] if i + 1 < len(blocks) else head)
                       for i in range(len(blocks))]
        early = {id(p) for ps in in_blocks[1:] for p in ps} | {id(p) for p in head}
        self.after = optimizer.pieces([p for p in trainable if id(p) not in early])
        self.fired = [False] * len(blocks)
        self._armed = False
        for i, block in enumerate(blocks):
            trigger = next((p for p in block.parameters() if p.requires_grad and id(p) not in skip), None)
            if trigger is not None:  # (a weight whose gradient goes through autograd's accumulation)
                trigger.register_post_accumulate_grad_hook(lambda p, i=i: self._fire(i))

    def _fire(self, i: int) -> None:
        if not self._armed or self.fired[i]:
            return
        self.fired[i] = True
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.optimizer.apply(self.pieces[i])

    @contextlib.contextmanager
    def armed(self, optimizer_step: bool, stale: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward. ``stale``: the expert grads still
        hold the last step's values, so their kernels write over them (weights that cannot take
        that path are zeroed first). ``optimizer_step``: the hooks launch block updates, the
        expert weights step in their kernels, and on a clean exit whatever has not been updated
        (block 0, embeddings, blocks whose trigger got no gradient) is, and the side stream
        joins the current one."""
        overwrite = [p for p in self.in_backward if fusable(p)] if stale else []
        if stale:
            for p in set(self.in_backward) - set(overwrite):
                p.grad.zero_()
        self.fired = [False] * len(self.fired)
        self._armed = optimizer_step
        step = {p: self.optimizer.adam_state(p) for p in self.in_backward} if optimizer_step else {}
        try:
            with fused_backward(step, keep_grad=True, overwrite=overwrite) as handled:
                yield
                handled = set(handled)
        finally:
            self._armed = False
        unused = [p for p in overwrite if p not in handled]  # no gradient this micro-batch: zero
        for p in unused:
            p.grad.zero_()
        if not optimizer_step:
            return
        main = torch.cuda.current_stream()
        missed = self.optimizer.pieces([p for p in self.in_backward if p not in handled])
        self.optimizer.apply(self.after + missed + [pc for i, done in enumerate(self.fired) if not done
                                                    for pc in self.pieces[i]])
        main.wait_stream(self.stream)
