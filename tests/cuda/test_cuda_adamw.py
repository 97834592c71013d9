"""The cuda backend's ``adamw_step_`` (one Triton pass over a flat buffer) against core's reference.

Unmarked tests run the op's torch-math path and ``opcheck`` on the CPU; ``gpu`` tests run the
Triton kernel on fresh random tensors: ``pytest -m gpu tests/cuda`` on an NVIDIA GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from polyaccel.core import ops
from polyaccel.cuda import adamw, kernels
from polyaccel.cuda._triton import has_triton

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(n, dtype, device="cpu", seed=0):
    """(param, grad, exp_avg, exp_avg_sq) with plausible values (v >= 0)."""
    g = torch.Generator(device).manual_seed(seed)
    r = [torch.randn(n, generator=g, device=device) for _ in range(4)]
    return (0.3 * r[0]).to(dtype), r[1].to(dtype), (0.1 * r[2]).to(dtype), (0.01 * r[3].square()).to(dtype)


def _run(fn, tensors, steps, start=1, zero_grad=True):
    p, g, m, v = tensors
    for step in range(start, start + steps):
        g.copy_(torch.randn_like(g, dtype=torch.float32).mul_(step).to(g.dtype))
        g_used = g.clone()
        fn(p, g, m, v, **HYPER, step=step, zero_grad=zero_grad)
        if zero_grad:
            assert not g.any()
        else:
            assert torch.equal(g, g_used)
    return p, m, v


def test_register_all_registers_adamw_for_cuda():
    seen = {}

    class Recorder:
        def register(self, op, device_type, fn, *, impl, backend=""):
            seen[op] = (device_type, impl, fn)

    kernels.register_all(Recorder())
    if has_triton():
        assert seen["adamw_step_"] == ("cuda", "triton", adamw.adamw_step_)


def _torch_adamw(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, zero_grad):
    """One ``torch.optim.AdamW`` step (its single-tensor loop, an implementation independent of
    ours) in fp32 from the stored state, stored back in each tensor's dtype, like the op."""
    param = torch.nn.Parameter(p.float())
    param.grad = g.float()
    opt = torch.optim.AdamW([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay,
                            foreach=False, fused=False)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
    opt.step()
    for out, val in ((p, param.detach()), (m, opt.state[param]["exp_avg"]), (v, opt.state[param]["exp_avg_sq"])):
        out.copy_(val)
    if zero_grad:
        g.zero_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_math_path_equals_torch_adamw(dtype):
    """The op's CPU path (no Triton: core's reference) equals torch.optim.AdamW, bit for bit,
    over three steps from a non-zero state; the steps move every tensor (so equality is not
    two untouched copies agreeing)."""
    a, b = _state(1001, dtype), _state(1001, dtype)
    start = [t.clone() for t in a]
    torch.manual_seed(0)
    out_a = _run(adamw.adamw_step_, a, steps=3)
    torch.manual_seed(0)
    out_b = _run(_torch_adamw, b, steps=3)
    for x, y in zip(out_a, out_b, strict=True):
        assert torch.equal(x, y)
    for x, x0 in zip(out_a, start[::2] + start[3:], strict=True):  # param, exp_avg, exp_avg_sq
        assert (x != x0).float().mean() > 0.5


def test_opcheck_cpu():
    p, g, m, v = _state(257, torch.float32)
    args = (p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3, True)
    torch.library.opcheck(torch.ops.polyaccel_cuda.adamw_step_, args)
    torch.library.opcheck(torch.ops.polyaccel_cuda.adamw_step_, (*args, torch.tensor(0.5)))


# ---------------------------------------------------------------------------------------
# GPU: the Triton kernel
# ---------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("zero_grad", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_adamw_matches_reference(dtype, zero_grad):
    """Odd length (a masked tail), three steps from a non-zero state, fresh random inputs."""
    n, seed = 1_000_003, int(torch.seed() % 2**31)
    fast, ref = _state(n, dtype, "cuda", seed), _state(n, dtype, "cuda", seed)
    torch.manual_seed(seed)
    out_fast = _run(adamw.adamw_step_, fast, steps=3, start=4, zero_grad=zero_grad)
    torch.manual_seed(seed)
    out_ref = _run(ops.adamw_step_.reference, ref, steps=3, start=4, zero_grad=zero_grad)
    for name, x, y in zip(("param", "exp_avg", "exp_avg_sq"), out_fast, out_ref, strict=True):
        # Same fp32 math up to FMA contraction (an fp32 ulp); in bf16 that moves the rounding
        # of a few elements by one bf16 ulp, which the next steps carry along.
        err = ((x.double() - y.double()).norm() / y.double().norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 2e-3), (name, err)
        if dtype == torch.bfloat16:
            assert (x != y).float().mean() < 1e-2, name


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_zero_second_moments_match_reference(dtype):
    """Params no gradient has reached (zero second moment: the kernel takes eps as the
    denominator, off IEEE sqrt's slow path): never fed (m = 0), and fed before (m != 0)."""
    n, seed = 1_000_003, int(torch.seed() % 2**31)
    fast, ref = _state(n, dtype, "cuda", seed), _state(n, dtype, "cuda", seed)
    for _, g, m, v in (fast, ref):
        g[: n // 2], m[: n // 4], v[: n // 2] = 0, 0, 0
    adamw.adamw_step_(*fast, **HYPER, step=3, zero_grad=True)
    ops.adamw_step_.reference(*ref, **HYPER, step=3, zero_grad=True)
    assert torch.equal(fast[0][: n // 4], ref[0][: n // 4]) and not fast[3][: n // 2].any()
    for i, name in ((0, "param"), (2, "exp_avg"), (3, "exp_avg_sq")):
        x, y = fast[i].double(), ref[i].double()
        assert x.isfinite().all(), name
        assert ((x - y).norm() / y.norm()).item() < (1e-6 if dtype == torch.float32 else 2e-3), name


def test_grad_scale_is_the_step_on_scaled_grads():
    """``grad_scale`` (clipping's coefficient, a device tensor) == the step on pre-scaled grads;
    the grads themselves are not scaled in place."""
    for zero_grad in (True, False):
        a, b = _state(1001, torch.float32), _state(1001, torch.float32)
        g_before = a[1].clone()
        adamw.adamw_step_(*a, **HYPER, step=2, zero_grad=zero_grad, grad_scale=torch.tensor(0.25))
        b[1].mul_(0.25)
        ops.adamw_step_.reference(*b, **HYPER, step=2, zero_grad=zero_grad)
        for x, y in zip(a[::2] + a[3:], b[::2] + b[3:], strict=True):
            assert torch.equal(x, y)
        assert not a[1].any() if zero_grad else torch.equal(a[1], g_before)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_grad_scale_matches_reference(dtype):
    n, seed = 1_000_003, int(torch.seed() % 2**31)
    fast, ref = _state(n, dtype, "cuda", seed), _state(n, dtype, "cuda", seed)
    scale = torch.tensor(0.37, device="cuda")
    adamw.adamw_step_(*fast, **HYPER, step=3, zero_grad=True, grad_scale=scale)
    ops.adamw_step_.reference(*ref, **HYPER, step=3, zero_grad=True, grad_scale=scale)
    for x, y in zip(fast[::2] + fast[3:], ref[::2] + ref[3:], strict=True):
        err = ((x.double() - y.double()).norm() / y.double().norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 2e-3), err
    assert not fast[1].any()


@gpu
@needs_cuda
def test_gpu_unaligned_views_and_fallbacks():
    """Slices starting at odd offsets (FlatAdamW's per-param path) and a non-contiguous input."""
    p, g, m, v = _state(10_001, torch.bfloat16, "cuda")
    pr, gr, mr, vr = (t.clone() for t in (p, g, m, v))
    sl = slice(3, 9_000)
    adamw.adamw_step_(p[sl], g[sl], m[sl], v[sl], **HYPER, step=2, zero_grad=True)
    ops.adamw_step_.reference(pr[sl], gr[sl], mr[sl], vr[sl], **HYPER, step=2, zero_grad=True)
    for x, y in ((p, pr), (g, gr), (m, mr), (v, vr)):
        torch.testing.assert_close(x, y, rtol=8e-3, atol=1e-6)
        assert torch.equal(x[:3], y[:3]) and torch.equal(x[9_000:], y[9_000:])  # untouched outside
    q = torch.randn(64, 64, device="cuda").t()  # not contiguous: the reference runs
    args = [q] + [torch.randn(64, 64, device="cuda").abs() for _ in range(3)]
    adamw.adamw_step_(*args, **HYPER, step=1, zero_grad=False)


@gpu
@needs_cuda
def test_gpu_flat_adamw_matches_fused_torch_adamw_without_host_sync():
    from polyaccel.core import select_backend
    from polyaccel.moe.optim import FlatAdamW

    select_backend("cuda")  # registers the Triton kernel for ops.adamw_step_
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(96, 333), torch.nn.LayerNorm(333), torch.nn.Linear(333, 7)).cuda()
    ours = copy.deepcopy(ref)

    def groups(m):
        ps = list(m.parameters())
        return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]

    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-2, fused=True)
    opt = FlatAdamW(groups(ours), lr=1e-2)
    for step in range(4):
        x = torch.randn(32, 96, device="cuda")
        for m, o in ((ref, opt_ref), (ours, opt)):
            m(x).square().mean().backward()
            if step == 3 and o is opt:
                torch.cuda.set_sync_debug_mode("error")
            try:
                o.step()
                o.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)  # torch's fused kernel orders the math its way
        assert not b.grad.any()
