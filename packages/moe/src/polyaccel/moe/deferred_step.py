"""FlatAdamW's step applied by the model's next forward, layer by layer, beside it.

The AdamW pass reads and writes every parameter, gradient and moment once (~14 bytes per bf16
parameter: 11% of qwen3-30b-a3b-L8's training step on an H200, 6% of Mixtral's) at the
memory's rate, while the GEMMs of a forward leave the memory mostly idle. The next forward
needs layer ``i``'s new weights only when it reaches layer ``i``. So with
``FlatAdamW(..., defer_to=model)``, ``step()`` only records the step (its seven scalars go to
a device tensor, the gradient-clipping factor to another), and the model's next forward
applies it: before its first part it launches the pass split per part (embedding, each decoder
layer, then the rest: final norm, LM head) on a side stream, one event after each, and each
part waits for its own alone. Our models call :attr:`MoeModel.before_part
<polyaccel.moe.models.base.MoeModel.before_part>` at those points themselves (outside compiled
layers, and before the fused embedding, which never calls ``embed_tokens``); other models get
forward pre-hooks on the same modules. On the CPU the parts run in line, before
the forward. Inside a CUDA graph capture the same launches are captured; the graph then
replays them with the scalars of whichever step is pending (:class:`GraphedMicroStep` tells
:meth:`DeferredStep.replayed`).

Until that forward, parameters still hold the previous step's values: ``optimizer.flush()``
applies a pending step at once, and so do ``optimizer.state_dict()``, ``model.state_dict()``
(and with it ``save_pretrained``) and the next ``optimizer.step()``. Gradients stay readable
until the step is applied (the pass zeroes them as it reads them, as FlatAdamW's step does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from polyaccel.core import ops


def forward_order(model: nn.Module) -> list[nn.Module]:
    """The modules a forward of a Transformers-layout causal LM runs in order: the token
    embedding, each decoder layer, then the final norm (whose part also holds every parameter
    no earlier module owns: the LM head)."""
    inner = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "norm")]
    if not all(isinstance(p, nn.Module) for p in parts) or not isinstance(parts[1], nn.ModuleList):
        raise ValueError("FlatAdamW(defer_to=model) needs a causal LM with model.embed_tokens, model.layers "
                         f"and model.norm (Transformers' layout); {type(model).__name__} has not")
    return [parts[0], *parts[1], parts[2]]


def deferrable(model: nn.Module, who: str) -> nn.Module | None:
    """``model`` when a step can wait for its forward (:func:`forward_order`), else None, with
    the reason logged once (``who``: the setting that asked, e.g. ``"train.defer_step"``)."""
    from polyaccel.moe.fast_path import say_once

    try:
        forward_order(model)
    except ValueError as e:
        say_once(f"{who} off: {e}")
        return None
    return model


@dataclasses.dataclass(slots=True)
class _Part:
    """One contiguous range of a flat buffer stepped as one launch."""

    flat: Any
    span: slice
    zero_grad: bool


class DeferredStep:
    """A FlatAdamW step pending for ``model``'s next forward, and what applies it there."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = forward_order(model)
        self.parts: list[list[_Part]] | None = None  # per module, built at the first step
        self.pending = False  # a step is recorded and not yet launched
        self.events: dict[int, Any] = {}  # module index -> its part's event (side stream, not yet waited)
        self.joined = True  # the side stream's work is ordered before the current stream's
        self.stream: Any = None
        self.scale: torch.Tensor | None = None  # the grad scale of the pending step (1 without clipping)
        inner = model.model
        if hasattr(type(inner), "before_part"):
            # Our models call it themselves, outside the compiled layers (a hook would run
            # inside them) and before the fused embedding (which never calls embed_tokens).
            inner.before_part = self._before
            # ...and a hook on the embedding for inputs_embeds made by calling it from outside
            self.modules[0].register_forward_pre_hook(self._hook(0))
        else:
            for i, m in enumerate(self.modules):
                m.register_forward_pre_hook(self._hook(i))
        model.register_state_dict_pre_hook(lambda *args, **kwargs: self.flush())
        model._polyaccel_deferred_step = self

    # ---- recording ----------------------------------------------------------------------------
    def record(self, flats: list[Any], scalars: list[list[float]], grad_scale: torch.Tensor | None) -> None:
        """Make this step pending: ``scalars[i]`` (:func:`~polyaccel.core.ops.adamw_scalars`)
        for ``flats[i]``, gradients times ``grad_scale`` (nothing may be pending: flush first)."""
        if self.parts is None:
            self.parts = self._plan(flats)
        for flat, values in zip(flats, scalars, strict=True):
            if getattr(flat, "hyper", None) is None:
                # The CUDA kernel reads fp32; core's reference reads the doubles exactly.
                dtype = torch.float32 if flat.param.is_cuda else torch.float64
                flat.hyper = torch.zeros(7, dtype=dtype, device=flat.param.device)
            flat.hyper.copy_(torch.tensor(values, dtype=flat.hyper.dtype))
            flat.zeroed_version = flat.grad._version  # the pass zeroes them: zero_grad() must not
        device = flats[0].param.device
        if self.scale is None:
            self.scale = torch.ones((), dtype=torch.float32, device=device)
            if device.type == "cuda":  # made here, not inside a graph capture
                self.stream = torch.cuda.Stream(device)
                self._events = [torch.cuda.Event() for _ in self.modules]
                for event in self._events:  # created now (at its first record), not inside a capture
                    event.record(self.stream)
        if grad_scale is None:
            self.scale.fill_(1.0)
        else:
            self.scale.copy_(grad_scale.reshape(()))
        self.pending = True

    def _plan(self, flats: list[Any]) -> list[list[_Part]]:
        owner: dict[int, int] = {}
        for i, module in enumerate(self.modules):
            for p in module.parameters():
                owner.setdefault(id(p), i)
        last = len(self.modules) - 1
        parts: list[list[_Part]] = [[] for _ in self.modules]
        for flat in flats:
            runs: list[list[int]] = []  # [module, start, end) in flat order, split at zero_end
            for p in sorted(flat.params, key=lambda q: flat.offsets[flat.index[q]]):
                i = owner.get(id(p), last)
                start = flat.offsets[flat.index[p]]
                end = start + p.numel()
                same_side = runs and (runs[-1][2] <= flat.zero_end) == (end <= flat.zero_end)
                if runs and runs[-1][0] == i and same_side:
                    runs[-1][2] = end  # (the alignment gap between two views is zeros: stepping it is a no-op)
                else:
                    runs.append([i, start, end])
            for i, start, end in runs:
                parts[i].append(_Part(flat, slice(start, end), end <= flat.zero_end))
        return parts

    # ---- applying -----------------------------------------------------------------------------
    def _launch(self, side_stream: bool) -> None:
        """Enqueue every part of the pending step: on a side stream, one event after each
        module's parts (CUDA), or in line on the current stream."""
        self.pending = False
        device = self.scale.device
        if side_stream and device.type == "cuda":
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self.joined = False
            with torch.cuda.stream(self.stream):
                for i, parts in enumerate(self.parts):
                    self._step(parts)
                    self._events[i].record(self.stream)
                    self.events[i] = self._events[i]
        else:
            for parts in self.parts:
                self._step(parts)
        for flat in {id(p.flat): p.flat for parts in self.parts for p in parts}.values():
            flat.zeroed_version = flat.grad._version

    def _step(self, parts: list[_Part]) -> None:
        for part in parts:
            flat, span = part.flat, part.span
            ops.adamw_step_from_(flat.param[span], flat.grad[span], flat.exp_avg[span], flat.exp_avg_sq[span],
                                 flat.hyper, zero_grad=part.zero_grad, grad_scale=self.scale)

    def _before(self, index: int) -> None:
        """Before part ``index`` (:func:`forward_order`) runs: launch a pending step, and wait
        for the parts up to this one."""
        if self.pending:
            self._launch(side_stream=True)
        if self.events:
            current = torch.cuda.current_stream(self.scale.device)
            for i in sorted(k for k in self.events if k <= index):
                current.wait_event(self.events.pop(i))
        if index == len(self.modules) - 1:
            self._join()

    def _hook(self, index: int):  # noqa: ANN202
        def before_forward(module: nn.Module, args: Any) -> None:  # noqa: ARG001
            self._before(index)
        # The fused embedding may skip this hook: MoeModel calls before_part(0) itself.
        before_forward._polyaccel_deferred_step = True
        return before_forward

    def _join(self) -> None:
        if not self.joined:
            torch.cuda.current_stream(self.scale.device).wait_stream(self.stream)
            self.events.clear()
            self.joined = True

    def flush(self) -> None:
        """Apply the pending step now (in line), or order the side stream's launched parts
        before the current stream's work."""
        if self.pending:
            self._launch(side_stream=False)
        self._join()

    def replayed(self) -> None:
        """A CUDA graph that captured this step's launch was replayed: the pending step ran."""
        self.pending = False


def pending_step(model: nn.Module) -> DeferredStep | None:
    """The :class:`DeferredStep` of ``model`` with a step pending, or None."""
    deferred = getattr(model, "_polyaccel_deferred_step", None)
    return deferred if deferred is not None and deferred.pending else None
