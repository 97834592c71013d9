"""Behaviour of the MoE fast path that the other CPU tests left unchecked (found by mutation
testing): FlatAdamW's layout and its zeroing contracts, GraphedMicroStep's ordering and
gradient bookkeeping around expert weights, plan()'s automatic weight-gradient window, and
the Trainer's reasons for not graphing."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import transformers
from torch import nn

from polyaccel.core import ops
from polyaccel.moe import fast_path
from polyaccel.moe.graphed_step import GraphedMicroStep
from polyaccel.moe.grouped_linear import flush_wgrad, grouped_linear, kept_wgrad_tensors
from polyaccel.moe.optim import FlatAdamW
from polyaccel.moe.presets import qwen3_30b_a3b, tiny

# --------------------------------------------------------------------------------------------
# FlatAdamW
# --------------------------------------------------------------------------------------------


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.Linear(13, 5, bias=False))


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def test_every_view_starts_on_a_256_byte_boundary_of_its_buffer():
    """Odd-sized params (7*13, 13, 65 elements; fp32 and bf16) each start 256 bytes into their
    flat buffers (grouped GEMMs and vectorised kernels want aligned pointers); the gaps hold
    zeros after a backward and a step (``grad_norm`` reads the whole buffer)."""
    model = _mlp()
    model[2].to(torch.bfloat16)
    opt = FlatAdamW(model.parameters(), lr=1e-2)
    flats = opt._flats[0]
    assert len(flats) == 2 and any(f.param.numel() > sum(p.numel() for p in f.params) for f in flats)
    for flat in flats:
        for p in flat.params:
            for view, base in ((p, flat.param), (p.grad, flat.grad), (opt.state[p]["exp_avg"], flat.exp_avg),
                               (opt.state[p]["exp_avg_sq"], flat.exp_avg_sq)):
                assert (view.data_ptr() - base.data_ptr()) % 256 == 0
    x = torch.randn(6, 7)
    model[2](model[1](model[0](x)).bfloat16()).float().square().mean().backward()
    norm = opt.grad_norm()
    exact = torch.stack([p.grad.double().square().sum() for p in model.parameters()]).sum().sqrt()
    torch.testing.assert_close(norm.double(), exact, rtol=1e-6, atol=0)


def test_grads_that_exist_before_construction_are_stepped_and_zeroed_like_torch():
    """A backward before the optimizer is built (e.g. a warm-up micro-batch): FlatAdamW's
    first step uses those gradients as torch AdamW does, and ``zero_grad`` clears them."""
    ref, ours = _mlp(), _mlp()
    _backward(ref, 0)
    _backward(ours, 0)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), FlatAdamW(ours.parameters(), lr=1e-2)
    assert all(p.grad.any() for p in ours.parameters())
    opt_ref.step()
    opt.step()
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    model = _mlp()
    _backward(model, 1)
    opt = FlatAdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    assert not any(p.grad.any() for p in model.parameters())


def test_zero_every_grad_zeroes_the_grads_it_had_left_to_the_caller():
    """``grads_overwritten`` params keep their gradient through ``step`` (the caller was to
    write over it); after ``zero_every_grad`` (the caller will not) that stale gradient is
    gone at once and later steps equal torch AdamW's; a buffer written to before
    ``zero_every_grad`` is still zeroed by the next ``zero_grad``."""
    ref, ours = _mlp(), _mlp()
    w = ours[0].weight
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = FlatAdamW(ours.parameters(), lr=1e-2, grads_overwritten=[w])
    for m, o in ((ref, opt_ref), (ours, opt)):
        _backward(m, 0)
        o.step()
        o.zero_grad()
    assert w.grad.any()  # left to the caller
    opt.zero_every_grad()
    assert not w.grad.any()
    for m, o in ((ref, opt_ref), (ours, opt)):
        _backward(m, 1)
        o.step()
        o.zero_grad()
    assert not any(p.grad.any() for p in ours.parameters())
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    model = _mlp()
    opt = FlatAdamW(model.parameters(), lr=1e-2, grads_overwritten=[model[0].weight])
    _backward(model, 2)  # the buffer now holds gradients
    opt.zero_every_grad()
    opt.zero_grad()
    assert not any(p.grad.any() for p in model.parameters())


def test_zero_grad_gives_back_views_set_to_none_and_leaves_overwritten_grads():
    """Trainer's ``model.zero_grad()`` sets every ``.grad`` to None: ``opt.zero_grad()`` makes
    them the flat views again (a replayed CUDA graph accumulates into those very tensors), and
    it does not zero the grads named in ``grads_overwritten`` (their writer does)."""
    model = _mlp()
    kept = model[2].weight
    opt = FlatAdamW(model.parameters(), lr=1e-2, grads_overwritten=[kept])
    views = {p: p.grad for p in model.parameters()}
    _backward(model, 0)
    before = kept.grad.clone()
    model.zero_grad(set_to_none=True)
    opt.zero_grad()
    for p in model.parameters():
        assert p.grad is views[p]
        if p is not kept:
            assert not p.grad.any()
    assert torch.equal(kept.grad, before) and before.any()


# --------------------------------------------------------------------------------------------
# GraphedMicroStep around expert weights (eager on the CPU: the same bookkeeping)
# --------------------------------------------------------------------------------------------

_OFFSETS = torch.tensor([3, 3, 10, 12, 17], dtype=torch.int32)


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fuse_wgrad = True  # as polyaccel's MoE layers mark theirs
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(5, 6, 4, generator=g))
        self.w2 = nn.Parameter(torch.randn(5, 6, 4, generator=g))


class _Toy(nn.Module):
    """Two expert weights (w2 used only when ``use2``) and a plain parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = _Experts()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def loss(self, x: torch.Tensor, use2: torch.Tensor, fused: bool = True) -> torch.Tensor:
        mm = grouped_linear if fused else ops.grouped_mm
        y = mm(x, self.experts.w1, _OFFSETS)
        if bool(use2):
            y = y + mm(x.flip(0), self.experts.w2, _OFFSETS)
        return (y * self.scale).square().sum()


