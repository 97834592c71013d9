"""``FlatAdamW(defer_to=model)``: the step applied by the model's next forward, module by
module, gives the same losses, weights and optimizer state as the step applied at once;
pending steps are applied wherever the weights are read (state dicts, a second step).

On the CPU the parts run in line. PyTorch's CPU kernels may round the last elements of a
shorter launch differently, and AdamW magnifies that where gradients are small: equal within
1e-4 relative here, not bit for bit (on CUDA each element's math is the same in any launch).
The side stream, events and graph capture of the CUDA path run in the GPU tests
(``tests/moe/test_deferred_step_cuda.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig, GraphedMicroStep
from polyaccel.moe.deferred_step import forward_order, pending_step
from polyaccel.moe.optim import FlatAdamW, clip_coefficient
from polyaccel.moe.presets import tiny


def _model(model_type: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny(model_type), backend=BackendConfig(backend="cpu")).train()


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def each_model(request):
    return _model(request.param)


@pytest.fixture(scope="module")
def model():
    return _model("qwen3_moe")


def _pair(model, **kw):
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    groups = lambda m: [{"params": [p for p in m.parameters() if p.ndim >= 2], "weight_decay": 0.1},  # noqa: E731
                        {"params": [p for p in m.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    return a, FlatAdamW(groups(a), lr=1e-2, **kw), b, FlatAdamW(groups(b), lr=1e-2, defer_to=b, **kw)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(seed))


def _train(model, opt, steps: int = 4, accum: int = 2, clip: float | None = 0.5, embeds: bool = False):
    losses = []
    for s in range(steps):
        for m in range(accum):
            ids = _ids(10 * s + m)
            if embeds:  # the embedding module is not called: the first layer's hook applies the step
                loss = model(inputs_embeds=model.get_input_embeddings()(ids), labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        scale = clip_coefficient(opt.grad_norm(), clip)
        opt.step(grad_scale=scale)
        opt.zero_grad()
        for g in opt.param_groups:  # a schedule: every step its own learning rate
            g["lr"] *= 0.7
    return losses


def _same_weights_and_state(a, opt_a, b, opt_b) -> None:
    sa, sb = opt_a.state_dict(), opt_b.state_dict()  # (this applies a pending step)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        _close(pb, pa, name)
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k in st:
            _close(sb["state"][i][k], st[k], f"state {i} {k}")


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("embeds", [False, True])
def test_deferred_step_equals_the_step_at_once(each_model, embeds):
    a, opt_a, b, opt_b = _pair(each_model)
    la, lb = _train(a, opt_a, embeds=embeds), _train(b, opt_b, embeds=embeds)
    torch.testing.assert_close(torch.stack(lb), torch.stack(la), rtol=1e-5, atol=0)
    assert pending_step(b) is not None  # the last step waits for a forward...
    assert max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True)) > 1e-4
    _same_weights_and_state(a, opt_a, b, opt_b)  # ...or for a state dict: applied now
    assert pending_step(b) is None


def test_a_model_state_dict_applies_the_pending_step(model):
    a, opt_a, b, opt_b = _pair(model)
    _train(a, opt_a, steps=2), _train(b, opt_b, steps=2)
    sa, sb = a.state_dict(), b.state_dict()  # what save_pretrained writes
    for k in sa:
        _close(sb[k], sa[k], k)


def test_two_steps_without_a_forward_between_apply_both(model):
    a, opt_a, b, opt_b = _pair(model)
    for m, opt in ((a, opt_a), (b, opt_b)):
        m(input_ids=_ids(1), labels=_ids(1)).loss.backward()
        opt.step()
        m(input_ids=_ids(2), labels=_ids(2)).loss.backward()  # applies b's pending step first
        opt.step()
        opt.step()  # no forward, no new gradient: a second step on zeros, as FlatAdamW does
    _same_weights_and_state(a, opt_a, b, opt_b)


def test_graphed_micro_step_off_cuda_runs_the_deferred_step_eagerly(model):
    a, opt_a, b, opt_b = _pair(model)
    for m, opt in ((a, opt_a), (b, opt_b)):
        step = GraphedMicroStep(m, grad_accum=2)
        for s in range(3):
            for i in range(2):
                step(input_ids=_ids(s * 2 + i), labels=_ids(s * 2 + i))
            opt.step()
            opt.zero_grad()
    _same_weights_and_state(a, opt_a, b, opt_b)


def test_a_param_without_grad_makes_the_step_run_at_once(model):
    a, opt_a, b, opt_b = _pair(model)
    for m, opt in ((a, opt_a), (b, opt_b)):
        m(input_ids=_ids(1), labels=_ids(1)).loss.backward()
        next(m.parameters()).grad = None  # torch AdamW skips it; the deferred path cannot
        opt.step()
    assert pending_step(b) is None
    _same_weights_and_state(a, opt_a, b, opt_b)


def test_forward_order_refuses_a_model_without_the_layout():
    with pytest.raises(ValueError, match="embed_tokens"):
        forward_order(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="embed_tokens"):
        FlatAdamW(torch.nn.Linear(3, 3).parameters(), defer_to=torch.nn.Linear(3, 3))


def test_a_hooked_expert_weight_keeps_its_gradient_for_the_deferred_step(model):
    """An expert weight with a gradient hook is zeroed by the micro-step at a step's start (it
    cannot be written over); a step deferred to that forward must have read it first."""
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opts = []
    for m, defer in ((a, False), (b, True)):
        step = GraphedMicroStep(m, grad_accum=2)
        step.overwritten_params[0].register_post_accumulate_grad_hook(lambda p: None)
        opt = FlatAdamW(m.parameters(), lr=1e-2, grads_overwritten=step.overwritten_params,
                        defer_to=m if defer else None)
        opts.append(opt)
        for s in range(3):
            for i in range(2):
                step(input_ids=_ids(s * 2 + i), labels=_ids(s * 2 + i))
            opt.step()
            opt.zero_grad()
    _same_weights_and_state(a, opts[0], b, opts[1])


def test_zeroing_every_grad_and_a_new_group_apply_the_pending_step_first(model):
    from polyaccel.moe.graphed_step import overwritten_params

    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a = FlatAdamW(a.parameters(), lr=1e-2, grads_overwritten=overwritten_params(a))
    opt_b = FlatAdamW(b.parameters(), lr=1e-2, grads_overwritten=overwritten_params(b), defer_to=b)
    for m, opt in ((a, opt_a), (b, opt_b)):
        m(input_ids=_ids(1), labels=_ids(1)).loss.backward()
        opt.step()
        opt.zero_every_grad()  # (the Trainer's call when the graphed micro-step does not run)
        m(input_ids=_ids(2), labels=_ids(2)).loss.backward()
        opt.step()
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    _same_weights_and_state(a, opt_a, b, opt_b)
