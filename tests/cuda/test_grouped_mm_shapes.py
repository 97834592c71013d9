"""The CUDA backend's ``grouped_mm`` on shapes ``torch._grouped_mm`` refuses as they are (a
LoRA rank of 4, widths that are not a multiple of 16 bytes, unaligned views): same values and
gradients as core's reference. ``torch._grouped_mm`` has a CPU implementation with the same
alignment rules, so this runs in CI; under ``torch.compile`` it traces without a graph break."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core.ops import grouped_mm as core_op
from polyaccel.cuda.kernels import grouped_mm

if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no _grouped_mm", allow_module_level=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(T: int, K: int, N: int, E: int, seed: int, device: str = "cpu"):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, N, K, generator=g) / K**0.5).to(torch.bfloat16)
    cuts = torch.sort(torch.randint(0, T + 1, (E - 1,), generator=g)).values
    offsets = torch.cat([cuts, torch.tensor([T])]).to(torch.int32)
    if E > 2:
        offsets[1] = offsets[0]  # one empty group
    return x.to(device), w.to(device), offsets.to(device)


def _values_and_grads(fn, x, w, offsets):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, offsets)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
    return y.float(), x.grad.float(), w.grad.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K, N", [(4, 16), (12, 6), (1000, 24), (16, 8), (2048, 4)])
def test_unaligned_widths_match_the_reference(K: int, N: int, device: str) -> None:
    x, w, offsets = _case(40, K, N, 4, seed=K * 31 + N, device=device)
    got = _values_and_grads(grouped_mm, x, w, offsets)
    want = _values_and_grads(core_op.reference, x.float(), w.float(), offsets)
    for a, b, name in zip(got, want, ("y", "dx", "dw"), strict=True):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=0.05 * b.abs().max().item() + 1e-3, rtol=0.02, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_views_are_copied_not_refused(device: str) -> None:
    x, w, offsets = _case(24, 16, 8, 3, seed=7, device=device)
    wide = torch.randn(24, 17).to(torch.bfloat16).to(device)
    wide[:, 1:] = x
    view = wide[:, 1:]  # 2 bytes past an aligned address, rows 34 bytes apart
    torch.testing.assert_close(grouped_mm(view, w, offsets).float(),
                               core_op.reference(x.float(), w.float(), offsets), atol=0.05, rtol=0.02)


def test_compiles_without_a_graph_break() -> None:
    x, w, offsets = _case(32, 4, 16, 2, seed=3)
    compiled = torch.compile(grouped_mm, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w, offsets), grouped_mm(x, w, offsets))
