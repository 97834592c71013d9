"""``FlatAdamW``: torch.optim.AdamW's math over one flat buffer per param group and dtype.

Why: ``torch.optim.AdamW(fused=True)`` walks lists of tensors (2.7 TB/s on an H200 over
1.26 B bf16 params) and leaves zeroing the grads to another pass. Here, at construction,
every param group's params (per dtype and device) are copied into one flat buffer and each
``p.data`` becomes a view of it; grads, ``exp_avg`` and ``exp_avg_sq`` get flat buffers the
same way (``p.grad`` is its view; autograd accumulates into it in place). A step is then one
:func:`polyaccel.core.ops.adamw_step_` call per buffer (one Triton pass on CUDA, 4.1 TB/s)
that also zeroes the grads it has read.

Limits: single process, plain tensors (FSDP2's DTensor shards: use ``torch.optim.AdamW``);
params must require grad; grads stay allocated as views (``zero_grad`` keeps them, never
``None``), so a param that received no gradient in a step is still stepped with a zero
gradient (weight decay and momentum apply, as in torch AdamW after
``zero_grad(set_to_none=False)``), unless its ``.grad`` is ``None`` at ``step()`` time: then
it is skipped, as torch AdamW does. Moving the model (``.to()``) after construction breaks
the views.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from polyaccel.core import ops

_ALIGN_BYTES = 256
"""Each param's view starts at a multiple of this many bytes (vectorised kernels,
``torch._grouped_mm`` and cuBLAS want aligned pointers); the gaps stay zero."""

_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
"""Options of torch AdamW this optimizer does not implement, with the value it runs as."""


class _Flat:
    """One set of flat buffers (param, grad, exp_avg, exp_avg_sq): the params of one group
    with one dtype and device. Each ``p.data`` and ``p.grad`` becomes its view here."""

    def __init__(self, params: list[torch.nn.Parameter], overwritten: frozenset[int] = frozenset()) -> None:
        # Params whose grads the caller writes over go last: the step zeroes [0, zero_end) only.
        params = [p for p in params if id(p) not in overwritten] + [p for p in params if id(p) in overwritten]
        self.params = params
        self.index = {p: i for i, p in enumerate(params)}
        align = max(1, _ALIGN_BYTES // params[0].element_size())
        self.offsets, n = [], 0
        self.zero_end = None
        for p in params:
            if id(p) in overwritten and self.zero_end is None:
                self.zero_end = n
            self.offsets.append(n)
            n += -(-p.numel() // align) * align
        self.zero_end = n if self.zero_end is None else self.zero_end
        kw = {"dtype": params[0].dtype, "device": params[0].device}
        # One buffer at a time, so that the old params are freed before the state is allocated
        # (peak: the four buffers, not four plus the model).
        self.param = torch.zeros(n, **kw)
        with torch.no_grad():
            for p in params:
                view = self.param[self.slice(p)].view(p.shape)
                view.copy_(p)
                p.data = view  # the old storage is freed as we go
            self.grad = torch.zeros(n, **kw)
            had_grads = False
            for p in params:
                g = self.grad[self.slice(p)].view(p.shape)
                if p.grad is not None:
                    g.copy_(p.grad)
                    had_grads = True
                p.grad = g
        self.grads = [p.grad for p in params]
        self.exp_avg, self.exp_avg_sq = torch.zeros(n, **kw), torch.zeros(n, **kw)
        self.zeroed_version: int | None = None if had_grads else self.grad._version
        """``self.grad._version`` when the grads were last known to be all zero. Views share
        their base's version counter and every in-place write (autograd's accumulation,
        clipping) bumps it, so a differing version means the grads may hold values."""

    def slice(self, p: torch.Tensor) -> slice:
        """Where ``p`` lives in the flat buffers."""
        start = self.offsets[self.index[p]]
        return slice(start, start + p.numel())

    def views(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """1-D (param, grad, exp_avg, exp_avg_sq) views of ``p``'s slice."""
        sl = self.slice(p)
        return self.param[sl], self.grad[sl], self.exp_avg[sl], self.exp_avg_sq[sl]


def _check_params(params: list[torch.Tensor]) -> None:
    for p in params:
        if type(p.data) is not torch.Tensor:
            raise ValueError(f"FlatAdamW needs plain tensors, got a {type(p.data).__name__} parameter "
                             "(FSDP2 shards parameters as DTensors): use torch.optim.AdamW there")
        if not p.requires_grad or not p.is_floating_point() or p.is_sparse:
            raise ValueError("FlatAdamW needs dense floating-point parameters that require grad; "
                             "leave frozen ones out of its param groups")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("FlatAdamW: a param group lists the same parameter twice")


class FlatAdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s math, decoupled weight decay) over flat buffers; see the
    module docstring for what changes for the params and their grads, and the limits.

    ``state_dict()`` has torch AdamW's format (``state[p] = {"step", "exp_avg",
    "exp_avg_sq"}``, the same group options), so checkpoints move both ways between the two.

    ``grads_overwritten``: params whose gradients the caller writes over (rather than adds to)
    at the start of every step, e.g. the expert weights a
    :class:`~polyaccel.moe.graphed_step.GraphedMicroStep` told ``micro_batch`` handles
    (``its .overwritten_params``); neither :meth:`step` nor :meth:`zero_grad` zeroes their
    grads (2 of the 16 bytes a bf16 step moves per parameter).
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, grads_overwritten: Iterable[torch.Tensor] = ()) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid AdamW hyperparameters: lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self._flats: list[list[_Flat]] = []
        self._overwritten = frozenset(id(p) for p in grads_overwritten)
        self._next_scale: torch.Tensor | None = None
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **_UNSUPPORTED,
                        foreach=None, fused=None, decoupled_weight_decay=True)  # torch AdamW's keys
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch's checks), then move its params into flat buffers."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]  # torch's normalised list of tensors
        try:
            _check_params(params)
        except ValueError:
            self.param_groups.pop()
            raise
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        flats = [_Flat(ps, self._overwritten) for ps in by_kind.values()]
        for flat in flats:
            for p in flat.params:
                _, _, m, v = flat.views(p)
                self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                 "exp_avg": m.view(p.shape), "exp_avg_sq": v.view(p.shape)}
        self._flats.append(flats)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, grad_scale: torch.Tensor | None = None) -> Any:
        """One AdamW step for every param; the grads are zeroed as they are read.

        Fast path: one :func:`~polyaccel.core.ops.adamw_step_` per flat buffer. A param whose
        ``.grad`` is not its flat view any more is copied into it first; one whose ``.grad``
        is ``None`` is skipped (as torch AdamW does), and then that buffer is stepped param by
        param (also when its params' step counts differ, e.g. after loading such a state).
        Every ``p.grad`` is its (zeroed) view afterwards.

        ``grad_scale``: a 0-dim device tensor every gradient is multiplied by as it is read,
        e.g. :func:`clip_coefficient`'s: gradient clipping without its own pass over the
        gradients and without a host sync.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale, self._next_scale = self._next_scale, None
        for group, flats in zip(self.param_groups, self._flats, strict=True):
            for flat in flats:
                self._step_flat(group, flat, grad_scale)
        return loss

    def _step_flat(self, group: dict[str, Any], flat: _Flat, grad_scale: torch.Tensor | None) -> None:
        skip = set()
        for p, g in zip(flat.params, flat.grads, strict=True):
            if p.grad is g:
                continue
            if p.grad is None:
                skip.add(p)
                g.zero_()
            else:
                g.copy_(p.grad)
            p.grad = g
        beta1, beta2 = group["betas"]
        hyper = dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                     weight_decay=float(group["weight_decay"]), zero_grad=True, grad_scale=grad_scale)
        steps = [self.state[p]["step"] for p in flat.params]
        counts = {int(s) for s in steps}
        if not skip and len(counts) == 1:
            step = counts.pop() + 1
            for part, zero in ((slice(0, flat.zero_end), True), (slice(flat.zero_end, None), False)):
                if part.start != flat.param.numel():
                    ops.adamw_step_(flat.param[part], flat.grad[part], flat.exp_avg[part], flat.exp_avg_sq[part],
                                    step=step, **{**hyper, "zero_grad": zero})
            torch._foreach_add_(steps, 1.0)
        else:
            for p, s in zip(flat.params, steps, strict=True):
                if p not in skip:
                    ops.adamw_step_(*flat.views(p), step=int(s) + 1, **hyper)
                    s += 1
        flat.zeroed_version = flat.grad._version

    def grad_norm(self, known_sumsq: dict[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The L2 norm of every param's gradient as a 0-dim fp32 device tensor, read in one pass
        over each flat grad buffer (the gaps between views stay zero) rather than tensor by
        tensor. None when some ``p.grad`` is not its flat view (set to ``None`` or replaced
        since the backward): then nothing in the buffers says what the gradient is.

        ``known_sumsq`` (param -> its gradient's sum of squares, e.g.
        :meth:`GraphedMicroStep.expert_grad_sumsq`): where it covers every param whose
        gradient the caller writes over (``grads_overwritten``, the end of each buffer), only
        the rest of the buffer is read and those sums are added instead."""
        flats = [flat for group in self._flats for flat in group]
        if not flats or len({flat.grad.device for flat in flats}) > 1:  # (buffers on several devices: torch's)
            return None
        squares = []
        for flat in flats:
            if any(p.grad is not g for p, g in zip(flat.params, flat.grads, strict=True)):
                return None
            dtype = torch.promote_types(flat.grad.dtype, torch.float32)  # fp64 grads keep fp64
            tail = [p for p, start in zip(flat.params, flat.offsets, strict=True) if start >= flat.zero_end]
            if tail and known_sumsq is not None and all(p in known_sumsq for p in tail):
                squares.append(torch.linalg.vector_norm(flat.grad[:flat.zero_end], dtype=dtype).square().float())
                squares.extend(known_sumsq[p].reshape(()).float() for p in tail)
            else:
                squares.append(torch.linalg.vector_norm(flat.grad, dtype=dtype).square().float())
        return torch.stack(squares).sum().sqrt()

    def zero_every_grad(self) -> None:
        """Zero every gradient from now on, ``grads_overwritten``'s too (now and at each
        :meth:`step`): for a caller that planned to write over them and then does not."""
        self._overwritten = frozenset()
        for flats in self._flats:
            for flat in flats:
                known_zero = flat.zeroed_version == flat.grad._version
                flat.grad[flat.zero_end:].zero_()
                flat.zero_end = flat.param.numel()
                if known_zero:
                    flat.zeroed_version = flat.grad._version

    def scale_next_step(self, grad_scale: torch.Tensor | None) -> None:
        """Multiply the gradients by ``grad_scale`` in the next :meth:`step` (when that call is
        given none itself): for callers that cannot pass it, e.g. a Trainer that clips before
        calling ``optimizer.step()``."""
        self._next_scale = grad_scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Make every ``p.grad`` its flat view again, holding zeros.

        ``set_to_none`` is ignored: grads are never set to ``None``, because autograd's
        AccumulateGrad adds in place into an existing ``.grad`` and that is what keeps the
        gradients in the flat buffer. :meth:`step` has already zeroed them, so this writes
        zeros only into a buffer written to since (a backward without a step, say).
        """
        for flats in self._flats:
            for flat in flats:
                for p, g in zip(flat.params, flat.grads, strict=True):
                    if p.grad is not g:
                        p.grad = g
                if flat.zeroed_version != flat.grad._version:
                    flat.grad[:flat.zero_end].zero_()
                    flat.zeroed_version = flat.grad._version

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FlatAdamW or torch.optim.AdamW state dict, copying the moments INTO the flat
        views (they stay views; a param missing from the saved state starts afresh)."""
        for g in state_dict["param_groups"]:
            bad = {k: g[k] for k, v in _UNSUPPORTED.items() if g.get(k, v) != v}
            if bad:
                raise ValueError(f"FlatAdamW does not implement {bad}; use torch.optim.AdamW")
        saved_state = state_dict["state"]
        # torch's load with no state: its checks, hooks and group options; then the state by hand.
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = dict(zip(params, (saved_state.get(i, {}) for i in saved_ids), strict=True))
        with torch.no_grad():
            for flats in self._flats:
                for flat in flats:
                    for p in flat.params:
                        _, _, m, v = flat.views(p)
                        s = saved[p]
                        for name, view in (("exp_avg", m), ("exp_avg_sq", v)):
                            if name in s:
                                view.copy_(s[name].reshape(-1))
                            else:
                                view.zero_()
                        step = float(s["step"]) if "step" in s else 0.0
                        self.state[p] = {"step": torch.tensor(step, dtype=torch.float32),
                                         "exp_avg": m.view(p.shape), "exp_avg_sq": v.view(p.shape)}


