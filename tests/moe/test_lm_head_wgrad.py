"""``POLYACCEL_LM_HEAD_WGRAD=backward`` on whole models: a plain loop with the two-line change
(FlatAdamW, GraphedMicroStep) trains to the same weights as the default path, with tied and
untied LM heads (a tied one also takes the embedding's rows into the same ``.grad``)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig, layers
from polyaccel.moe.graphed_step import GraphedMicroStep
from polyaccel.moe.optim import FlatAdamW
from polyaccel.moe.presets import tiny


def _train(arch: str, tied: bool, mode: str, monkeypatch) -> dict[str, torch.Tensor]:
    monkeypatch.setattr(layers, "LM_HEAD_WGRAD", mode)
    torch.manual_seed(0)
    config = tiny(arch)
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config, backend=BackendConfig(backend="cpu")).train()
    step = GraphedMicroStep(model, grad_accum=2)
    opt = FlatAdamW(model.parameters(), lr=1e-2, grads_overwritten=step.overwritten_params)
    batches = torch.randint(3, 97, (3, 2, 2, 12), generator=torch.Generator().manual_seed(1))
    for batch in batches:
        for ids in batch:
            step(input_ids=ids, labels=ids)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("arch", "tied"), [("qwen3_moe", False), ("olmoe", True)])
def test_weights_after_training_equal_the_default_paths(arch, tied, monkeypatch):
    calls = []
    from polyaccel.core import ops

    logit_grads = ops.linear_cross_entropy_logit_grads
    monkeypatch.setattr(ops, "linear_cross_entropy_logit_grads", lambda *a: calls.append(1) or logit_grads(*a))
    want = _train(arch, tied, "forward", monkeypatch)
    assert not calls
    got = _train(arch, tied, "backward", monkeypatch)
    assert len(calls) == 6  # every micro-batch took the deferred weight gradient
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert not torch.equal(got["lm_head.weight"], _initial(arch, tied)["lm_head.weight"])


def _initial(arch: str, tied: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    config = tiny(arch)
    config.tie_word_embeddings = tied
    return AutoModelForCausalLM.from_config(config, backend=BackendConfig(backend="cpu")).state_dict()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_replayed_graphs_add_the_lm_head_gradient_into_grad(monkeypatch):
    """On CUDA in bf16, micro-batches replayed as CUDA graphs: after each step's micro-batches
    the LM head's gradient from the deferred GEMM equals the default path's (same model, same
    batches) within bf16 rounding, and an upstream scale of 0 would not pass (the gradient is
    far from zero)."""
    grads = {}
    for mode in ("forward", "backward"):
        monkeypatch.setattr(layers, "LM_HEAD_WGRAD", mode)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cuda"))
        model = model.to("cuda", torch.bfloat16).train()
        step = GraphedMicroStep(model, warmup=1, grad_accum=2)
        opt = FlatAdamW(model.parameters(), lr=0.0, grads_overwritten=step.overwritten_params)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):
            opt.zero_grad()
            for _ in range(2):
                ids = torch.randint(3, 97, (2, 64), device="cuda", generator=gen)
                step(input_ids=ids, labels=ids)
            grads.setdefault(mode, []).append(model.lm_head.weight.grad.float().clone())
            opt.step()
        assert all(k.graph is not None for k in step.kinds.values())
    for want, got in zip(grads["forward"], grads["backward"], strict=True):
        assert want.norm() > 0 and ((got - want).norm() / want.norm()).item() < 1e-2
