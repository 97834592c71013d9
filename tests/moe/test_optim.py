"""FlatAdamW against torch.optim.AdamW: same steps, same state-dict format, views that stay views."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from polyaccel.moe.optim import FlatAdamW


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.LayerNorm(13), nn.GELU(), nn.Linear(13, 5, bias=False),
                         nn.LayerNorm(5))


def _groups(model: nn.Module) -> list[dict]:
    """Two groups like the trainer's: decayed matrices, undecayed vectors with their own LR."""
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3}]


def _pair(**kw):
    """(torch model, torch AdamW, our model, FlatAdamW) from identical weights."""
    ref = _model()
    ours = copy.deepcopy(ref)
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), **kw}
    return ref, torch.optim.AdamW(_groups(ref), **kw), ours, FlatAdamW(_groups(ours), **kw)


def _backward(model: nn.Module, seed: int) -> None:
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()


def _flat_of(opt: FlatAdamW, p: torch.Tensor):
    return next(f for flats in opt._flats for f in flats if p in f.index)


def _assert_views(opt: FlatAdamW) -> None:
    """Every param's data, grad and moments live in its flat buffers."""
    for flats in opt._flats:
        for flat in flats:
            for p, g in zip(flat.params, flat.grads, strict=True):
                pv, gv, mv, vv = flat.views(p)
                assert p.data_ptr() == pv.data_ptr() and p.untyped_storage().data_ptr() == flat.param.data_ptr()
                assert p.grad is g and g.data_ptr() == gv.data_ptr()
                st = opt.state[p]
                assert st["exp_avg"].data_ptr() == mv.data_ptr() and st["exp_avg_sq"].data_ptr() == vv.data_ptr()


def _assert_same(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, msg=name, **({"rtol": 1e-6, "atol": 1e-7} | tol))


def test_matches_torch_adamw_with_two_groups_and_lambda_lr():
    ref, opt_ref, ours, opt = _pair()
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda s: 0.5 ** s)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for step in range(6):
        for m, o, s in ((ref, opt_ref, sched_ref), (ours, opt, sched)):
            _backward(m, seed=2 * step)
            _backward(m, seed=2 * step + 1)  # two micro-batches accumulate
            o.step()
            s.step()
            o.zero_grad()
        _assert_same(ref, ours)
        _assert_views(opt)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt_ref.param_groups]
    for p in ours.parameters():
        assert int(opt.state[p]["step"]) == 6 and not p.grad.any()


