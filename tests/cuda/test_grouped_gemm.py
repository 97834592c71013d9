"""The expert GEMM's Triton kernel (:mod:`polyaccel.cuda.grouped_gemm`) and its choice against
CUTLASS. GPU tests: every tile of the autotuner's list against core's reference and against
``torch._grouped_mm`` on fresh random routing (empty experts, uneven ones, rows past the last
expert), both weight layouts; the backend's ``grouped_mm`` taking it only where no autograd
graph is recorded; the choice made once per shape and never timed under capture. The CPU test
checks the setting's parsing; the interpreter runs the kernel's indexing in CI
(``interpreted_kernels.py``)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core.ops import grouped_mm as core_op
from polyaccel.cuda import grouped_gemm
from polyaccel.cuda.kernels import grouped_mm as backend_grouped_mm


def _routed(G: int, T: int, P: int, R: int, seed: int, tail: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    weight = torch.distributions.Gamma(0.7, 1.0).sample((G,))
    weight[torch.randperm(G, generator=g)[: G // 3]] = 0  # a third of the experts get nothing
    counts = (weight / weight.sum() * T).floor().long()
    counts[int(weight.argmax())] += T - int(counts.sum())
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T + tail, R, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(G, P, R, generator=g) / R**0.5).to("cuda", torch.bfloat16)
    return x, w, offsets


def _gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not grouped_gemm.takes_triton(torch.empty(8, 64, device="cuda", dtype=torch.bfloat16),
                                     torch.empty(2, 64, 64, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("this GPU or Triton has no tensor-memory descriptors")


@pytest.mark.gpu
@pytest.mark.parametrize("config", grouped_gemm.CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_every_tile_matches_the_reference_and_cutlass(config: tuple) -> None:
    _gpu()
    seed = int(torch.randint(0, 2**31, ()).item())
    for G, T, P, R in ((16, 3000, 384, 256), (128, 4096, 200, 128)):
        x, w, offsets = _routed(G, T, P, R, seed, tail=37)
        for name, weight in (("forward", w), ("input grad", w.transpose(1, 2).contiguous().transpose(1, 2))):
            assert grouped_gemm.weight_layout(weight)[1] == (name == "forward")
            got = grouped_gemm.grouped_mm(x, weight, offsets, config=config)
            ref = core_op.reference(x.float(), weight.float(), offsets)
            cutlass = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
            err = ((got.float() - ref).norm() / ref.norm()).item()
            assert err < 5e-3, (name, G, T, P, R, seed, err)
            assert not got[T:].any(), "rows past the last expert must be zeros"
            close = ((got[:T].float() - cutlass[:T].float()).norm() / cutlass[:T].float().norm()).item()
            assert close < 5e-3, (name, close)


@pytest.mark.gpu
def test_backend_takes_triton_only_without_an_autograd_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu()
    monkeypatch.setenv("POLYACCEL_GROUPED_MM", "triton")
    x, w, offsets = _routed(32, 2048, 256, 128, seed=1)
    calls = []
    real = grouped_gemm.grouped_mm
    monkeypatch.setattr(grouped_gemm, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        y = backend_grouped_mm(x, w, offsets)
    assert calls, "the Triton kernel should run where no graph is recorded"
    ref = core_op.reference(x.float(), w.float(), offsets)
    assert ((y.float() - ref).norm() / ref.norm()).item() < 5e-3
    calls.clear()
    xg = x.detach().requires_grad_()
    y = backend_grouped_mm(xg, w, offsets)
    assert not calls and y.grad_fn is not None  # CUTLASS's aten op carries the backward
    y.float().sum().backward()
    assert xg.grad is not None


@pytest.mark.gpu
def test_auto_choice_is_timed_once_per_shape_and_never_under_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu()
    monkeypatch.setenv("POLYACCEL_GROUPED_MM", "auto")
    monkeypatch.setattr(grouped_gemm, "CHOICES", {})
    x, w, offsets = _routed(64, 4096, 256, 256, seed=2)
    timed = []
    real = grouped_gemm._device_ms
    monkeypatch.setattr(grouped_gemm, "_device_ms", lambda run, calls=5: timed.append(1) or real(run, calls))
    cutlass = lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)  # noqa: E731
    first = grouped_gemm.choose(x, w, offsets, cutlass)
    assert first in ("triton", "cutlass") and len(timed) == 2
    assert grouped_gemm.choose(x, w, offsets, cutlass) == first and len(timed) == 2  # cached
    # A shape not timed yet takes CUTLASS while a graph is captured, and is not cached then.
    x2, w2, off2 = _routed(48, 1000, 128, 128, seed=3)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        picked = grouped_gemm.choose(x2, w2, off2, lambda: None)
    assert picked == "cutlass" and len(timed) == 2 and len(grouped_gemm.CHOICES) == 1


def test_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLYACCEL_GROUPED_MM", "fastest")
    x, w = torch.empty(4, 16), torch.empty(2, 16, 16)
    with pytest.raises(ValueError, match="POLYACCEL_GROUPED_MM='fastest'"):
        grouped_gemm.choose(x, w, torch.tensor([2, 4], dtype=torch.int32), lambda: x)


@pytest.mark.gpu
@pytest.mark.parametrize("sources", [1, 4, 6])
def test_weight_gradient_sum_of_squares(sources: int) -> None:
    """``grouped_mm_wgrad(..., sumsq=)`` on the GPU (the tensor-memory kernel for one large
    source, the pointer kernel for windows of several, two launches for six): the sum of
    squares of what it stored, written over and added into."""
    from polyaccel.cuda.grouped_wgrad import grouped_mm_wgrad

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rows = 8192 if sources == 1 else 1024
    xs, dys, offs = [], [], []
    for s in range(sources):
        x, w, offsets = _routed(16, rows, 256, 384, seed=10 + s)
        xs.append(x)
        dys.append(torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16))
        offs.append(offsets)
    for accumulate in (False, True):
        out = torch.randn(16, 256, 384, device="cuda", dtype=torch.bfloat16)
        sq = torch.full((), -1.0, device="cuda")
        grouped_mm_wgrad(dys, xs, offs, out=out, accumulate=accumulate, sumsq=sq)
        torch.testing.assert_close(sq, out.float().square().sum(), rtol=1e-4, atol=0)
