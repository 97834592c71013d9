"""NKI kernels against core's reference ops, on fresh random inputs, through every NKI
implementation available here (our interpreter always; the real ``nki.simulate`` when the
Neuron SDK is installed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyaccel.core import ops
from polyaccel.neuron import nki_api
from polyaccel.neuron.kernels import conv2d_subsample as conv2d_mod
from polyaccel.neuron.kernels import depthwise_conv1d as dw_mod
from polyaccel.neuron.kernels import ffn as ffn_mod
from polyaccel.neuron.kernels import fused_qkv as qkv_mod
from polyaccel.neuron.sim import NKIRuleError

IMPLS = [pytest.param("sim"), pytest.param("nki", marks=pytest.mark.skipif(
    not nki_api.real_nki_importable(), reason="the Neuron SDK's nki is not importable here (not on PyPI)"))]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Max error relative to the reference's scale, bounded by the dtype's tolerance."""
    assert out.shape == ref.shape and out.dtype == dtype
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item() + 1e-6
    assert err / scale < TOL[dtype], f"relative error {err / scale:.3g} (abs {err:.3g})"


def _ffn_inputs(T, H, F, dtype, bias=True):
    w = lambda *s, fan: (torch.randn(*s) / fan ** 0.5).to(dtype)
    return (torch.randn(T, H).to(dtype), w(F, H, fan=H), torch.randn(F).to(dtype) if bias else None,
            w(H, F, fan=F), torch.randn(H).to(dtype) if bias else None)


def _ffn_ref(x, w1, b1, w2, b2, activation="silu"):
    f = lambda t: None if t is None else t.float()
    return ops.ffn.reference(x.float(), w1.float(), f(b1), w2.float(), f(b2), activation)


# ---- FFN ------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T,H,F,dtype,act", [
    (200, 96, 300, torch.float32, "silu"),
    (130, 256, 520, torch.bfloat16, "silu"),
    (1, 64, 128, torch.float32, "relu"),
    (257, 200, 130, torch.bfloat16, "gelu"),
])
def test_ffn_matches_reference(impl, T, H, F, dtype, act):
    x, w1, b1, w2, b2 = _ffn_inputs(T, H, F, dtype, bias=act != "relu")
    out = ffn_mod.ffn(x, w1, b1, w2, b2, act, impl=impl)
    _close(out, _ffn_ref(x, w1, b1, w2, b2, act), dtype)


@pytest.mark.parametrize("T", [1, 128, 300, 1000])
def test_ffn_moves_each_weight_byte_once_per_call(T):
    """DMA counter: weight bytes read == weight size, at any number of token tiles."""
    H, F = 192, 640
    x, w1, b1, w2, b2 = _ffn_inputs(T, H, F, torch.bfloat16)
    out = ffn_mod.ffn(x, w1, b1, w2, b2, impl="sim")
    _close(out, _ffn_ref(x, w1, b1, w2, b2), torch.bfloat16)
    run = ffn_mod.ffn_kernel.build("sim").last_run
    for name, t in (("w1_t", w1), ("w2_t", w2), ("b1", b1), ("b2", b2)):
        assert run.dma.bytes_from(name) == t.numel() * t.element_size(), name
    assert run.dma.bytes_from("x") == x.numel() * 2
    assert run.dma.sbuf_to_hbm == T * H * 2


def test_ffn_streams_weight_groups_when_sbuf_is_small():
    """Weights that do not fit: F-chunk groups in the outer loop, token tiles inner, fp32
    partial sums across groups; weights still cross HBM once, x once per group."""
    T, H, F = 300, 160, 700
    x, w1, b1, w2, b2 = _ffn_inputs(T, H, F, torch.float32)
    budget = 16 * 1024
    sched = ffn_mod.plan(T, H, F, 4, budget)
    assert sched.groups > 1
    kernel = ffn_mod.ffn_kernel
    out = kernel(x, w1.t().contiguous(), b1.reshape(F, 1), w2.t().contiguous(), b2.reshape(H, 1),
                 "silu", 128, budget, impl="sim")
    _close(out, _ffn_ref(x, w1, b1, w2, b2), torch.float32)
    run = kernel.build("sim").last_run
    assert run.dma.bytes_from("w1_t") == w1.numel() * 4
    assert run.dma.bytes_from("w2_t") == w2.numel() * 4
    assert run.dma.bytes_from("x") == x.numel() * 4 * sched.groups
    assert run.peak_sbuf_bytes <= budget


