"""Fused expert weight-gradient accumulation (polyaccel.moe.grouped_linear) on CPU."""

from __future__ import annotations

import torch
from torch import nn

from polyaccel.core import ops
from polyaccel.moe.grouped_linear import fusable, grouped_linear


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor([3, 0, 7, 2, 5])
    offsets = counts.cumsum(0).to(torch.int32)
    return torch.randn(17, 4, generator=g), offsets


def test_accumulates_like_autograd_over_micro_batches():
    w1 = nn.Parameter(torch.randn(5, 6, 4))
    w2 = nn.Parameter(w1.detach().clone())
    for seed in range(3):
        x, offsets = _problem(seed)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        grouped_linear(a, w1, offsets).square().sum().backward()
        ops.grouped_mm(b, w2, offsets).square().sum().backward()
        torch.testing.assert_close(a.grad, b.grad)
        torch.testing.assert_close(w1.grad, w2.grad)


def test_frozen_weight_gets_no_gradient():
    w = nn.Parameter(torch.randn(5, 6, 4), requires_grad=False)
    x, offsets = _problem(0)
    x.requires_grad_()
    grouped_linear(x, w, offsets).sum().backward()
    assert w.grad is None and x.grad is not None


def test_fusable_only_for_plain_unhooked_leaves():
    w = nn.Parameter(torch.randn(2, 3, 4))
    assert fusable(w)
    assert not fusable(w * 1)  # not a leaf
    with torch.no_grad():
        assert not fusable(w)
    hooked = nn.Parameter(torch.randn(2, 3, 4))
    hooked.register_post_accumulate_grad_hook(lambda p: None)
    assert not fusable(hooked)
    hooked2 = nn.Parameter(torch.randn(2, 3, 4))
    hooked2.register_hook(lambda g: g)
    assert not fusable(hooked2)


def test_not_fusable_in_a_multi_process_job(monkeypatch):
    """DDP's reducer hooks autograd's accumulator invisibly: keep autograd's path there."""
    w = nn.Parameter(torch.randn(2, 3, 4))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert not fusable(w)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 1)
    assert fusable(w)


def test_fused_backward_steps_equal_a_step_after_the_backward():
    """Two micro-batches then FlatAdamW.step(), three times, == the last micro-batch's backward
    taking the expert weights' AdamW step inside their weight-gradient op (the rest applied
    after), leaving their grads for the next step's first micro-batch to write over."""
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig
    from polyaccel.moe.grouped_linear import fused_backward
    from polyaccel.moe.optim import FlatAdamW
    from polyaccel.moe.presets import tiny

    batches = [torch.randint(3, 97, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    runs = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu")).train()
        opt = FlatAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        rest = [p for n, p in model.named_parameters() if ".experts." not in n]
        for step in range(3):
            first, last = batches[2 * step], batches[2 * step + 1]
            if not fused:
                for ids in (first, last):
                    model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                continue
            with fused_backward(overwrite=experts if step else ()) as written:
                model(input_ids=first, labels=first).loss.backward()
            assert set(written) == (set(experts) if step else set())
            opt.begin_step()
            with fused_backward({p: opt.adam_state(p) for p in experts}, keep_grad=True) as stepped:
                model(input_ids=last, labels=last).loss.backward()
            assert set(stepped) == set(experts)
            opt.apply(opt.pieces(rest))
            assert all(not p.grad.any() for p in rest) and all(p.grad.any() for p in experts)  # kept
        runs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for n in runs[0]:
        torch.testing.assert_close(runs[1][n], runs[0][n], rtol=1e-5, atol=1e-6, msg=n)
