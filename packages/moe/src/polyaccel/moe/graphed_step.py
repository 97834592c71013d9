"""A training micro-step (forward + backward) captured once as a CUDA graph and replayed.

An MoE step launches thousands of kernels (per layer: norms, rotary, attention, router,
sort, two grouped GEMMs, combine, and all their backward kernels); eager PyTorch spends
host time on each, and at ~4k tokens per micro-batch the GPU waits for the host between many
of them. Replaying a graph launches the whole micro-step at once.

:class:`GraphedMicroStep` runs the first ``warmup`` calls eagerly (doing real work: they
compile, autotune and allocate), captures the next call and replays it from then on. Each
call copies the batch into the graph's static input buffers. Gradients accumulate into the
parameters' existing ``.grad`` tensors, which therefore must stay the same tensors across
steps: use :class:`polyaccel.moe.optim.FlatAdamW` (whose ``zero_grad`` keeps them) or
``optimizer.zero_grad(set_to_none=False)``. Missing gradients are created as zeros.

Requirements: a CUDA device; every call with the same batch shapes and keys (a call
with other shapes runs eagerly, with a one-time warning); no host synchronization in the
model's forward or backward (polyaccel MoE models have none on one device; a padded
``attention_mask`` stays a mask under capture). Not for FSDP2 / expert parallelism, whose
collectives and hooks run on the host.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


class GraphedMicroStep:
    """``loss = step(**batch)`` runs ``model(**batch, **forward_kwargs).loss.backward()``
    and returns the loss (detached); from call ``warmup + 1`` on, as one CUDA graph replay.

    :param model: the model, on a CUDA device, in train mode.
    :param warmup: eager calls before capture (compilation, autotuning, allocator warm-up).
    :param forward_kwargs: extra keyword arguments of every forward (e.g. ``use_cache=False``).
    """

    def __init__(self, model: nn.Module, warmup: int = 2, **forward_kwargs: Any) -> None:
        if warmup < 1:
            raise ValueError(f"warmup={warmup} must be >= 1: the first calls compile and autotune, "
                             "which cannot happen during capture")
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"GraphedMicroStep replays CUDA graphs; the model is on {device}. "
                             "Run the step eagerly there (model(**batch).loss.backward()).")
        self.model, self.warmup, self.forward_kwargs = model, warmup, forward_kwargs
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: dict[str, torch.Tensor] = {}
        self.static_loss: torch.Tensor | None = None
        self._warned = False

    def __call__(self, **batch: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.graph is not None:
            if not self._matches(batch):
                return self._eager(batch)
            for name, t in batch.items():
                self.static_inputs[name].copy_(t, non_blocking=True)
            self.graph.replay()
            return self.static_loss.clone()
        self._ensure_grads()
        if self.calls <= self.warmup:
            return self._eager(batch)
        return self._capture(batch)

    # ---- internals --------------------------------------------------------------------------
    def _eager(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = self.model(**batch, **self.forward_kwargs).loss
        loss.backward()
        return loss.detach()

    def _ensure_grads(self) -> None:
        """Give every trainable parameter a ``.grad`` (zeros if missing): a graph replays the
        in-place accumulation into these exact tensors."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _matches(self, batch: dict[str, torch.Tensor]) -> bool:
        ok = batch.keys() == self.static_inputs.keys() and all(
            t.shape == self.static_inputs[k].shape and t.dtype == self.static_inputs[k].dtype
            for k, t in batch.items())
        if not ok and not self._warned:
            logger.warning("GraphedMicroStep: batch shapes %s differ from the captured %s; running such "
                           "batches eagerly", {k: tuple(t.shape) for k, t in batch.items()},
                           {k: tuple(t.shape) for k, t in self.static_inputs.items()})
            self._warned = True
        return ok

    def _capture(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        for name, t in batch.items():
            if not (torch.is_tensor(t) and t.is_cuda):
                raise ValueError(f"GraphedMicroStep needs CUDA tensors; {name!r} is "
                                 f"{t.device if torch.is_tensor(t) else type(t).__name__}")
        self.static_inputs = {name: t.clone() for name, t in batch.items()}
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = self.model(**self.static_inputs, **self.forward_kwargs).loss
            loss.backward()
            self.static_loss = loss.detach()
        self.graph = graph
        graph.replay()  # capture records only: this call's work happens now
        return self.static_loss.clone()