def test_ffn_bad_tiling_is_caught():
    x, w1, b1, w2, b2 = _ffn_inputs(300, 64, 128, torch.float32)
    with pytest.raises(NKIRuleError) as e:  # 256 tokens on the partition axis
        ffn_mod.ffn_kernel(x, w1.t().contiguous(), b1.reshape(-1, 1), w2.t().contiguous(), b2.reshape(-1, 1),
                           "silu", 256, impl="sim")
    assert e.value.rule == "partition-axis"


# ---- depthwise conv1d --------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,C,T,K,pad,dtype", [
    (2, 200, 700, 31, None, torch.float32),  # ragged channels (200 = 128 + 72) and time (700 > 512)
    (3, 64, 37, 3, None, torch.bfloat16),
    (1, 130, 50, 5, 0, torch.float32),  # "valid" padding
    (1, 16, 9, 15, None, torch.float32),  # kernel wider than half the sequence
])
def test_depthwise_conv1d_matches_reference(impl, B, C, T, K, pad, dtype):
    x, w, b = torch.randn(B, C, T).to(dtype), torch.randn(C, 1, K).to(dtype), torch.randn(C).to(dtype)
    out = dw_mod.depthwise_conv1d(x, w, b, pad, impl=impl)
    ref = ops.depthwise_conv1d.reference(x.float(), w.float(), b.float(), pad)
    _close(out, ref, dtype)


def test_depthwise_conv1d_uses_vector_engine_macs_only():
    x, w = torch.randn(1, 128, 100), torch.randn(128, 7)
    dw_mod.depthwise_conv1d(x, w, None, impl="sim")
    run = dw_mod.depthwise_conv1d_kernel.build("sim").last_run
    assert run.instructions["nc_matmul"] == 0
    assert run.instructions["scalar_tensor_tensor"] == 6  # K - 1 MACs after the first tap
    assert run.dma.bytes_from("w") == w.numel() * 4


# ---- conv2d subsampling ----------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_subsample_x8_matches_reference(impl, dtype):
    """Three stacked layers: Cin=1 (im2col path), then 144 channels (shifted matmuls, ragged
    over 128), odd time and frequency sizes."""
    x = torch.randn(2, 1, 45, 27).to(dtype)
    ws = [torch.randn(16, 1, 3, 3) / 3, torch.randn(144, 16, 3, 3) / 12, torch.randn(40, 144, 3, 3) / 36]
    ws = [w.to(dtype) for w in ws]
    bs = [torch.randn(16).to(dtype), torch.randn(144).to(dtype), None]
    out = conv2d_mod.conv2d_subsample(x, ws, bs, impl=impl)
    ref = ops.conv2d_subsample.reference(x.float(), [w.float() for w in ws],
                                         [None if b is None else b.float() for b in bs])
    _close(out, ref, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_conv2d_subsample_zeroes_each_layers_input_past_the_lengths(impl):
    """With ``lengths``, frames past each row's length (halved per layer) are cleared before
    each layer, as core's reference does: a padded row gives what the unpadded one gives."""
    x = torch.randn(2, 1, 45, 27)
    ws = [torch.randn(16, 1, 3, 3) / 3, torch.randn(24, 16, 3, 3) / 12]
    bs = [torch.randn(16), torch.randn(24)]
    lengths = torch.tensor([45, 19])
    out = conv2d_mod.conv2d_subsample(x, ws, bs, lengths=lengths, impl=impl)
    _close(out, ops.conv2d_subsample.reference(x, ws, bs, lengths=lengths), torch.float32)
    alone = ops.conv2d_subsample.reference(x[1:, :, :19], ws, bs)
    _close(out[1:, :, :alone.shape[2]], alone, torch.float32)


def test_conv2d_subsample_loads_weights_once():
    x, w, b = torch.randn(3, 4, 64, 40), torch.randn(8, 4, 3, 3), torch.randn(8)
    conv2d_mod.conv2d_subsample(x, [w], [b], impl="sim")
    run = conv2d_mod.conv2d_subsample_kernel.build("sim").last_run
    assert run.dma.bytes_from("w_k") == w.numel() * 4
    # x is read once, plus the one-row halo each block of output rows shares with the next
    assert x.numel() * 4 <= run.dma.bytes_from("x") <= 1.1 * x.numel() * 4


# ---- fused QKV -----------------------------------------------------------------------------

@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,T,H,NH,NKV,D,dtype", [
    (2, 100, 192, 4, 2, 48, torch.float32),  # GQA, 200 tokens, 384 columns
    (1, 130, 256, 6, 6, 64, torch.bfloat16),  # 1152 columns: chunks straddle q|k|v
])
def test_fused_qkv_matches_reference(impl, B, T, H, NH, NKV, D, dtype):
    n_out = (NH + 2 * NKV) * D
    x, w, b = torch.randn(B, T, H).to(dtype), (torch.randn(n_out, H) / H ** 0.5).to(dtype), torch.randn(n_out).to(dtype)
    got = qkv_mod.fused_qkv(x, w, b, NH, NKV, impl=impl)
    ref = ops.fused_qkv.reference(x.float(), w.float(), b.float(), NH, NKV)
    for g, r in zip(got, ref):
        _close(g, r, dtype)
    if impl == "sim":
        assert qkv_mod.fused_qkv_kernel.build("sim").last_run.dma.bytes_from("w_t") == n_out * H * w.element_size()


