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


def test_gathered_input_gives_the_same_gradients():
    """``gathered_from=(source, rows)``: a deferred micro-batch keeps the source and row index
    instead of the copies; same weight and input gradients as autograd's, deferred or not."""
    from polyaccel.moe.grouped_linear import kept_wgrad_tensors, wgrad_window

    w1 = nn.Parameter(torch.randn(5, 6, 4))
    w2 = nn.Parameter(w1.detach().clone())
    for seed, defer in ((0, True), (1, False), (2, False)):
        x, offsets = _problem(seed)
        src = x[:6].clone().requires_grad_()
        rows = torch.randint(0, 6, (17,), dtype=torch.int32)
        with wgrad_window(defer=defer):
            grouped_linear(src[rows.long()], w1, offsets, gathered_from=(src, rows)).square().sum().backward()
        if defer:
            assert any(t is src for t in kept_wgrad_tensors())
        g1 = src.grad.clone()
        src.grad = None
        ops.grouped_mm(src[rows.long()], w2, offsets).square().sum().backward()
        torch.testing.assert_close(g1, src.grad)
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


def test_deferred_micro_batches_are_computed_by_the_next_backward():
    """Two deferred micro-batches leave ``.grad`` alone; the third's backward adds all three
    (one call over the kept rows), equal to autograd's accumulation."""
    from polyaccel.moe.grouped_linear import kept_wgrad_tensors, wgrad_window

    w1 = nn.Parameter(torch.randn(5, 6, 4))
    w2 = nn.Parameter(w1.detach().clone())
    w1.grad = torch.ones_like(w1)
    w2.grad = torch.ones_like(w2)
    for seed in range(3):
        x, offsets = _problem(seed)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        with wgrad_window(defer=seed < 2):
            grouped_linear(a, w1, offsets).square().sum().backward()
        ops.grouped_mm(b, w2, offsets).square().sum().backward()
        torch.testing.assert_close(a.grad, b.grad)  # input gradients are never deferred
        if seed < 2:
            assert torch.equal(w1.grad, torch.ones_like(w1)) and len(kept_wgrad_tensors()) == 3 * (seed + 1)
    torch.testing.assert_close(w1.grad, w2.grad)
    assert not kept_wgrad_tensors()


def test_overwrite_replaces_a_stale_gradient_and_flush_finishes_a_window():
    from polyaccel.moe.grouped_linear import flush_wgrad, kept_wgrad_tensors, wgrad_window

    w = nn.Parameter(torch.randn(5, 6, 4))
    w.grad = torch.full_like(w, 7.0)  # last step's, not zeroed
    ref = nn.Parameter(w.detach().clone())
    for seed, defer in ((0, True), (1, False)):
        x, offsets = _problem(seed)
        with wgrad_window(defer=defer, overwrite=[w]) as written:
            grouped_linear(x.requires_grad_(), w, offsets).sum().backward()
        ops.grouped_mm(x.detach(), ref, offsets).sum().backward()
        assert written == (set() if defer else {w})
    torch.testing.assert_close(w.grad, ref.grad)
    x, offsets = _problem(2)
    with wgrad_window(defer=True):
        grouped_linear(x, w, offsets).sum().backward()
    ops.grouped_mm(x, ref, offsets).sum().backward()
    assert kept_wgrad_tensors()
    flush_wgrad()
    assert not kept_wgrad_tensors()
    torch.testing.assert_close(w.grad, ref.grad)


def test_fused_embedding_adds_rows_like_autograd():
    """Repeated ids, the padding id and an existing gradient: the same ``.grad`` as
    ``nn.Embedding``'s autograd path; a hooked module keeps the plain path."""
    from polyaccel.moe.fused_embedding import embedding

    g = torch.Generator().manual_seed(0)
    ref = nn.Embedding(11, 6, padding_idx=2)
    ours = nn.Embedding(11, 6, padding_idx=2)
    ours.load_state_dict(ref.state_dict())
    for _ in range(2):
        ids = torch.randint(0, 11, (3, 9), generator=g)
        ids[0, :4] = 5  # a repeated token
        dy = torch.randn(3, 9, 6, generator=g)
        out = embedding(ids, ours)
        assert type(out.grad_fn).__name__ == "_EmbeddingBackward"  # the fused path, not nn.Embedding's
        (out * dy).sum().backward()
        (ref(ids) * dy).sum().backward()
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    assert not ours.weight.grad[2].any()
    ours.register_forward_hook(lambda m, i, o: o * 2)  # a hook the fused path would skip
    torch.testing.assert_close(embedding(ids, ours), 2 * torch.nn.functional.embedding(ids, ours.weight))


def test_defers_all_but_the_last_of_each_window_and_of_the_step():
    """Windows of 2 over 5 micro-batches: 0 defers, 1 computes, 2 defers, 3 computes, and 4,
    the step's last, computes (nothing may stay kept past the optimizer step)."""
    from polyaccel.moe.grouped_linear import defers

    assert [defers(i, 5, 2) for i in range(5)] == [True, False, True, False, False]
    assert [defers(i, 3, 4) for i in range(3)] == [True, True, False]
    assert not any(defers(i, 4, 1) for i in range(4))


def test_overwrite_writes_over_grad_once_per_window_then_adds():
    """A weight used twice in one overwriting window (two backwards, or two uses in one
    graph): the first writes over the stale ``.grad``, the second adds to it."""
    from polyaccel.moe.grouped_linear import wgrad_window

    w = nn.Parameter(torch.randn(5, 6, 4))
    w.grad = torch.full_like(w, 7.0)  # last step's, not zeroed
    ref = nn.Parameter(w.detach().clone())
    (x1, offsets), (x2, _) = _problem(0), _problem(1)
    with wgrad_window(overwrite=[w]) as written:
        grouped_linear(x1, w, offsets).square().sum().backward()
        grouped_linear(x2, w, offsets).sum().backward()
    assert written == {w}
    (ops.grouped_mm(x1, ref, offsets).square().sum() + ops.grouped_mm(x2, ref, offsets).sum()).backward()
    torch.testing.assert_close(w.grad, ref.grad)
