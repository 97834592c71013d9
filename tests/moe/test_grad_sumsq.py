"""The expert gradients' sums of squares recorded where the weight-gradient kernel stores them
(``GraphedMicroStep.expert_grad_sumsq``), and the clipping norm that takes them instead of
reading those gradients again (``FlatAdamW.grad_norm(known_sumsq=...)``). On the CPU the
micro-step runs eagerly through the same code and core's reference kernel."""

from __future__ import annotations

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.graphed_step import GraphedMicroStep
from polyaccel.moe.optim import FlatAdamW, grad_norm
from polyaccel.moe.presets import tiny


def _setup(arch: str, window: int):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny(arch), backend=BackendConfig(backend="cpu")).train()
    step = GraphedMicroStep(model, grad_accum=4, wgrad_window=window)
    opt = FlatAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, grads_overwritten=step.overwritten_params)
    return model, step, opt


@pytest.mark.parametrize(("arch", "window"), [("qwen3_moe", 4), ("deepseek_v3", 1)])
def test_records_are_the_expert_gradients_sums_of_squares_and_the_norm_matches(arch, window):
    model, step, opt = _setup(arch, window)
    batches = torch.randint(3, 97, (2, 4, 2, 12), generator=torch.Generator().manual_seed(1))
    for batch in batches:
        for i, ids in enumerate(batch):
            step(input_ids=ids, labels=ids)
            assert (step.expert_grad_sumsq() is None) == (i < 3)  # mid-step: not complete
        known = step.expert_grad_sumsq()
        assert known is not None and set(known) == set(step.overwritten_params)
        for p, sq in known.items():
            torch.testing.assert_close(sq, p.grad.float().square().sum(), rtol=1e-5, atol=1e-7)
        full, fused = grad_norm(model, opt), grad_norm(model, opt, known)
        torch.testing.assert_close(fused, full, rtol=1e-5, atol=0)
        opt.step()
        opt.zero_grad()


def test_the_norm_reads_only_the_gradients_it_has_no_sum_for(monkeypatch):
    model, step, opt = _setup("qwen3_moe", 4)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        step(input_ids=ids, labels=ids)
    read = []
    real = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, *a, **k: read.append(t.numel()) or real(t, *a, **k))
    opt.grad_norm()
    everything = sum(read)
    read.clear()
    opt.grad_norm(step.expert_grad_sumsq())
    experts = sum(p.numel() for p in step.overwritten_params)
    assert 0 < sum(read) <= everything - experts


def test_a_stale_record_is_zeroed_with_its_gradient():
    """A layer whose experts get no gradient in a step (its output unused) has its gradient
    zeroed by the micro-step; its record must say zero too, not last step's sum."""
    model, step, opt = _setup("qwen3_moe", 2)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    for _ in range(4):
        step(input_ids=ids, labels=ids)
    experts = model.model.layers[-1].mlp.experts
    weight = next(p for p in experts.parameters() if p in step.expert_grad_sumsq())
    assert step.expert_grad_sumsq()[weight] > 0
    opt.step()
    opt.zero_grad()
    experts.forward = lambda x, *a, **k: x * 0  # the weights are not used: no gradient reaches them
    for _ in range(4):
        step(input_ids=ids, labels=ids)
    known = step.expert_grad_sumsq()
    assert not weight.grad.any() and known[weight] == 0
    torch.testing.assert_close(grad_norm(model, opt, known), grad_norm(model, opt), rtol=1e-5, atol=0)


def test_no_records_when_an_expert_gradient_comes_from_autograd():
    model, step, _ = _setup("qwen3_moe", 1)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    weight = step.overwritten_params[0]
    weight.register_hook(lambda g: g)  # a hooked weight is no longer fused: autograd adds its gradient
    for _ in range(4):
        step(input_ids=ids, labels=ids)
    assert step.expert_grad_sumsq() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("window", [1, 4])
def test_gpu_replayed_graphs_write_the_records(window):
    """On CUDA the records are written by the replayed graphs (Triton's epilogue sums): after
    graphed steps each equals its gradient's sum of squares, and the clipping norm equals
    the one read from the buffers."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cuda"))
    model = model.to("cuda", torch.bfloat16).train()
    step = GraphedMicroStep(model, warmup=1, grad_accum=4, wgrad_window=window)
    opt = FlatAdamW(model.parameters(), lr=1e-3, grads_overwritten=step.overwritten_params)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        for _ in range(4):
            ids = torch.randint(3, 97, (2, 32), device="cuda", generator=gen)
            step(input_ids=ids, labels=ids)
        known = step.expert_grad_sumsq()
        assert known
        for p, sq in known.items():
            torch.testing.assert_close(sq, p.grad.float().square().sum(), rtol=1e-4, atol=0)
        torch.testing.assert_close(grad_norm(model, opt, known), grad_norm(model, opt), rtol=1e-4, atol=0)
        opt.step()
        opt.zero_grad()
    assert all(k.graph is not None for k in step.kinds.values())
