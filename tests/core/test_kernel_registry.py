"""Backends' kernel registrations override the reference per device type, and only there."""

import pytest
import torch

from polyaccel.core import ops, registry


def test_registered_impl_is_used_for_its_device_type_only():
    calls = []

    def fake(x, w, eps=1e-6):
        calls.append(x.device.type)
        return ops.rms_norm.reference(x, w, eps)

    registry.register("rms_norm", "meta", fake, impl="fake", backend="test")
    try:
        ops.rms_norm(torch.randn(2, 4), torch.ones(4))
        assert calls == []
        ops.rms_norm(torch.empty(2, 4, device="meta"), torch.empty(4, device="meta"))
        assert calls == ["meta"]
        with registry.reference_only():
            ops.rms_norm(torch.empty(2, 4, device="meta"), torch.empty(4, device="meta"))
        assert calls == ["meta"]
        ops.rms_norm(torch.empty(2, 4, device="meta"), torch.empty(4, device="meta"))
        assert calls == ["meta", "meta"]  # the block's end restores dispatch
        row = next(r for r in registry.table() if r["op"] == "rms_norm")
        assert row["meta"] == "fake (test)"
    finally:
        registry.unregister("rms_norm", "meta")


def test_dispatch_follows_the_first_tensor_even_in_a_list():
    """The device of the first tensor argument decides, also when that argument is one tensor
    per micro-batch (grouped_mm_wgrad over a window) and a later argument lives elsewhere."""
    calls = []

    def fake(dy, x, offsets, *args, **kwargs):
        calls.append(type(dy).__name__)

    registry.register("grouped_mm_wgrad", "meta", fake, impl="fake", backend="test")
    try:
        meta = [torch.empty(4, 3, device="meta")]
        ops.grouped_mm_wgrad(meta, [torch.empty(4, 2, device="meta")], [torch.tensor([4], dtype=torch.int32)])
        assert calls == ["list"]
        ops.grouped_mm_wgrad(torch.empty(4, 3, device="meta"), torch.empty(4, 2, device="meta"),
                             offsets=torch.tensor([4], dtype=torch.int32))
        assert calls == ["list", "Tensor"]
    finally:
        registry.unregister("grouped_mm_wgrad", "meta")


def test_register_unknown_op_fails():
    with pytest.raises(KeyError, match="unknown op"):
        registry.register("no_such_op", "cuda", lambda: None, impl="x")


def test_reference_ops_have_autograd():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    ops.rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None


def test_ops_trace_under_torch_compile():
    f = torch.compile(lambda x, w: ops.rms_norm(x, w), backend="eager", fullgraph=True)
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(f(x, w), ops.rms_norm(x, w))
