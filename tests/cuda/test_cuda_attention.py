"""Core ``attention`` on CUDA (SDPA) against the reference, fresh random inputs."""

import pytest
import torch

from polyaccel.core import ops


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_sdpa_attention_matches_reference_on_cpu_tensors():
    """The implementation's semantics (GQA, end-aligned causal, masks) checked on CPU too."""
    from polyaccel.cuda.attention import attention

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v = (torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g),
               torch.randn(2, 2, 7, 16, generator=g))
    mask = torch.rand(2, 1, 1, 7, generator=g) > 0.3
    mask[..., -1] = True
    for kw in ({}, {"causal": True}, {"mask": mask}, {"mask": mask, "causal": True}):
        assert _rel(attention(q, k, v, **kw), ops.attention.reference(q, k, v, **kw)) < 1e-5, kw
    full = torch.zeros(2, 1, 1, 7, dtype=torch.bool)
    assert torch.equal(attention(q, k, v, mask=full), torch.zeros_like(q))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_sdpa_attention_on_gpu(dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from polyaccel.cuda.attention import attention

    q = torch.randn(3, 8, 5, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(3, 2, 40, 64, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.rand(3, 1, 1, 40, device="cuda") > 0.2
    mask[..., 0] = True
    for kw in ({}, {"causal": True}, {"mask": mask}):
        assert _rel(attention(q, k, v, **kw), ops.attention.reference(q, k, v, **kw)) < tol, kw
