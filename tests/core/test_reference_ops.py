"""Every reference op against a straightforward formula on fresh random inputs."""

import math

import numpy as np
import pytest
import torch

from polyaccel.core import ops

TOL = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def gen():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs on every run
    return g


def rnd(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(gen, dtype):
    x, w = rnd(gen, 3, 7, 64, dtype=dtype), rnd(gen, 64, dtype=dtype)
    xd = x.double()
    expected = xd / torch.sqrt((xd**2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(ops.rms_norm(x, w, 1e-6), expected) < TOL[dtype]


def test_layer_norm(gen):
    x, w, b = rnd(gen, 5, 32), rnd(gen, 32), rnd(gen, 32)
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    assert rel_err(ops.layer_norm(x, w, b, 1e-5), (x - mu) / torch.sqrt(var + 1e-5) * w + b) < 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
def test_ffn(gen, act):
    x, w1, b1, w2, b2 = rnd(gen, 2, 5, 16), rnd(gen, 48, 16), rnd(gen, 48), rnd(gen, 16, 48), rnd(gen, 16)
    h = x @ w1.T + b1
    h = {"silu": h * torch.sigmoid(h), "relu": h.clamp_min(0),
         "gelu": 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))}[act]
    assert rel_err(ops.ffn(x, w1, b1, w2, b2, act), h @ w2.T + b2) < 1e-5


def test_unknown_activation():
    with pytest.raises(ValueError, match="unknown activation"):
        ops.ffn(torch.zeros(1, 2), torch.zeros(3, 2), None, torch.zeros(2, 3), None, "tanhh")


def test_swiglu(gen):
    gu = rnd(gen, 4, 2 * 24)
    g, u = gu[:, :24], gu[:, 24:]
    assert rel_err(ops.swiglu(gu), g * torch.sigmoid(g) * u) < 1e-6


def test_fused_qkv_gqa(gen):
    B, T, H, NH, NKV, D = 2, 5, 32, 4, 2, 8
    x, w, b = rnd(gen, B, T, H), rnd(gen, (NH + 2 * NKV) * D, H), rnd(gen, (NH + 2 * NKV) * D)
    q, k, v = ops.fused_qkv(x, w, b, NH, NKV)
    assert q.shape == (B, NH, T, D) and k.shape == v.shape == (B, NKV, T, D)
    wq, wk, wv = w[: NH * D], w[NH * D: (NH + NKV) * D], w[(NH + NKV) * D:]
    bq, bk, bv = b[: NH * D], b[NH * D: (NH + NKV) * D], b[(NH + NKV) * D:]
    # head h of q is columns h*D:(h+1)*D of x @ wq.T
    for h in range(NH):
        assert rel_err(q[:, h], x @ wq[h * D:(h + 1) * D].T + bq[h * D:(h + 1) * D]) < 1e-6
    assert rel_err(k[:, 1], x @ wk[D:].T + bk[D:]) < 1e-6
    assert rel_err(v[:, 0], x @ wv[:D].T + bv[:D]) < 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_attention_against_loops(gen, causal):
    B, NH, NKV, Tq, Tk, D = 2, 4, 2, 3, 6, 8
    q, k, v = rnd(gen, B, NH, Tq, D), rnd(gen, B, NKV, Tk, D), rnd(gen, B, NKV, Tk, D)
    mask = torch.rand(B, 1, 1, Tk, generator=gen) > 0.3
    mask[..., -1] = True  # never mask every key
    out = ops.attention(q, k, v, mask=mask, causal=causal)
    expected = torch.zeros_like(out, dtype=torch.float64)
    for b in range(B):
        for h in range(NH):
            kv = h // (NH // NKV)
            for i in range(Tq):
                s = [(q[b, h, i].double() @ k[b, kv, j].double()).item() / math.sqrt(D) for j in range(Tk)]
                ok = [bool(mask[b, 0, 0, j]) and (not causal or j <= i + Tk - Tq) for j in range(Tk)]
                s = np.array([si if o else -np.inf for si, o in zip(s, ok)])
                p = np.exp(s - s.max()) if np.isfinite(s).any() else np.zeros_like(s)
                p = p / p.sum() if p.sum() > 0 else p
                expected[b, h, i] = torch.from_numpy(p) @ v[b, kv].double()
    assert rel_err(out, expected) < 1e-5


def test_attention_matches_sdpa(gen):
    q, k, v = rnd(gen, 2, 4, 9, 16), rnd(gen, 2, 4, 9, 16), rnd(gen, 2, 4, 9, 16)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(ops.attention(q, k, v, causal=True), ref) < 1e-5


def test_decode_attention_is_one_query_attention(gen):
    q, k, v = rnd(gen, 3, 2, 1, 8), rnd(gen, 3, 2, 7, 8), rnd(gen, 3, 2, 7, 8)
    mask = (torch.arange(7) <= torch.tensor([0, 3, 6])[:, None])[:, None, None, :]
    expected = ops.attention(q, k, v, mask=mask)
    assert ops.decode_attention(q, k, v, mask).shape == (3, 2, 1, 8)
    assert rel_err(ops.decode_attention(q, k, v, mask), expected) < 1e-5
    assert rel_err(ops.decode_attention(q, k, v), ops.attention(q, k, v)) < 1e-5
    # a padding row (every key masked) gives zeros, as the CUDA kernel does, not NaN
    mask[1] = False
    out = ops.decode_attention(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and rel_err(out[0], expected[0]) < 1e-5


def test_depthwise_conv1d(gen):
    B, C, T, K = 2, 6, 11, 5
    x, w, b = rnd(gen, B, C, T), rnd(gen, C, K), rnd(gen, C)
    out = ops.depthwise_conv1d(x, w, b)
    xp = torch.nn.functional.pad(x, (K // 2, K // 2))
    expected = torch.stack([sum(xp[:, :, t + j] * w[:, j] for j in range(K)) + b for t in range(T)], -1)
    assert out.shape == (B, C, T)
    assert rel_err(out, expected) < 1e-5


def test_conv2d_subsample_x8_shapes_and_values(gen):
    x = rnd(gen, 2, 1, 37, 80)
    ws = [rnd(gen, 4, 1, 3, 3), rnd(gen, 4, 4, 3, 3), rnd(gen, 4, 4, 3, 3)]
    bs = [rnd(gen, 4), rnd(gen, 4), rnd(gen, 4)]
    out = ops.conv2d_subsample(x, ws, bs)
    assert out.shape == (2, 4, 5, 10)  # ceil(37/8)=5, 80/8=10
    # first layer, one output element by hand
    y = x[0, 0]
    yp = torch.nn.functional.pad(y, (1, 1, 1, 1))
    hand = (yp[2:5, 4:7] * ws[0][1, 0]).sum() + bs[0][1]  # output (t=1, f=2) of channel 1
    first = torch.relu(torch.nn.functional.conv2d(x, ws[0], bs[0], stride=2, padding=1))
    assert abs(first[0, 1, 1, 2] - torch.relu(hand)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm(gen, dtype):
    E, K, N = 4, 16, 12
    counts = torch.tensor([3, 0, 5, 2])
    x, w = rnd(gen, int(counts.sum()) + 2, K, dtype=dtype), rnd(gen, E, N, K, dtype=dtype)
    offs = counts.cumsum(0).to(torch.int32)
    out = ops.grouped_mm(x, w, offs)
    rows, start = [], 0
    for e, c in enumerate(counts.tolist()):
        rows += [x[start + i].double() @ w[e].double().T for i in range(c)]
        start += c
    expected = torch.stack(rows + [torch.zeros(N, dtype=torch.float64)] * 2)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_wgrad_is_grouped_mm_weight_gradient(gen, dtype):
    E, K, N = 4, 16, 12
    counts = torch.tensor([3, 0, 5, 2])
    offs = counts.cumsum(0).to(torch.int32)
    x, dy = rnd(gen, int(counts.sum()) + 2, K, dtype=dtype), rnd(gen, int(counts.sum()) + 2, N, dtype=dtype)
    w = rnd(gen, E, N, K, dtype=torch.float64).requires_grad_()
    torch.autograd.backward(ops.grouped_mm(x.double(), w, offs), dy.double())
    assert rel_err(ops.grouped_mm_wgrad(dy, x, offs), w.grad) < TOL[dtype]
    acc = rnd(gen, E, N, K, dtype=dtype)
    expected = acc.double() + w.grad
    out = ops.grouped_mm_wgrad(dy, x, offs, out=acc)
    assert out is acc and rel_err(acc, expected) < TOL[dtype]


def test_grouped_mm_wgrad_over_micro_batches_is_their_sum(gen):
    """Lists (one entry per micro-batch, each with its own group sizes) give the sum of the
    per-micro-batch gradients, added to or written over ``out``."""
    E, K, N = 3, 6, 5
    parts = []
    for counts in ([2, 0, 3], [1, 4, 0], [0, 0, 2]):
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        parts.append((rnd(gen, sum(counts), N), rnd(gen, sum(counts), K), offs))
    dys, xs, offs = (list(t) for t in zip(*parts, strict=True))
    total = sum(ops.grouped_mm_wgrad(d, x, o) for d, x, o in parts)
    assert rel_err(ops.grouped_mm_wgrad(dys, xs, offs), total) < 1e-6
    acc = rnd(gen, E, N, K)
    expected = acc + total
    ops.grouped_mm_wgrad(dys, xs, offs, out=acc)
    assert rel_err(acc, expected) < 1e-6
    ops.grouped_mm_wgrad(dys, xs, offs, out=acc, accumulate=False)
    assert rel_err(acc, total) < 1e-6
    with pytest.raises(ValueError, match="2 dy, 3 x"):
        ops.grouped_mm_wgrad(dys[:2], xs, offs)


def test_moe_permute_unpermute_roundtrip(gen):
    T, H, E, k = 7, 5, 4, 2
    x = rnd(gen, T, H)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    xs, order, counts = ops.moe_permute(x, idx, E)
    assert counts.tolist() == [int((idx == e).sum()) for e in range(E)]
    # rows come grouped by expert, each group in token order
    experts_of_rows = idx.reshape(-1)[order]
    assert torch.all(experts_of_rows[1:] >= experts_of_rows[:-1])
    # identity experts: unpermute gives sum_j w_j * x
    out = ops.moe_unpermute(xs, order, w)
    assert rel_err(out, x * w.sum(1, keepdim=True)) < 1e-6
    # an expert that scales by (e+1)
    ys = xs * (experts_of_rows.float() + 1).unsqueeze(1)
    expected = sum(x * (idx[:, j:j + 1].float() + 1) * w[:, j:j + 1] for j in range(k))
    assert rel_err(ops.moe_unpermute(ys, order, w), expected) < 1e-6


def dropped_copies_case(gen, T=9, H=5, E=4, k=3, device="cpu"):
    """Routing where some copies go to ids >= E (another rank's experts): (x, idx, w, kept)."""
    x = rnd(gen, T, H).to(device)
    idx = torch.stack([torch.randperm(2 * E, generator=gen)[:k] for _ in range(T)]).to(device)
    w = torch.rand(T, k, generator=gen).to(device)
    return x, idx, w, idx < E


def test_moe_permute_drops_copies_outside_the_experts_and_unpermute_skips_them(gen):
    """Ids >= E are dropped: sorted last, not counted, zero rows, no gradient; moe_unpermute
    with num_valid never reads their rows (NaN there changes nothing) and gives their weights
    a zero gradient."""
    E = 4
    x, idx, w, kept = dropped_copies_case(gen, E=E)
    assert (~kept).any() and kept.any()
    x.requires_grad_()
    w.requires_grad_()
    xs, order, counts = ops.moe_permute(x, idx, E)
    n = int(counts.sum())
    assert counts.tolist() == [int((idx == e).sum()) for e in range(E)] and n == int(kept.sum())
    assert bool(kept.reshape(-1)[order[:n]].all()) and not kept.reshape(-1)[order[n:]].any()
    assert not xs[n:].any()
    rows = torch.arange(xs.shape[0])[:, None]
    ys = torch.where(rows < n, 2 * xs, float("nan"))  # dropped rows: never computed
    out = ops.moe_unpermute(ys, order, w, num_valid=counts.sum())
    expected = 2 * x * (w * kept).sum(1, keepdim=True)
    assert torch.isfinite(out).all() and rel_err(out, expected) < 1e-6
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    assert rel_err(x.grad, 2 * g * (w * kept).sum(1, keepdim=True)) < 1e-6
    assert torch.isfinite(w.grad).all() and not w.grad[~kept].any()
    assert rel_err(w.grad[kept], (2 * x.detach() * g).sum(1, keepdim=True).expand_as(w)[kept]) < 1e-6


def test_linear_cross_entropy(gen):
    h, W = rnd(gen, 6, 8), rnd(gen, 11, 8)
    labels = torch.tensor([1, 2, -100, 10, 0, 3])
    logits = (h @ W.T).double()
    keep = labels != -100
    lp = logits.log_softmax(-1)[keep]
    expected = -lp[torch.arange(int(keep.sum())), labels[keep]].mean()
    assert abs(ops.linear_cross_entropy(h, W, labels).item() - expected.item()) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_grads_are_autograds(gen, reduction):
    h, W = rnd(gen, 9, 8), rnd(gen, 13, 8)
    labels = torch.tensor([1, 2, -100, 10, 0, 3, 12, -100, 5])
    hr, Wr = h.clone().requires_grad_(), W.clone().requires_grad_()
    ref = ops.linear_cross_entropy.reference(hr, Wr, labels, reduction=reduction)
    ref.backward()
    loss, gh, gw = ops.linear_cross_entropy_grads(h, W, labels, reduction=reduction, chunk=4)
    assert abs(loss.item() - ref.item()) < 1e-5
    assert rel_err(gh, hr.grad) < 1e-5 and rel_err(gw, Wr.grad) < 1e-5
    _, none_h, only_w = ops.linear_cross_entropy_grads(h, W, labels, reduction=reduction, grad_hidden=False)
    assert none_h is None and rel_err(only_w, Wr.grad) < 1e-5


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_logit_grads_give_autograds_logits_gradient(gen, reduction):
    """The logits' gradient [N, V] is autograd's (zero on ignored rows); ``g.T @ h`` is the
    weight's gradient and the hidden gradient is ``g @ W``."""
    h, W = rnd(gen, 9, 8), rnd(gen, 13, 8)
    labels = torch.tensor([1, 2, -100, 10, 0, 3, 12, -100, 5])
    hr, Wr = h.clone().requires_grad_(), W.clone().requires_grad_()
    logits = torch.nn.functional.linear(hr, Wr)
    logits.retain_grad()
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)
    ref.backward()
    loss, gh, g = ops.linear_cross_entropy_logit_grads(h, W, labels, reduction=reduction)
    assert abs(loss.item() - ref.item()) < 1e-5 and g.shape == (9, 13)
    assert rel_err(g, logits.grad) < 1e-5 and not g[labels == -100].any()
    assert rel_err(gh, hr.grad) < 1e-5 and rel_err(g.t() @ h, Wr.grad) < 1e-5
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        ops.linear_cross_entropy_logit_grads(h, W, labels, reduction="none")


def test_add_scaled_reads_a_tensor_scale(gen):
    out, x = rnd(gen, 5, 3, dtype=torch.bfloat16), rnd(gen, 5, 3, dtype=torch.bfloat16)
    expected = (out.float() + 0.37 * x.float()).to(torch.bfloat16)
    assert ops.add_scaled_(out, x, torch.tensor(0.37)) is out
    torch.testing.assert_close(out, expected)


def _torch_adamw_step(p, g, m, v, step, **hp):
    """One torch.optim.AdamW step in fp32 from state (p, m, v, step - 1): (p, m, v) after it."""
    param = torch.nn.Parameter(p.float().clone())
    param.grad = g.float().clone()
    opt = torch.optim.AdamW([param], **hp)
    opt.state[param] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float().clone(),
                        "exp_avg_sq": v.float().clone()}
    opt.step()
    return param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_step_is_torch_adamw(gen, dtype):
    """Each step equals torch AdamW's fp32 step from the same state, rounded once to ``dtype``;
    over several steps the run tracks torch AdamW run in ``dtype`` itself."""
    n, hp = 1001, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    p0 = rnd(gen, n, dtype=dtype) * 0.3
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], **hp)
    for step in range(1, 6):
        g = rnd(gen, n, dtype=dtype)
        expected = _torch_adamw_step(p, g, m, v, step, **hp)
        grad = g.clone()
        ops.adamw_step_(p, grad, m, v, lr=hp["lr"], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                        step=step, zero_grad=step % 2 == 1)
        for out, exp in zip((p, m, v), expected):
            assert out.dtype == dtype and torch.equal(out, exp.to(dtype))
        assert torch.equal(grad, torch.zeros_like(g) if step % 2 == 1 else g)  # zeroed only when asked
        ref.grad = g.clone()
        opt.step()
    st = opt.state[ref]
    tol = TOL[dtype]
    assert rel_err(p, ref.detach()) < tol  # bf16: torch rounds after every op, we once
    assert rel_err(m, st["exp_avg"]) < tol and rel_err(v, st["exp_avg_sq"]) < tol


def test_adamw_step_checks_its_arguments():
    t = torch.zeros(4)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, zero_grad=False)
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adamw_step_(t, t.clone(), t.clone(), t.clone(), step=0, **hp)
    with pytest.raises(ValueError, match="same length"):
        ops.adamw_step_(t, torch.zeros(5), t.clone(), t.clone(), step=1, **hp)


def test_adamw_scalars_refuses_step_zero():
    with pytest.raises(ValueError, match="step must be >= 1"):
        ops.adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 0)


@pytest.mark.parametrize("offsets, why", [
    ([4, 40], "past the output"),
    ([5, 3], "decreasing"),
    ([-2, 8], "negative"),
    ([8], "fewer ends than groups"),
])
def test_grouped_lowrank_add_refuses_offsets_that_do_not_describe_its_rows(offsets, why):
    out = torch.zeros(8, 6)
    with pytest.raises(ValueError, match="offsets must be"):
        ops.grouped_lowrank_add_.reference(out, torch.ones(8, 2), torch.ones(2, 2, 6),
                                           torch.tensor(offsets, dtype=torch.int32))
    assert not out.any(), why


def test_grouped_lowrank_add_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="do not fit"):  # a factor [E, r, 1] would broadcast over the columns
        ops.grouped_lowrank_add_.reference(torch.zeros(8, 6), torch.ones(8, 2), torch.ones(2, 2, 1),
                                           torch.tensor([4, 8], dtype=torch.int32))