def test_autograd_accumulates_into_the_flat_buffer():
    ref, _, ours, opt = _pair()
    _backward(ref, 0)
    _backward(ref, 1)
    _backward(ours, 0)
    _backward(ours, 1)
    _assert_views(opt)
    for (name, pr), po in zip(ref.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(po.grad, pr.grad, msg=name)
        _, gv, _, _ = _flat_of(opt, po).views(po)
        assert torch.equal(gv, pr.grad.reshape(-1)), name


def test_zero_grad_keeps_views_and_zeroes_only_written_buffers():
    _, _, model, opt = _pair()
    flat = opt._flats[0][0]
    _backward(model, 0)
    opt.zero_grad()  # no step before: the buffer must be zeroed here
    assert not flat.grad.any()
    _assert_views(opt)
    _backward(model, 1)
    opt.step()
    version = flat.grad._version
    opt.zero_grad(set_to_none=True)  # step zeroed the grads already: no second memset
    assert flat.grad._version == version and not flat.grad.any()
    _assert_views(opt)
    _backward(model, 2)  # a backward after the step, then zero_grad: discarded
    opt.zero_grad()
    assert not any(f.grad.any() for fl in opt._flats for f in fl)


def test_param_with_grad_none_is_skipped_like_torch():
    ref, opt_ref, ours, opt = _pair()
    for m in (ref, ours):
        _backward(m, 0)
        m[0].bias.grad = None  # in the undecayed group
        m[3].weight.grad = None  # in the decayed group: weight decay must not touch it either
    before = ours[3].weight.detach().clone()
    opt_ref.step()
    opt.step()
    assert torch.equal(ours[3].weight, before)
    _assert_same(ref, ours)
    _assert_views(opt)
    assert int(opt.state[ours[3].weight]["step"]) == 0 and int(opt.state[ours[0].weight]["step"]) == 1
    # Steps now differ inside a buffer; the next step is still torch's.
    for m, o in ((ref, opt_ref), (ours, opt)):
        o.zero_grad()
        _backward(m, 1)
        o.step()
    _assert_same(ref, ours)


def test_assigned_grads_are_copied_into_the_views():
    ref, opt_ref, ours, opt = _pair()
    for m in (ref, ours):
        _backward(m, 0)
        m[0].weight.grad = m[0].weight.grad * 3  # a new tensor, not the view
    opt_ref.step()
    opt.step()
    _assert_same(ref, ours)
    _assert_views(opt)


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("direction", ["flat_to_torch", "torch_to_flat"])
def test_state_dict_moves_both_ways(direction):
    ref, opt_ref, ours, opt = _pair()
    src_model, src_opt = (ours, opt) if direction == "flat_to_torch" else (ref, opt_ref)
    for s in range(3):
        _backward(src_model, s)
        src_opt.step()
        src_opt.zero_grad()
    # A fresh destination with the source's weights, then the source's optimizer state.
    dst_model = _model(seed=1)
    dst_model.load_state_dict(src_model.state_dict())
    if direction == "flat_to_torch":
        dst_opt = torch.optim.AdamW(_groups(dst_model), lr=0.5)
    else:
        dst_opt = FlatAdamW(_groups(dst_model), lr=0.5)
    dst_opt.load_state_dict(_roundtrip(src_opt.state_dict()))
    assert dst_opt.param_groups[0]["lr"] == 1e-2 and dst_opt.param_groups[1]["lr"] == 3e-3
    if isinstance(dst_opt, FlatAdamW):
        _assert_views(dst_opt)
    for s in range(3, 5):
        for m, o in ((src_model, src_opt), (dst_model, dst_opt)):
            _backward(m, s)
            o.step()
            o.zero_grad()
        _assert_same(src_model, dst_model)
    for pa, pb in zip(src_model.parameters(), dst_model.parameters(), strict=True):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(dst_opt.state[pb][k], src_opt.state[pa][k])
        assert int(dst_opt.state[pb]["step"]) == 5


def test_load_keeps_views_and_resets_missing_state():
    _, _, model, opt = _pair()
    _backward(model, 0)
    opt.step()
    fresh = torch.optim.AdamW(_groups(_model()), lr=1e-3)  # no state yet
    opt.load_state_dict(fresh.state_dict())
    _assert_views(opt)
    assert opt.param_groups[0]["lr"] == 1e-3
    for p in model.parameters():
        st = opt.state[p]
        assert int(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()


def test_refuses_what_it_cannot_do():
    model = _model()
    with pytest.raises(ValueError, match="does not implement"):
        FlatAdamW(model.parameters()).load_state_dict(
            torch.optim.AdamW(_model().parameters(), amsgrad=True).state_dict())
    frozen = _model()
    frozen[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="require grad"):
        FlatAdamW(frozen.parameters())
    w = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="twice"), pytest.warns(UserWarning, match="duplicate"):
        FlatAdamW([w, w])


def test_dtensor_params_are_refused():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        p = nn.Parameter(distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (2,)), [Shard(0)]))
        with pytest.raises(ValueError, match="torch.optim.AdamW"):
            FlatAdamW([p])
    finally:
        dist.destroy_process_group()


def test_mixed_dtypes_get_one_buffer_each_and_bf16_tracks_torch():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    ref[1].to(torch.bfloat16)
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = FlatAdamW(ours.parameters(), lr=1e-2)
    assert sorted(str(f.param.dtype) for f in opt._flats[0]) == ["torch.bfloat16", "torch.float32"]
    for s in range(3):
        for m, o in ((ref, opt_ref), (ours, opt)):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
            m[1](m[0](x).bfloat16()).float().square().mean().backward()
            o.step()
            o.zero_grad()
        if s == 0:  # same grads: fp32 params exactly torch's
            torch.testing.assert_close(ours[0].weight, ref[0].weight, rtol=1e-6, atol=1e-7)
        # bf16 within about a bf16 ulp (torch rounds after each op, we once); that feeds the rest
        _assert_same(ref, ours, rtol=2e-2, atol=2e-3)
    _assert_views(opt)


def test_grads_overwritten_are_left_and_the_rest_zeroed():
    """Params named in ``grads_overwritten`` step as usual but keep their grads (the caller
    writes over them); the others are zeroed; the state dict keeps torch's param order."""
    ref, opt_ref, ours, _ = _pair()
    first = next(ours.parameters())
    opt = FlatAdamW(_groups(ours), lr=1e-2, betas=(0.9, 0.99), grads_overwritten=[first])
    for step in range(3):
        for m in (ref, ours):
            _backward(m, seed=step)
        kept = first.grad.clone()
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
        _assert_same(ref, ours)
        assert torch.equal(first.grad, kept)
        assert all(not p.grad.any() for p in ours.parameters() if p is not first)
        first.grad.zero_()  # what the caller's next write does
    _assert_views(opt)
    ids = [i for g in opt.state_dict()["param_groups"] for i in g["params"]]
    assert ids == sorted(ids)


