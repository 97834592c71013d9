"""The cuda backend's kernels against core's references, forward and backward.

Unmarked tests run each op's torch-math path (what the ops do off CUDA) and
``torch.library.opcheck`` on the CPU, so the autograd and fake registrations are checked in
CI. ``gpu`` tests run the Triton / ``torch._grouped_mm`` paths on fresh random inputs:
``pytest -m gpu tests/cuda`` on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

import pytest
import torch

from polyaccel.core import ops
from polyaccel.cuda import cross_entropy, grouped_wgrad, kernels
from polyaccel.cuda.moe_permute import moe_permute, moe_unpermute
from polyaccel.cuda.swiglu import swiglu
from polyaccel.cuda.triton_rmsnorm import rms_norm

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
"""Relative error bound (‖out − ref‖ / ‖ref‖ against an fp64 reference) by input dtype."""


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fp64_grads(fn, inputs, grad_out):
    """fn on fp64 copies of ``inputs`` (floating ones get grads): (out, grads)."""
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, [t for t in leaves if t.is_floating_point()], grad_out.double())
    return out, grads


def check_against_reference(fast, ref, inputs, dtype):
    """Forward and backward of ``fast`` (inputs in ``dtype``) against ``ref`` in fp64."""
    xs = [t.to(dtype).requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = fast(*xs)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [t for t in xs if t.is_floating_point()], grad_out)
    out64, grads64 = fp64_grads(ref, xs, grad_out)
    assert rel_err(out, out64) < TOL[dtype]
    for g, g64 in zip(grads, grads64, strict=True):
        assert rel_err(g, g64) < TOL[dtype]


def rms_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def routing(T, k, E, device="cpu"):
    """Random top-k expert ids (distinct per token) and softmax weights."""
    idx = torch.rand(T, E, device=device).argsort(-1)[:, :k]
    return idx, torch.softmax(torch.randn(T, k, device=device), -1)


def permute_combine(fast: bool):
    """x -> permute -> per-row affine (stand-in for experts) -> weighted unpermute."""
    perm = moe_permute if fast else ops.moe_permute.reference
    unperm = moe_unpermute if fast else ops.moe_unpermute.reference

    def fn(x, w, idx, E):
        xs, order, _ = perm(x, idx, E)
        return unperm(xs * 1.5 + 0.25, order, w)

    return fn


# ---------------------------------------------------------------------------------------
# CPU: the torch-math path of every op and its torch.library registrations
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    x, w = torch.randn(5, 7, 96), 1 + 0.1 * torch.randn(96)
    check_against_reference(rms_norm, rms_ref, [x, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(dtype):
    check_against_reference(swiglu, ops.swiglu.reference, [torch.randn(3, 11, 2 * 40)], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_match_reference(dtype):
    T, k, E, H = 29, 4, 8, 48
    idx, w = routing(T, k, E)
    x = torch.randn(T, H)
    xs, order, counts = moe_permute(x.to(dtype), idx, E)
    xs_r, order_r, counts_r = ops.moe_permute.reference(x.to(dtype), idx, E)
    assert torch.equal(order, order_r) and torch.equal(counts, counts_r) and torch.equal(xs, xs_r)
    fast, ref = permute_combine(True), permute_combine(False)
    check_against_reference(lambda x, w: fast(x, w, idx, E), lambda x, w: ref(x, w, idx, E), [x, w], dtype)


@pytest.mark.parametrize(("E", "key_dtype"), [(8, torch.uint8), (255, torch.uint8), (256, torch.int16),
                                              (40_000, torch.int32)])
def test_permute_sorts_narrow_keys_in_the_same_order(E, key_dtype):
    """Expert ids sorted as the narrowest type (one radix pass per byte): the counted copies in
    the reference's order with its counts, every dropped copy (ids >= E, several values) after
    them in original order, at a size past torch's in-place small sort (4,096)."""
    from polyaccel.cuda.moe_permute import sort_keys

    T, k = 700, 8
    idx = torch.randint(0, E, (T, k))
    dropped = torch.rand(T, k) < 0.2
    idx[dropped] = E + torch.randint(0, 3, (int(dropped.sum()),))
    assert sort_keys(idx.reshape(-1), E).dtype == key_dtype
    x = torch.randn(T, 16)
    xs, order, counts = moe_permute(x, idx, E)
    _, order_r, counts_r = ops.moe_permute.reference(x, idx, E)
    valid = int(counts_r.sum())
    assert valid == T * k - int(dropped.sum())
    assert torch.equal(counts, counts_r) and torch.equal(order[:valid], order_r[:valid])
    assert torch.equal(xs[:valid], x[order_r[:valid] // k])
    assert torch.equal(order[valid:], dropped.reshape(-1).nonzero().squeeze(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_reference_in_chunks(monkeypatch, dtype, reduction):
    N, H, V = 150, 32, 500
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 64 * V * torch.tensor([], dtype=dtype).element_size())
    assert cross_entropy.chunk_rows(N, V, torch.tensor([], dtype=dtype).element_size()) == 64  # 3 chunks
    labels = torch.randint(0, V, (N,))
    labels[::5] = -100

    def fast(h, w):
        return cross_entropy.linear_cross_entropy(h, w, labels, reduction=reduction)

    def ref(h, w):
        return torch.nn.functional.cross_entropy(h @ w.T, labels, reduction=reduction)

    check_against_reference(fast, ref, [torch.randn(N, H), 0.3 * torch.randn(V, H)], dtype)


def test_linear_cross_entropy_without_grad_and_unfused_reduction():
    h, w, y = torch.randn(70, 16), torch.randn(90, 16), torch.randint(0, 90, (70,))
    ref = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="none")
    with torch.no_grad():
        assert rel_err(cross_entropy.linear_cross_entropy(h, w, y), ref.mean()) < 1e-6
    assert rel_err(cross_entropy.linear_cross_entropy(h, w, y, reduction="none"), ref) < 1e-6


@pytest.mark.parametrize("V", [509, 512])
def test_an_odd_vocabulary_runs_the_lm_head_gemms_at_an_aligned_width(monkeypatch, V):
    """The logits (and so the three GEMMs) are VOCAB_ALIGN wide, the loss and gradients those of
    the V real classes: the last class is a target, the extra columns are never one."""
    assert (cross_entropy.padded_vocab(V), cross_entropy.padded_vocab(64), cross_entropy.padded_vocab(65)) == \
        (512, 64, 128)
    real_mm, widths = torch.mm, []

    def mm(a, b, *args, **kwargs):
        out = real_mm(a, b, *args, **kwargs)
        widths.append(out.shape[-1])
        return out

    monkeypatch.setattr(torch, "mm", mm)
    N, H = 40, 16
    labels = torch.randint(0, V, (N,))
    labels[:4] = V - 1
    labels[4] = -100
    h, w = torch.randn(N, H, requires_grad=True), 0.3 * torch.randn(V, H)
    w.requires_grad_()
    loss, grad_h, grad_w = cross_entropy.linear_cross_entropy_grads(h, w, labels)
    assert widths[0] == 512 and grad_w.shape == (V, H) and grad_w.is_contiguous()
    ref = torch.nn.functional.cross_entropy(h @ w.T, labels)
    ref_h, ref_w = torch.autograd.grad(ref, [h, w])
    assert rel_err(loss, ref) < 1e-6 and rel_err(grad_h, ref_h) < 1e-5 and rel_err(grad_w, ref_w) < 1e-5


@pytest.mark.parametrize("V, reduction", [(509, "mean"), (512, "sum")])
def test_logit_grads_run_at_an_aligned_width_and_return_the_real_columns(V, reduction):
    """The one-chunk op behind a deferred LM-head weight gradient: the loss, the hidden gradient
    and the logits' gradient (a V-wide view of aligned rows) equal autograd's."""
    N, H = 40, 16
    labels = torch.randint(0, V, (N,))
    labels[:4] = V - 1
    labels[4] = -100
    h, w = torch.randn(N, H, requires_grad=True), (0.3 * torch.randn(V, H)).requires_grad_()
    loss, grad_h, grad_logits = cross_entropy.linear_cross_entropy_logit_grads(h, w, labels, reduction=reduction)
    assert grad_logits.shape == (N, V) and grad_logits.stride(0) == 512
    logits = h @ w.T
    logits.retain_grad()
    ref = torch.nn.functional.cross_entropy(logits, labels, reduction=reduction)
    ref.backward()
    assert rel_err(loss, ref) < 1e-6 and rel_err(grad_h, h.grad) < 1e-5
    assert rel_err(grad_logits, logits.grad) < 1e-5 and rel_err(grad_logits.t() @ h, w.grad) < 1e-5


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_topk_op_gradient_is_autograds_through_softmax_and_topk(monkeypatch, renormalize):
    """The router op's own backward (the softmax backward of the weights' gradient scattered to
    the picked experts, renormalisation included) equals autograd's through core's reference;
    switched off, the op is that reference."""
    from polyaccel.cuda import router

    logits = torch.randn(11, 24, dtype=torch.float64)  # continuous: no ties
    dw = torch.randn(11, 5, dtype=torch.float64)
    ref_logits = logits.clone().requires_grad_()
    ref_w, ref_idx = ops.router_topk.reference(ref_logits, 5, renormalize)
    (ref_g,) = torch.autograd.grad(ref_w, ref_logits, dw)
    monkeypatch.setattr(router, "ENABLED", True)
    x = logits.clone().requires_grad_()
    w, idx = router.router_topk(x, 5, renormalize)
    (g,) = torch.autograd.grad(w, x, dw)
    assert torch.equal(idx, ref_idx) and rel_err(w, ref_w) < 1e-6 and rel_err(g, ref_g) < 1e-6
    monkeypatch.setattr(router, "ENABLED", False)
    monkeypatch.setattr(torch.ops.polyaccel_cuda, "router_topk", None)
    w_off, idx_off = router.router_topk(logits, 5, renormalize)
    assert torch.equal(idx_off, ref_idx) and torch.equal(w_off, ref_w.detach())


@gpu
@needs_cuda
@pytest.mark.parametrize("T, E, k, renormalize", [(4096, 128, 8, True), (4096, 64, 8, False), (1000, 8, 2, True),
                                                   (333, 160, 6, True)])
def test_gpu_router_topk_keeps_the_experts_torch_topk_keeps(monkeypatch, T, E, k, renormalize):
    """On CUDA, bf16 logits rounded so that many tie: the fused router picks the same set of
    experts per token as torch's softmax + top-k (the tie rule it assumes: the lower expert id
    first), in descending weight order, with the same weights and gradient within fp32 rounding."""
    from polyaccel.cuda import router

    monkeypatch.setattr(router, "ENABLED", True)
    logits = ((torch.randn(T, E, device="cuda") * 4).round() / 4).bfloat16()
    x, ref_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, idx = router.router_topk(x, k, renormalize)
    ref_w, ref_idx = ops.router_topk.reference(ref_x, k, renormalize)
    assert torch.equal(idx.sort(dim=-1).values, ref_idx.sort(dim=-1).values), "another expert set"
    assert (w[:, :-1] >= w[:, 1:]).all()

    def by_expert(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # equal weights may come in another order
        return torch.zeros(T, E, device="cuda").scatter(1, ids, t.detach().float())

    assert rel_err(by_expert(w, idx), by_expert(ref_w, ref_idx)) < 1e-6
    dw = torch.randn(T, E, device="cuda")  # an upstream gradient per expert
    (g,) = torch.autograd.grad(w, x, dw.gather(1, idx))
    (ref_g,) = torch.autograd.grad(ref_w, ref_x, dw.gather(1, ref_idx))
    assert rel_err(g, ref_g) < 1e-2


def test_chunk_rows():
    assert cross_entropy.chunk_rows(4096, 151936, 2, chunk_bytes=1 << 30) == 2048
    assert cross_entropy.chunk_rows(4096, 151936, 2, chunk_bytes=4 << 30) == 4096
    assert cross_entropy.chunk_rows(10, 100, 2) == 64
    assert cross_entropy.chunk_rows(4096, 151936, 2) == 4096  # the workload: one chunk by default


def test_opcheck_cpu():
    T, k, E, H = 12, 2, 4, 16
    idx, w = routing(T, k, E)
    x = torch.randn(T, H, requires_grad=True)
    xs, order, _ = moe_permute(x, idx, E)
    cases = [
        (torch.ops.polyaccel_cuda.rms_norm_fwd, (torch.randn(6, 32, requires_grad=True),
                                                 torch.randn(32, requires_grad=True), 1e-6)),
        (torch.ops.polyaccel_cuda.swiglu, (torch.randn(6, 64, requires_grad=True),)),
        (torch.ops.polyaccel_cuda.moe_permute, (x, idx, E)),
        (torch.ops.polyaccel_cuda.moe_unpermute, (xs.detach().requires_grad_(), order,
                                                  w.requires_grad_())),
        (torch.ops.polyaccel_cuda.linear_cross_entropy,
         (torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True),
          torch.randint(0, 30, (20,)), -100, "mean", 8, True)),
        (torch.ops.polyaccel_cuda.linear_cross_entropy_logits,
         (torch.randn(20, 8), torch.randn(30, 8), torch.randint(0, 30, (20,)), -100, "sum")),
        (torch.ops.polyaccel_cuda.router_topk, (torch.randn(10, 12, requires_grad=True), 3, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_register_all_registers_every_op_for_cuda():
    seen = {}

    class Recorder:
        def register(self, op, device_type, fn, *, impl, backend=""):
            seen[op] = (device_type, impl)

    kernels.register_all(Recorder())
    assert seen["grouped_mm"] == ("cuda", "torch._grouped_mm")
    assert seen["moe_permute"][0] == "cuda"
    from polyaccel.cuda._triton import has_triton

    if has_triton():
        assert {"rms_norm", "swiglu", "moe_unpermute", "linear_cross_entropy", "linear_cross_entropy_grads",
                "linear_cross_entropy_logit_grads", "router_topk", "add_scaled_", "grouped_mm_wgrad", "adamw_step_",
                "decode_attention"} <= set(seen)


# ---------------------------------------------------------------------------------------
# GPU: Triton kernels and torch._grouped_mm
# ---------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 2048), (2, 333, 128), (17, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rms_norm(shape, dtype):
    x, w = torch.randn(*shape, device="cuda"), 1 + 0.1 * torch.randn(shape[-1], device="cuda")
    check_against_reference(rms_norm, rms_ref, [x, w], dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_swiglu(dtype):
    check_against_reference(swiglu, ops.swiglu.reference, [torch.randn(3000, 2 * 768, device="cuda")], dtype)
    # num_valid: rows past it (dropped copies) are skipped; rows below it are unchanged.
    gu = torch.randn(3000, 2 * 768, device="cuda").to(dtype).requires_grad_()
    out = swiglu(gu, torch.tensor(1700, device="cuda"))
    g = torch.randn_like(out)
    (dgu,) = torch.autograd.grad(out, gu, g)
    out64, (dgu64,) = fp64_grads(ops.swiglu.reference, [gu], g)
    assert rel_err(out[:1700], out64[:1700]) < TOL[dtype] and rel_err(dgu[:1700], dgu64[:1700]) < TOL[dtype]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_permute_unpermute(dtype):
    T, k, E, H = 1000, 8, 128, 2048
    idx, w = routing(T, k, E, "cuda")
    x = torch.randn(T, H, device="cuda")
    xs, order, counts = moe_permute(x.to(dtype), idx, E)
    xs_r, order_r, counts_r = ops.moe_permute.reference(x.to(dtype), idx, E)
    assert torch.equal(order, order_r) and torch.equal(counts, counts_r) and torch.equal(xs, xs_r)
    fast, ref = permute_combine(True), permute_combine(False)
    check_against_reference(lambda x, w: fast(x, w, idx, E), lambda x, w: ref(x, w, idx, E), [x, w], dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_permute_unpermute_skip_dropped_copies(dtype):
    """Half the copies routed to ids >= E (another rank's experts, as under expert parallelism
    with the fixed-size all-gather): NaN in their rows never reaches the outputs or gradients."""
    T, k, E, H = 1000, 8, 64, 2048
    idx, w = routing(T, k, 2 * E, "cuda")

    def run(perm, unperm):
        def fn(x, w):
            xs, order, counts = perm(x, idx, E)
            rows = torch.arange(xs.shape[0], device="cuda")[:, None]
            ys = torch.where(rows < counts.sum(), xs * 1.5 + 0.25, float("nan"))
            return unperm(ys, order, w, counts.sum())
        return fn

    x = torch.randn(T, H, device="cuda")
    check_against_reference(run(moe_permute, moe_unpermute),
                            run(ops.moe_permute.reference, ops.moe_unpermute.reference), [x, w], dtype)


@gpu
@needs_cuda
def test_gpu_dispatch_has_no_host_sync():
    T, k, E, H = 512, 8, 64, 256
    idx, w = routing(T, k, E, "cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wt = torch.randn(E, 2 * H, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe_permute(x, idx, E)  # first call outside the check: lazy init, Triton compile
    torch.cuda.set_sync_debug_mode("error")
    try:
        xs, order, counts = moe_permute(x, idx, E)
        h = kernels.grouped_mm(xs, wt, counts.cumsum(0))
        out = moe_unpermute(swiglu(h), order, w)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@needs_cuda
def test_gpu_grouped_mm_with_empty_groups():
    E, K, N = 8, 256, 384
    counts = torch.tensor([40, 0, 17, 64, 0, 3, 100, 12], device="cuda")
    x, w = torch.randn(int(counts.sum()), K, device="cuda"), torch.randn(E, N, K, device="cuda") / 16
    offsets = counts.cumsum(0).to(torch.int32)
    check_against_reference(lambda x, w: kernels.grouped_mm(x, w, offsets),
                            lambda x, w: ops.grouped_mm.reference(x, w, offsets), [x, w], torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize(("N", "K"), [(1536, 2048), (2048, 768), (200, 72), (2048, 16), (16, 2048), (768, 8), (24, 1536)])
def test_gpu_grouped_mm_wgrad_writes_and_accumulates(N, K, monkeypatch):
    from polyaccel.cuda import grouped_wgrad
    from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

    E = 16
    counts = torch.randint(0, 300, (E,), device="cuda")
    counts[3] = 0
    T = int(counts.sum()) + 5  # rows past the last group are ignored
    offsets = counts.cumsum(0).to(torch.int32)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    ref = ops.grouped_mm_wgrad.reference(dy.double(), x.double(), offsets)
    fresh = grouped_mm_wgrad(dy, x, offsets)
    assert fresh.dtype == torch.bfloat16 and rel_err(fresh, ref) < TOL[torch.bfloat16]
    assert (fresh[3] == 0).all()
    acc = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    expected = acc.double() + ref
    acc_first = acc.clone()
    assert grouped_mm_wgrad(dy, x, offsets, out=acc) is acc
    assert rel_err(acc, expected) < TOL[torch.bfloat16]
    monkeypatch.setattr(grouped_wgrad, "GRAD_FIRST", True)  # the .grad tile read before the main loop
    grouped_mm_wgrad(dy, x, offsets, out=acc_first)
    assert rel_err(acc_first, expected) < TOL[torch.bfloat16]


def check_window_sums(E: int, N: int, K: int, ns: tuple[int, ...], sumsq: bool = False) -> None:
    """grouped_mm_wgrad over the first n of max(ns) micro-batches (~200 rows per expert, one
    expert empty) == the reference sum, written over and added to ``out``; with ``sumsq`` also
    the sum of squares of what it stored."""
    from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

    dys, xs, offs = [], [], []
    for _ in range(max(ns)):
        counts = torch.randint(0, 400, (E,), device="cuda")
        counts[4] = 0
        offs.append(counts.cumsum(0).to(torch.int32))
        dys.append(torch.randn(int(counts.sum()) + 3, N, device="cuda", dtype=torch.bfloat16))
        xs.append(torch.randn(int(counts.sum()) + 3, K, device="cuda", dtype=torch.bfloat16))
    for n in ns:
        ref = ops.grouped_mm_wgrad.reference([d.double() for d in dys[:n]], [x.double() for x in xs[:n]], offs[:n])
        over = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        squares = torch.full((), -1.0, device="cuda") if sumsq else None
        grouped_mm_wgrad(dys[:n], xs[:n], offs[:n], out=over, accumulate=False, sumsq=squares)
        assert rel_err(over, ref) < TOL[torch.bfloat16] and (over[4] == 0).all()
        if sumsq:
            assert rel_err(squares, over.double().square().sum()) < 1e-4
        acc = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        expected = acc.double() + ref
        grouped_mm_wgrad(dys[:n], xs[:n], offs[:n], out=acc)
        assert rel_err(acc, expected) < TOL[torch.bfloat16]


@gpu
@needs_cuda
def test_gpu_grouped_mm_wgrad_over_several_micro_batches():
    """One call over 1, 3, 4 and 5 micro-batches' rows (5: two launches) == the sum, written
    over or added to ``out``."""
    check_window_sums(16, 1536, 2048, (1, 3, 4, 5))


@gpu
@needs_cuda
@pytest.mark.parametrize("config", [None, *range(len(grouped_wgrad.PERSISTENT_CONFIGS))])
def test_gpu_grouped_mm_wgrad_persistent_launch(config, monkeypatch):
    """The pointer kernel's persistent launch (``POLYACCEL_WGRAD_PERSISTENT``), autotuned
    (None) and at each entry of its list, over 1 and 4 micro-batches, with the sum of squares."""
    configs = grouped_wgrad.PERSISTENT_CONFIGS
    monkeypatch.setattr(grouped_wgrad, "PERSISTENT", True)
    if config is not None:
        monkeypatch.setattr(grouped_wgrad, "PERSISTENT_CONFIGS", [configs[config]])
    check_window_sums(16, 1536, 768, (1, 4), sumsq=True)


@gpu
@needs_cuda
def test_gpu_grouped_mm_wgrad_tensor_memory_kernel():
    """One micro-batch with ~1,000 rows per expert takes the TMA kernel: new, added, written
    over, replayed in a CUDA graph on new rows, and from autograd's backward thread (Triton's
    scratch allocator is per thread)."""
    from polyaccel.cuda import grouped_wgrad
    from polyaccel.moe.grouped_linear import grouped_linear

    E, N, K = 8, 1536, 2048
    counts = torch.randint(600, 1400, (E,), device="cuda")
    counts[2] = 0
    offsets = counts.cumsum(0).to(torch.int32)
    T = int(counts.sum()) + 7
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    assert grouped_wgrad._takes_tma(dy, x, E)
    ref = ops.grouped_mm_wgrad.reference(dy.double(), x.double(), offsets)
    fresh = grouped_wgrad.grouped_mm_wgrad(dy, x, offsets)
    assert rel_err(fresh, ref) < TOL[torch.bfloat16] and (fresh[2] == 0).all()
    acc = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
    expected = acc.double() + ref
    grouped_wgrad.grouped_mm_wgrad(dy, x, offsets, out=acc)
    assert rel_err(acc, expected) < TOL[torch.bfloat16]

    out = torch.empty(E, N, K, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_wgrad.grouped_mm_wgrad(dy, x, offsets, out=out, accumulate=False)
    dy.normal_()
    offsets.copy_(torch.randint(600, 1400, (E,), device="cuda").cumsum(0).clamp(max=T))
    graph.replay()
    assert rel_err(out, ops.grouped_mm_wgrad.reference(dy.double(), x.double(), offsets)) < TOL[torch.bfloat16]

    w = (torch.randn(E, N, K, device="cuda") / 16).bfloat16().requires_grad_()
    torch.autograd.backward(grouped_linear(x.clone().requires_grad_(), w, offsets), dy)
    assert rel_err(w.grad, ops.grouped_mm_wgrad.reference(dy.double(), x.double(), offsets)) < TOL[torch.bfloat16]


@gpu
@needs_cuda
def test_gpu_grouped_mm_wgrad_tensor_memory_kernel_every_tile():
    """Each tile and launch the tensor-memory kernel's autotuner may pick (persistent or one
    tile per program, .grad through the copy engine or pointers), written over and added into,
    on fresh random rows: the autotuner keeps whichever is fastest, so each must be right."""
    from polyaccel.cuda import grouped_wgrad

    E, N, K = 6, 1408, 1152  # tiles past the edges at 256; a band of 8 rows of tiles and a part one
    counts = torch.randint(300, 900, (E,), device="cuda")
    counts[4] = 0
    offsets = counts.cumsum(0).to(torch.int32)
    T = int(counts.sum()) + 5
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    ref = ops.grouped_mm_wgrad.reference(dy.double(), x.double(), offsets)
    for config in grouped_wgrad.TMA_CONFIGS:
        over = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        grouped_wgrad._launch_tma(dy, x, offsets, over, accumulate=False, config=config)
        acc = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        expected = acc.double() + ref
        grouped_wgrad._launch_tma(dy, x, offsets, acc, accumulate=True, config=config)
        assert rel_err(over, ref) < TOL[torch.bfloat16] and (over[4] == 0).all(), config
        assert rel_err(acc, expected) < TOL[torch.bfloat16], config


@gpu
@needs_cuda
def test_gpu_fused_wgrad_accumulation_matches_autograd():
    from polyaccel.moe.grouped_linear import grouped_linear

    E, N, K = 8, 384, 256
    w1 = (torch.randn(E, N, K, device="cuda") / 16).bfloat16().requires_grad_()
    w2 = w1.detach().clone().requires_grad_()
    for _ in range(3):
        counts = torch.randint(0, 100, (E,), device="cuda")
        offsets = counts.cumsum(0).to(torch.int32)
        x = torch.randn(int(counts.sum()), K, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(x.shape[0], N, device="cuda", dtype=torch.bfloat16)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.autograd.backward(grouped_linear(a, w1, offsets), g)
        torch.autograd.backward(kernels.grouped_mm(b, w2, offsets), g)
        assert rel_err(a.grad, b.grad) < 1e-2
    assert rel_err(w1.grad, w2.grad.float()) < 1e-2


@gpu
@needs_cuda
@pytest.mark.parametrize("V", [151936, 49155])  # Qwen3's; an odd one (padded to 49,216 for the GEMMs)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_linear_cross_entropy_large_vocab(monkeypatch, dtype, V):
    N, H = 1024, 512
    monkeypatch.setattr(cross_entropy, "CHUNK_BYTES", 300 * V * 4)  # 4 chunks, fp32 accumulation
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[-7:] = -100

    def fast(h, w):
        return cross_entropy.linear_cross_entropy(h, w, labels)

    def ref(h, w):
        return torch.nn.functional.cross_entropy(h @ w.T, labels)

    check_against_reference(fast, ref, [torch.randn(N, H, device="cuda"),
                                        torch.randn(V, H, device="cuda") / 8], dtype)


@gpu
@needs_cuda
def test_gpu_opcheck():
    T, k, E, H = 64, 4, 16, 128
    idx, w = routing(T, k, E, "cuda")
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xs, order, _ = moe_permute(x, idx, E)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    cases = [
        (torch.ops.polyaccel_cuda.rms_norm_fwd, (torch.randn(6, 128, **dev, requires_grad=True),
                                                 torch.randn(128, **dev, requires_grad=True), 1e-6)),
        (torch.ops.polyaccel_cuda.swiglu, (torch.randn(6, 256, **dev, requires_grad=True),)),
        (torch.ops.polyaccel_cuda.moe_permute, (x, idx, E)),
        (torch.ops.polyaccel_cuda.moe_unpermute, (xs.detach().requires_grad_(), order, w.requires_grad_())),
        (torch.ops.polyaccel_cuda.linear_cross_entropy,
         (torch.randn(200, 64, **dev, requires_grad=True), torch.randn(1000, 64, **dev, requires_grad=True),
          torch.randint(0, 1000, (200,), device="cuda"), -100, "mean", 64, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@gpu
@needs_cuda
def test_gpu_ops_under_torch_compile():
    T, k, E, H = 256, 4, 16, 128
    idx, w = routing(T, k, E, "cuda")
    wt = torch.randn(E, 2 * H, H, device="cuda", dtype=torch.bfloat16) / 12
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    head = torch.randn(1000, H, device="cuda", dtype=torch.bfloat16) / 12
    labels = torch.randint(0, 1000, (T,), device="cuda")

    def step(x):
        h = rms_norm(x, norm_w)
        xs, order, counts = moe_permute(h, idx, E)
        y = swiglu(kernels.grouped_mm(xs, wt, counts.cumsum(0)))
        return cross_entropy.linear_cross_entropy(x + moe_unpermute(y, order, w), head, labels)

    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = step(x)
    (g_eager,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(step, fullgraph=True)(x)
    (g_comp,) = torch.autograd.grad(compiled, x)
    assert rel_err(compiled, eager) < 1e-2 and rel_err(g_comp, g_eager) < 2e-2


@gpu
@needs_cuda
def test_gpu_linear_cross_entropy_grads_and_add_scaled():
    """The CUDA op's returned gradients equal autograd's through the reference; add_scaled_
    adds a [V, H] gradient scaled by a device scalar."""
    from polyaccel.cuda.add_scaled import add_scaled_
    from polyaccel.cuda.cross_entropy import linear_cross_entropy_grads

    N, H, V = 300, 256, 5000
    h = torch.randn(N, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") / 16).bfloat16()
    y = torch.randint(0, V, (N,), device="cuda")
    y[::7] = -100
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ref = ops.linear_cross_entropy.reference(hr, wr, y, reduction="sum")
    ref.backward()
    loss, gh, gw = linear_cross_entropy_grads(h, w, y, reduction="sum")
    assert rel_err(loss, ref) < 1e-3
    assert rel_err(gh, hr.grad) < TOL[torch.bfloat16] and rel_err(gw, wr.grad) < TOL[torch.bfloat16]
    acc = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
    expected = acc.double() + 0.25 * gw.double()
    add_scaled_(acc, gw, torch.tensor(0.25, device="cuda"))
    assert rel_err(acc, expected) < TOL[torch.bfloat16]


@gpu
@needs_cuda
@pytest.mark.parametrize("T,N,G,r", [(32768, 2048, 128, 16), (32768, 1536, 128, 16), (5000, 4096, 8, 64),
                                     (777, 100, 6, 5), (3000, 512, 16, 200)])
def test_gpu_grouped_lowrank_add(T, N, G, r):
    """Rank-r updates per group added in place (a LoRA adapter's product into the base grouped
    GEMM output), bf16 on learned-like uneven groups with empty ones, a strided factor (B_e.T
    views) and a contiguous one (A_e), against the fp64 reference; rows past the last group
    unchanged."""
    from polyaccel.cuda.grouped_lowrank import grouped_lowrank_add_

    counts = torch.distributions.Dirichlet(torch.full((G,), 0.3)).sample() * (T - 7)
    counts = counts.floor().long()
    counts[G // 3] = 0
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    for factor in (torch.randn(G, N, r, device="cuda").transpose(1, 2), torch.randn(G, r, N, device="cuda")):
        out = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(T, r, device="cuda", dtype=torch.bfloat16)
        f = factor.to(torch.bfloat16)
        want = ops.grouped_lowrank_add_.reference(out.double(), u.double(), f.double(), offsets)
        got = grouped_lowrank_add_(out.clone(), u, f, offsets)
        assert rel_err(got, want) < TOL[torch.bfloat16]
        end = int(offsets[-1])
        assert torch.equal(got[end:], out[end:])