# ---- registration ----------------------------------------------------------------------------

def test_plugin_registers_nki_kernels_for_neuron_device():
    from polyaccel.core import registry
    from polyaccel.neuron import plugin

    plugin.polyaccel_register_kernels(backend=plugin.NeuronBackend(), registry=registry)
    try:
        for op in ("ffn", "fused_qkv", "depthwise_conv1d", "conv2d_subsample"):
            impl = registry.implementations(op)["neuron"]
            assert impl.impl == "nki" and impl.backend == "neuron"
        # CPU tensors still take the reference path
        x = torch.randn(3, 8)
        w1, w2 = torch.randn(16, 8), torch.randn(8, 16)
        torch.testing.assert_close(ops.ffn(x, w1, None, w2, None), ops.ffn.reference(x, w1, None, w2, None))
    finally:
        for op in ("ffn", "fused_qkv", "depthwise_conv1d", "conv2d_subsample"):
            registry.unregister(op, "neuron")


@pytest.mark.neuron_hw
def test_kernels_on_a_neuron_device():
    """On a Trainium instance: the registered kernels on ``neuron`` tensors (TorchNeuron)."""
    pytest.importorskip("torch_neuronx", reason="needs torch-neuronx on a Trainium instance")
    dev = torch.device("neuron")
    x, w1, b1, w2, b2 = _ffn_inputs(300, 256, 1024, torch.bfloat16)
    out = ffn_mod.ffn(*(t.to(dev) for t in (x, w1, b1, w2, b2))).cpu()
    _close(out, _ffn_ref(x, w1, b1, w2, b2), torch.bfloat16)
    x, w = torch.randn(2, 256, 300).bfloat16(), torch.randn(256, 1, 31).bfloat16()
    out = dw_mod.depthwise_conv1d(x.to(dev), w.to(dev)).cpu()
    _close(out, ops.depthwise_conv1d.reference(x.float(), w.float()), torch.bfloat16)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), C=st.integers(1, 140), T=st.integers(1, 40), K=st.sampled_from([1, 3, 5, 9]),
       pad=st.one_of(st.none(), st.integers(0, 4)), seed=st.integers(0, 2**31 - 1))
def test_depthwise_conv1d_random_shapes(B, C, T, K, pad, seed):
    if pad is not None and T + 2 * pad < K:
        pad = K
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(B, C, T, generator=g), torch.randn(C, K, generator=g), torch.randn(C, generator=g)
    out = dw_mod.depthwise_conv1d(x, w, b, pad, impl="sim")
    _close(out, ops.depthwise_conv1d.reference(x, w, b, pad), torch.float32)


# ---- argument checks: what the reference refuses, the kernels refuse (never a silent subset) ----

@pytest.mark.parametrize("w_shape,nh,nkv", [
    ((13, 8), 2, 1),  # 13 columns are not (2 + 2 * 1) * D: the kernel dropped the last one
    ((12, 10), 2, 1),  # w's H (10) is not x's H (8): the kernel read 8 of 10 weight columns
])
def test_fused_qkv_refuses_weights_of_the_wrong_shape(w_shape, nh, nkv):
    x, w = torch.randn(1, 3, 8), torch.randn(*w_shape)
    with pytest.raises(RuntimeError):
        ops.fused_qkv.reference(x, w, None, nh, nkv)
    with pytest.raises(ValueError, match="w_qkv must be"):
        qkv_mod.fused_qkv(x, w, None, nh, nkv, impl="sim")


@pytest.mark.parametrize("w_shape,pad,match", [
    ((6, 1, 3), None, "same C"),  # 6 channels of taps for x's 4: the kernel used the first 4
    ((4, 1, 3), -1, "padding must be >= 0"),  # -1 was the kernel's "same" sentinel
])
def test_depthwise_conv1d_refuses_what_the_reference_refuses(w_shape, pad, match):
    x, w = torch.randn(1, 4, 10), torch.randn(*w_shape)
    with pytest.raises(RuntimeError):
        ops.depthwise_conv1d.reference(x, w, None, pad)
    with pytest.raises(ValueError, match=match):
        dw_mod.depthwise_conv1d(x, w, None, pad, impl="sim")