def test_grad_scale_is_clipping_inside_the_step():
    """``step(grad_scale=coef)`` == torch's clip_grad_norm_ then AdamW (fp32); step_scaled does
    the same for a torch optimizer with one foreach multiply; no clipping leaves grads as they are."""
    from polyaccel.moe.optim import clip_coefficient, step_scaled

    ref, ref_opt, ours, opt = _pair()
    torch_ref, torch_opt = copy.deepcopy(ref), None
    torch_opt = torch.optim.AdamW(_groups(torch_ref), lr=1e-2, betas=(0.9, 0.99))
    for seed in range(3):
        for m in (ref, ours, torch_ref):
            _backward(m, seed)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])
        coef = clip_coefficient(norm, 0.05)
        assert coef is not None and 0 < float(coef) < 1  # this test really clips
        step_scaled(opt, coef)
        opt.zero_grad()
        step_scaled(torch_opt, clip_coefficient(
            torch.nn.utils.get_total_norm([p.grad for p in torch_ref.parameters()]), 0.05))
        torch_opt.zero_grad()
    for a, b, c in zip(ref.parameters(), ours.parameters(), torch_ref.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)
    assert clip_coefficient(torch.tensor(3.0), None) is None and clip_coefficient(torch.tensor(3.0), 0) is None
    assert float(clip_coefficient(torch.tensor(0.5), 1.0)) == 1.0  # never scales up


def test_scale_next_step_applies_to_one_step_only():
    """``scale_next_step(coef)`` (the Trainer's clipping hook) scales the gradients of the next
    ``step()`` and no later one: the step after it is plain AdamW again."""
    ref, opt_ref, ours, opt = _pair()
    coef = torch.tensor(0.25)
    for seed in range(3):
        for m in (ref, ours):
            _backward(m, seed)
        if seed == 0:
            for p in ref.parameters():
                p.grad.mul_(coef)
            opt.scale_next_step(coef)
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
        _assert_same(ref, ours)


def test_grad_norm_reads_the_flat_buffers_and_falls_back_when_they_do_not_hold_the_grads():
    """``grad_norm(model, FlatAdamW)`` (one pass per flat buffer: two dtypes here, params with
    alignment gaps between them) == the exact norm, in fp32 (torch's per-tensor norm of bf16
    grads is bf16); a grad set to None or replaced since the backward, or a param with a grad
    that the optimizer does not hold, takes torch's norm of what ``.grad`` says."""
    from polyaccel.moe.optim import grad_norm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.Linear(33, 8))
    model[1].to(torch.bfloat16)
    opt = FlatAdamW(model.parameters(), lr=1e-2)
    assert len(opt._flats[0]) == 2

    def exact():
        return torch.stack([p.grad.double().square().sum() for p in model.parameters() if p.grad is not None]
                           ).sum().sqrt().float()

    for seed in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
        model[1](model[0](x).bfloat16()).float().square().mean().backward()
        got = grad_norm(model, opt)
        assert got.dtype == torch.float32 and float(got) > 0
        torch.testing.assert_close(got, exact(), rtol=1e-6, atol=0)
        opt.step()
        opt.zero_grad()
    x = torch.randn(4, 16)
    model[1](model[0](x).bfloat16()).float().square().mean().backward()
    model[0].bias.grad = None  # the flat view still holds its gradient; .grad says there is none
    assert opt.grad_norm() is None
    torch.testing.assert_close(grad_norm(model, opt).float(), exact(), rtol=1e-2, atol=0)
    model[0].bias.grad = torch.full_like(model[0].bias, 3.0)  # replaced: not the flat view
    torch.testing.assert_close(grad_norm(model, opt).float(), exact(), rtol=1e-2, atol=0)
    opt.zero_grad()
    extra = nn.Linear(2, 2)  # a param with a gradient the optimizer does not hold
    model.append(extra)
    extra(torch.randn(1, 2)).sum().backward()
    torch.testing.assert_close(grad_norm(model, opt).float(), exact(), rtol=1e-2, atol=0)
    assert float(grad_norm(model, opt)) > 0


def test_grad_norm_of_fp64_params_and_of_an_optimizer_holding_more_than_the_model():
    """fp64 gradients are measured in fp64 (not refused for narrowing); an optimizer that also
    holds a param outside the model (with a gradient) does not count it: torch's norm of the
    model's own gradients is taken instead."""
    from polyaccel.moe.optim import grad_norm

    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    extra = nn.Parameter(torch.randn(16))
    opt = FlatAdamW([*model.parameters(), extra], lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.float64)).square().sum().backward()
    extra.grad.copy_(torch.full_like(extra, 10.0))  # large: counting it would show
    exact = torch.stack([p.grad.square().sum() for p in model.parameters()]).sum().sqrt()
    torch.testing.assert_close(grad_norm(model, opt).double(), exact, rtol=1e-6, atol=0)
    whole = nn.Linear(8, 4).double()
    opt2 = FlatAdamW(whole.parameters(), lr=1e-2)
    whole(torch.randn(3, 8, dtype=torch.float64)).square().sum().backward()
    exact2 = torch.stack([p.grad.square().sum() for p in whole.parameters()]).sum().sqrt()
    assert opt2.grad_norm() is not None  # the flat path itself, in fp64
    torch.testing.assert_close(grad_norm(whole, opt2).double(), exact2, rtol=1e-6, atol=0)