def _x(seed: int) -> torch.Tensor:
    return torch.randn(17, 4, generator=torch.Generator().manual_seed(seed))


def _run_steps(window: int, uses: list[list[bool]], hook: bool = False) -> None:
    """Steps of micro-batches (``uses[s][i]``: micro-batch i of step s uses w2) through a
    GraphedMicroStep and FlatAdamW (lr=0: the weights stay, so that each step's gradients
    can be compared with plain autograd's over that step's micro-batches)."""
    model, ref = _Toy(), _Toy()
    step = GraphedMicroStep(model, wgrad_window=window, loss_fn=model.loss)
    opt = FlatAdamW(model.parameters(), lr=0.0, weight_decay=0.0, grads_overwritten=step.overwritten_params)
    assert set(step.overwritten_params) == {model.experts.w1, model.experts.w2}
    if hook:  # hooked after the optimizer was made: no longer fusable, autograd accumulates it
        model.experts.w1.register_hook(lambda g: g)
    try:
        for s, flags in enumerate(uses):
            n = len(flags)
            for i, use2 in enumerate(flags):
                x = _x(10 * s + i)
                step(micro_batch=(i, n), x=x, use2=torch.tensor(use2))
                ref.loss(x, torch.tensor(use2), fused=False).backward()
            assert not kept_wgrad_tensors()  # nothing deferred past the step's last micro-batch
            for (name, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
                want = a.grad if a.grad is not None else torch.zeros_like(a)
                torch.testing.assert_close(b.grad, want, msg=f"step {s}: {name}")
            opt.step()
            opt.zero_grad()
            ref.zero_grad(set_to_none=True)
    finally:
        flush_wgrad()  # leave no deferred micro-batch to the next test


@pytest.mark.parametrize("window", [1, 2])
def test_expert_weight_hooked_after_the_optimizer_was_made_gets_only_this_steps_gradient(window):
    """The optimizer leaves w1's gradient to the micro-step, then a hook makes w1 unfusable:
    its stale gradient must go at the step's first micro-batch and every micro-batch of the
    step must count (with a window of 2 it used to be zeroed at micro-batch 1, dropping 0's)."""
    _run_steps(window, [[True] * 3] * 3, hook=True)


def test_expert_weight_unused_in_a_step_holds_zero_and_a_window_is_flushed_at_the_step_end():
    """w2 kept by a deferring micro-batch but unused by the one that computes the window: its
    gradient is that kept micro-batch's (not added to last step's); a step that never uses
    w2 leaves it zero, not last step's."""
    _run_steps(2, [[True, True], [True, False], [False, False], [True, True, False]])
    _run_steps(1, [[True, True], [False, False]])


def test_micro_batches_must_come_in_order():
    model = _Toy()
    step = GraphedMicroStep(model, wgrad_window=2, loss_fn=model.loss)
    batch = {"x": _x(0), "use2": torch.tensor(True)}
    try:
        with pytest.raises(ValueError, match="micro_batch"):
            step(**batch)  # a window needs positions
        with pytest.raises(ValueError, match="expected micro-batch 0"):
            step(micro_batch=(1, 2), **batch)
        step(micro_batch=(0, 2), **batch)
        with pytest.raises(ValueError, match="expected micro-batch 1"):
            step(micro_batch=(0, 2), **batch)
        with pytest.raises(ValueError, match="expected micro-batch 1"):
            step(micro_batch=(2, 2), **batch)
        step(micro_batch=(1, 2), **batch)
        step(micro_batch=(0, 1), **batch)  # a new step
    finally:
        flush_wgrad()


def test_a_step_that_promised_to_write_over_gradients_refuses_calls_without_positions():
    """Told that the micro-step writes the expert gradients over, FlatAdamW leaves them alone;
    calls that do not say where a step starts would then add each step's gradient to the last
    one's. They are refused; with grad_accum the step counts positions itself."""
    model = _Toy()
    step = GraphedMicroStep(model, loss_fn=model.loss)
    batch = {"x": _x(0), "use2": torch.tensor(True)}
    step(**batch)  # nobody was promised anything: a plain accumulating call
    FlatAdamW(model.parameters(), lr=0.0, grads_overwritten=step.overwritten_params)
    with pytest.raises(ValueError, match="where each step starts"):
        step(**batch)
    counted = GraphedMicroStep(model, loss_fn=model.loss, grad_accum=2)
    FlatAdamW(model.parameters(), lr=0.0, grads_overwritten=counted.overwritten_params)
    counted(**batch)
    counted(**batch)


# --------------------------------------------------------------------------------------------
# plan(): the automatic window where a CUDA device is (its memory size faked here)
# --------------------------------------------------------------------------------------------


def test_plan_sizes_the_auto_window_and_says_what_turns_it_off(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=141 * 10**9))
    kwargs = dict(model_config=qwen3_30b_a3b(8), device=torch.device("cuda", 0), cuda_graph=False,
                  wgrad_window="auto", fsdp=False, optimizer="flat_adamw", activation_checkpointing=False,
                  fused_grad_accumulation=True, tokens_per_micro_batch=4096, grad_accum=4)
    assert fast_path.plan(**kwargs) == fast_path.FastPath(cuda_graph=False, wgrad_window=4, reasons=())
    for change, said in (({"fsdp": True}, "FSDP2"), ({"fused_grad_accumulation": False}, "grad_accumulation=fused"),
                         ({"activation_checkpointing": True}, "activation checkpointing"),
                         ({"peft": True}, "frozen expert weights")):
        got = fast_path.plan(**{**kwargs, **change})
        assert got.wgrad_window == 1 and any(said in r for r in got.reasons), change