def grad_norm(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              known_sumsq: dict[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """L2 norm of all gradients of a single-process ``model`` as a device tensor (no host sync):
    :meth:`FlatAdamW.grad_norm`'s one pass per buffer (less the gradients whose sums of squares
    ``known_sumsq`` gives) when ``optimizer`` is a FlatAdamW that holds every param of
    ``model`` with a gradient and no other, else ``torch.nn.utils.get_total_norm``."""
    ordered = list(model.parameters())
    params = set(ordered)
    grads = {p: p.grad for p in ordered if p.grad is not None}
    if isinstance(optimizer, FlatAdamW) and grads:
        held = {p for group in optimizer.param_groups for p in group["params"]}
        if grads.keys() <= held <= params:  # the buffers hold exactly the model's gradients
            norm = optimizer.grad_norm(known_sumsq)
            if norm is not None:
                return norm
    return torch.nn.utils.get_total_norm(list(grads.values())) if grads else torch.zeros(())


def clip_coefficient(total_norm: torch.Tensor, max_norm: float | None) -> torch.Tensor | None:
    """Gradient clipping's factor ``min(1, max_norm / (total_norm + 1e-6))`` (torch's
    ``clip_grad_norm_``) as a device tensor, or None when ``max_norm`` is None or 0."""
    if not max_norm:
        return None
    return torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)


def step_scaled(optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
    """``optimizer.step()`` on gradients multiplied by ``grad_scale`` (None: as they are):
    inside FlatAdamW's pass, else one foreach multiply over the gradients first."""
    if grad_scale is None:
        optimizer.step()
    elif isinstance(optimizer, FlatAdamW):
        optimizer.step(grad_scale=grad_scale)
    else:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, grad_scale.to(grads[0].device))
        optimizer.step()
