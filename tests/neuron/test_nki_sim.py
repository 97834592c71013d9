"""The NKI interpreter: instruction semantics and every hardware rule it enforces."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from polyaccel.neuron import sim as nki
from polyaccel.neuron.sim import NKIRuleError

nl, nisa = nki.language, nki.isa
rng = np.random.default_rng()


def _run(body, *arrays):
    """Run ``body(*hbm_args) -> out`` as a kernel; return (result, SimRun)."""

    kernel = nki.jit(body)
    out = kernel(*arrays)
    return out, kernel.last_run


def _rule(excinfo) -> str:
    return excinfo.value.rule


def _matmul_body(k_tiles):
    def body(a, b):  # out = a.T @ b with K split into k_tiles chunks
        K, M = a.shape
        N = b.shape[1]
        out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
        acc = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        step = K // k_tiles
        for k in range(k_tiles):
            at = nl.load(a[k * step:(k + 1) * step, :])
            bt = nl.load(b[k * step:(k + 1) * step, :])
            nisa.nc_matmul(acc, at, bt)
        res = nl.ndarray((M, N), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(res, acc)
        nl.store(out, res)
        return out
    return body


def test_matmul_accumulates_after_first_write_and_counts_dma():
    a = rng.standard_normal((256, 96), dtype=np.float32)
    b = rng.standard_normal((256, 300), dtype=np.float32)
    out, run = _run(_matmul_body(2), a, b)
    np.testing.assert_allclose(out, a.T @ b, rtol=1e-4, atol=1e-4)
    assert run.dma.hbm_to_sbuf == a.nbytes + b.nbytes
    assert run.dma.bytes_from("a") == a.nbytes and run.dma.bytes_from("b") == b.nbytes
    assert run.dma.sbuf_to_hbm == 96 * 300 * 4
    assert run.instructions["nc_matmul"] == 2


def test_matmul_accumulate_flags():
    a = rng.standard_normal((8, 4), dtype=np.float32)

    def body(x, accumulate):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(x)
        acc = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, t, t)
        nisa.nc_matmul(acc, t, t, accumulate=accumulate)
        r = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_copy(r, acc)
        nl.store(out, r)
        return out

    ref = a.T @ a
    np.testing.assert_allclose(_run(lambda x: body(x, None), a)[0], 2 * ref, rtol=1e-5)
    np.testing.assert_allclose(_run(lambda x: body(x, False), a)[0], ref, rtol=1e-5)


@pytest.mark.parametrize("shape_a,shape_b,rule", [
    ((129, 4), (129, 4), "partition-axis"),  # K > 128 cannot even be a tile
    ((64, 129), (64, 8), "matmul-m"),
    ((64, 8), (64, 513), "matmul-n"),
])
def test_matmul_size_limits(shape_a, shape_b, rule):
    def body(a, b):
        at, bt = nl.load(a), nl.load(b)
        acc = nl.ndarray((min(128, shape_a[1]), min(512, shape_b[1])), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, at, bt)

    with pytest.raises(NKIRuleError) as e:
        _run(body, np.zeros(shape_a, np.float32), np.zeros(shape_b, np.float32))
    assert _rule(e) == rule


def test_matmul_operand_and_output_rules():
    a = np.zeros((16, 16), np.float32)

    def psum_input(x):
        t = nl.load(x)
        p = nl.ndarray((16, 16), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(p, t, t)
        nisa.nc_matmul(nl.ndarray((16, 16), nl.float32, buffer=nl.psum), p, t)

    def bf16_output(x):
        t = nl.load(x)
        nisa.nc_matmul(nl.ndarray((16, 16), nl.bfloat16, buffer=nl.psum), t, t)

    def sbuf_output(x):
        t = nl.load(x)
        nisa.nc_matmul(nl.ndarray((16, 16), nl.float32, buffer=nl.sbuf), t, t)

    for body, rule in ((psum_input, "matmul-operand"), (bf16_output, "matmul-output"),
                       (sbuf_output, "matmul-output")):
        with pytest.raises(NKIRuleError) as e:
            _run(body, a)
        assert _rule(e) == rule


def test_psum_bank_and_capacity_and_release():
    with pytest.raises(NKIRuleError) as e:
        _run(lambda: nl.ndarray((128, 513), nl.float32, buffer=nl.psum))
    assert _rule(e) == "psum-bank"

    def nine_live():
        tiles = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum) for _ in range(9)]
        return tiles

    with pytest.raises(NKIRuleError) as e:
        _run(nine_live)
    assert _rule(e) == "psum-capacity"

    def rebinding(x):
        for _ in range(20):  # each iteration's tile is freed when the name is rebound
            p = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
            nisa.memset(p, 1.0)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        return out

    _, run = _run(rebinding, np.zeros(1, np.float32))
    assert run.peak_psum_banks <= 2


def test_sbuf_capacity_tracks_live_allocations():
    def too_much():
        a = nl.ndarray((128, 110 * 1024 // 4), nl.float32)
        b = nl.ndarray((128, 110 * 1024 // 4), nl.float32)
        return a, b

    with pytest.raises(NKIRuleError) as e:
        _run(too_much)
    assert _rule(e) == "sbuf-capacity"

    def freed_in_between():
        a = nl.ndarray((128, 110 * 1024 // 4), nl.float32)
        del a
        b = nl.ndarray((128, 110 * 1024 // 4), nl.float32)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        del b
        return out

    _, run = _run(freed_in_between)
    assert run.peak_sbuf_bytes == 110 * 1024


def test_no_dma_out_of_psum_and_outputs_in_shared_hbm():
    def dma_psum(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        p = nl.ndarray(x.shape, nl.float32, buffer=nl.psum)
        nl.store(out, p)
        return out

    with pytest.raises(NKIRuleError) as e:
        _run(dma_psum, np.zeros((4, 4), np.float32))
    assert _rule(e) == "dma-from-psum"

    for buf in (nl.hbm, nl.sbuf):
        with pytest.raises(NKIRuleError) as e:
            _run(lambda x, buf=buf: nl.ndarray(x.shape, nl.float32, buffer=buf), np.zeros((4, 4), np.float32))
        assert _rule(e) == "output-buffer"


def test_tensor_tensor_psum_and_engine_operand_rules():
    def both_psum():
        p = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        q = nl.ndarray((4, 4), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(nl.ndarray((4, 4), nl.float32), p, q, nl.add)

    with pytest.raises(NKIRuleError) as e:
        _run(both_psum)
    assert _rule(e) == "tensor-tensor-psum"

    def on_hbm(x):
        nisa.activation(nl.ndarray((4, 4), nl.float32), nl.relu, x)

    with pytest.raises(NKIRuleError) as e:
        _run(on_hbm, np.zeros((4, 4), np.float32))
    assert _rule(e) == "engine-operand"


def test_partition_start_rule():
    def body(x):
        t = nl.load(x)
        nisa.tensor_copy(nl.ndarray((48, 4), nl.float32), t[16:64, :])  # 48 partitions from 16

    with pytest.raises(NKIRuleError) as e:
        _run(body, np.zeros((64, 4), np.float32))
    assert _rule(e) == "partition-start"


def test_elementwise_semantics_and_bf16_rounding():
    x = rng.standard_normal((100, 33), dtype=np.float32)
    s = rng.standard_normal((100, 1), dtype=np.float32)

    def body(a, col):
        out = nl.ndarray(a.shape, nl.bfloat16, buffer=nl.shared_hbm)
        t, c = nl.load(a), nl.load(col)
        y = nl.ndarray(a.shape, nl.float32)
        nisa.activation(y, nl.silu, t, bias=c, scale=2.0)
        nisa.tensor_scalar(y, y, nl.multiply, c, op1=nl.subtract, operand1=1.0, reverse1=True)
        nisa.scalar_tensor_tensor(y, t, nl.multiply, c, nl.add, y)
        yb = nl.ndarray(a.shape, nl.bfloat16)
        nisa.tensor_copy(yb, y)
        nl.store(out, yb)
        return out

    out, _ = _run(body, x, s)
    z = 2 * x + s
    ref = 1.0 - (z / (1 + np.exp(-z))) * s + x * s
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, ref.astype(ml_dtypes.bfloat16))


def test_transpose_limits_and_lnc():
    x = rng.standard_normal((64, 100), dtype=np.float32)

    def pe(a):
        out = nl.ndarray((100, 64), nl.float32, buffer=nl.shared_hbm)
        t = nl.load(a)
        p = nl.ndarray((100, 64), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(p, t)
        r = nl.ndarray((100, 64), nl.float32)
        nisa.tensor_copy(r, p)
        nl.store(out, r)
        return out

    kernel = nki.jit(pe)
    np.testing.assert_array_equal(kernel[1](x), x.T)
    np.testing.assert_array_equal(nki.simulate(kernel)(x), x.T)
    with pytest.raises(NotImplementedError):
        kernel[2](x)

    def ve(a):
        t = nl.load(a)
        nisa.nc_transpose(nl.ndarray((100, 64), nl.float32), t)

    with pytest.raises(NKIRuleError) as e:
        _run(ve, x)
    assert _rule(e) == "transpose-size"


def test_nki_api_picks_an_implementation(monkeypatch):
    from polyaccel.neuron import nki_api

    assert nki_api.get("sim") is nki_api.SIM and "sim" in nki_api.available()
    monkeypatch.setenv(nki_api.IMPL_ENV, "sim")
    assert nki_api.get() is nki_api.SIM
    with pytest.raises(ValueError, match="unknown NKI implementation"):
        nki_api.get("triton")
    if not nki_api.real_nki_importable():
        assert nki_api.available() == ["sim"]
        with pytest.raises(ImportError, match="pip install nki"):
            nki_api.get("nki")


def test_kernel_source_is_rebound_per_implementation():
    from polyaccel.neuron import nki_api

    @nki_api.kernel
    def double(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        t = nl.load(a)
        nisa.tensor_scalar(t, t, nl.multiply, 2.0)
        nl.store(out, t)
        return out

    x = rng.standard_normal((5, 7), dtype=np.float32)
    np.testing.assert_array_equal(double(x, impl="sim"), 2 * x)
    assert double.build("sim") is double.build(nki_api.SIM)
    assert double.build("sim").last_run.dma.hbm_to_sbuf == x.nbytes


def test_64_bit_dtypes_are_refused_like_real_nki():
    """The interpreter ran float64/int64 kernels (NumPy can); a NeuronCore has no 64-bit types,
    so such a kernel call passed here and could not compile for the device."""
    def copy(a):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a))
        return out

    with pytest.raises(NKIRuleError, match="kernel argument 'a' has dtype float64") as e:
        _run(copy, np.zeros((4, 4), np.float64))
    assert _rule(e) == "dtype"
    with pytest.raises(NKIRuleError) as e:
        _run(lambda: nl.ndarray((4, 4), np.int64, buffer=nl.sbuf))
    assert _rule(e) == "dtype"
    np.testing.assert_array_equal(_run(copy, np.ones((4, 4), np.int32))[0], np.ones((4, 4), np.int32))


def test_ffn_kernel_on_float64_inputs_is_refused():
    import torch

    from polyaccel.neuron.kernels.ffn import ffn

    x, w1, w2 = torch.zeros(4, 8, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64), \
        torch.zeros(8, 16, dtype=torch.float64)
    with pytest.raises(NKIRuleError, match=r"\[dtype\]"):
        ffn(x, w1, None, w2, None, impl="sim")


def test_a_tile_covers_contiguous_partitions():
    """A stepped slice of the partition axis (every other partition) was accepted; a tile is a
    start partition plus a count, so real NKI cannot express it."""
    def strided(a):
        t = nl.load(a)
        out = nl.ndarray((2, 4), a.dtype, buffer=nl.shared_hbm)
        nl.store(out, t[0:4:2, :])
        return out

    with pytest.raises(NKIRuleError, match="contiguous range of partitions") as e:
        _run(strided, np.zeros((4, 4), np.float32))
    assert _rule(e) == "partition-axis"