def test_auto_window_may_keep_exactly_the_memory_share():
    per = fast_path.kept_bytes_per_micro_batch(qwen3_30b_a3b(8), 4096)
    at = dict(tokens_per_micro_batch=4096, grad_accum=4, share=0.5)
    assert fast_path.auto_window(qwen3_30b_a3b(8), device_bytes=6 * per, **at) == 4  # 3 kept == half
    assert fast_path.auto_window(qwen3_30b_a3b(8), device_bytes=6 * per - 2, **at) == 3


# --------------------------------------------------------------------------------------------
# Trainer: why its micro-step is not graphed, and whose clipping runs
# --------------------------------------------------------------------------------------------


def _trainer(tmp_path, **kw):
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, Trainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"),
                                             dtype=torch.float32)
    ids = torch.randint(3, 97, (4, 8), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1,
                                          optim="adamw_torch", max_grad_norm=0.05, **kw)
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids])


def test_trainer_graph_blockers_name_each_unmet_requirement(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    model = trainer.model
    why = trainer._graph_blockers(model, flat_adamw=True)
    assert why[0] == "it needs a CUDA device" and len(why) == 2 and "float32 expert weights" in why[1]
    assert any("FlatAdamW" in r for r in trainer._graph_blockers(model, flat_adamw=False))
    other = copy.deepcopy(nn.Linear(2, 2))
    other.peft_config = {}
    why = trainer._graph_blockers(other, flat_adamw=True)
    assert any("not a polyaccel MoE model" in r for r in why) and any("PEFT" in r for r in why)
    assert any("activation checkpointing" in r for r in
               _trainer(tmp_path, gradient_checkpointing=True)._graph_blockers(model, flat_adamw=True))
    assert any("custom loss" in r for r in
               _trainer(tmp_path, label_smoothing_factor=0.1)._graph_blockers(model, flat_adamw=True))
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    assert any("several processes" in r for r in trainer._graph_blockers(model, flat_adamw=True))


def test_trainer_clipping_in_several_processes_is_trainers_own(tmp_path, monkeypatch):
    """Under DDP each process holds a part of the gradient norm: Trainer's own clipping."""
    trainer = _trainer(tmp_path)
    trainer.create_optimizer()
    assert trainer.flat_optimizer() is not None
    monkeypatch.setattr(transformers.Trainer, "_clip_grad_norm", lambda self, model: "trainer's own")
    assert trainer._clip_grad_norm(trainer.model) != "trainer's own"
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))
    assert trainer._clip_grad_norm(trainer.model) == "trainer's own"
