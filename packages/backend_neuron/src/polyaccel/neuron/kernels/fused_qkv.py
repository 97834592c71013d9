"""Fused QKV projection: one matmul pass over x for Q, K and V, written out split.

Layouts: x [N, H] (tokens flattened), w_t [H, n_out] with n_out = Oq + 2 * Okv (the PyTorch
``w_qkv`` [n_out, H] transposed once at load time), b [1, n_out]
-> q [N, Oq], k [N, Okv], v [N, Okv] (x's dtype); the wrapper views them as heads.

Tiling. Here tokens sit on the output's partitions: with the x tile transposed to
xT [H, t] (Tensor Engine, 128-row H slices) as the *stationary* operand (t <= 128) and
weight columns as the *moving* one (<= 512 per matmul), PSUM holds out[t, 512] row-major,
so no transpose is needed on the way out. The bias rides along as one more K=1 matmul
(ones[1, t].T @ b[1, cols]) into the same PSUM accumulation. Weight columns are grouped to
fit SBUF (normally one group: all of w_t resident) and each group is loaded once; token
tiles stream past it. An output chunk that straddles the q|k|v boundaries is stored with
one DMA per piece.
"""

from __future__ import annotations

import math

from polyaccel.neuron.nki_api import kernel
from polyaccel.neuron.sim.rules import SBUF_BYTES_PER_PARTITION

nki = nl = nisa = None  # bound per implementation by nki_api.Kernel.build

P = 128
COLS = 512  # moving free size per matmul


def column_group(H: int, n_out: int, itemsize: int, sbuf_budget: int = SBUF_BYTES_PER_PARTITION) -> int:
    """How many weight columns (a multiple of 512) stay resident in SBUF per load."""
    n_h = math.ceil(H / P)
    fixed = 2 * (H + n_h * P + COLS) * itemsize + P * 4 + 1024  # x, xT, out tiles (double-buffered), ones
    per_col = (n_h + 1) * itemsize  # w_t column slices + bias
    cols = (sbuf_budget - fixed) // per_col // COLS * COLS
    if cols < COLS:
        raise ValueError(f"fused QKV H={H} does not fit SBUF ({sbuf_budget} B/partition)")
    return min(cols, math.ceil(n_out / COLS) * COLS)


@kernel
def fused_qkv_kernel(x, w_t, b, q_size, kv_size, sbuf_budget=SBUF_BYTES_PER_PARTITION):
    """NKI fused QKV: see the module docstring for layouts and tiling."""
    N, H = x.shape
    n_out = w_t.shape[1]
    n_h, n_t = math.ceil(H / P), math.ceil(N / P)
    group = column_group(H, n_out, w_t.dtype.itemsize, sbuf_budget)
    q = nl.ndarray((N, q_size), x.dtype, buffer=nl.shared_hbm)
    k = nl.ndarray((N, kv_size), x.dtype, buffer=nl.shared_hbm)
    v = nl.ndarray((N, kv_size), x.dtype, buffer=nl.shared_hbm)
    parts = ((q, 0), (k, q_size), (v, q_size + kv_size))  # (output, first column)

    ones = nl.ndarray((1, P), w_t.dtype, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for g in range(math.ceil(n_out / group)):
        g0, g1 = g * group, min(n_out, (g + 1) * group)
        w_sb = nl.ndarray((P, n_h, g1 - g0), w_t.dtype, buffer=nl.sbuf)
        for kk in range(n_h):
            ks = min(P, H - kk * P)
            nisa.dma_copy(dst=w_sb[0:ks, kk, :], src=w_t[kk * P:kk * P + ks, g0:g1])
        b_sb = nl.ndarray((1, g1 - g0), b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b_sb, src=b[0:1, g0:g1])

        for t in range(n_t):
            t0 = t * P
            ts = min(P, N - t0)
            x_sb = nl.ndarray((P, H), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb[0:ts, :], src=x[t0:t0 + ts, :])
            xT = nl.ndarray((P, n_h, P), w_t.dtype, buffer=nl.sbuf)
            for kk in range(n_h):
                ks = min(P, H - kk * P)
                xT_ps = nl.ndarray((P, P), nl.float32, buffer=nl.psum)
                nisa.nc_transpose(dst=xT_ps[0:ks, 0:ts], data=x_sb[0:ts, kk * P:kk * P + ks])
                nisa.tensor_copy(dst=xT[0:ks, kk, 0:ts], src=xT_ps[0:ks, 0:ts])
            for c0 in range(g0, g1, COLS):
                cw = min(COLS, g1 - c0)
                acc = nl.ndarray((P, COLS), nl.float32, buffer=nl.psum)
                for kk in range(n_h):
                    ks = min(P, H - kk * P)
                    nisa.nc_matmul(dst=acc[0:ts, 0:cw], stationary=xT[0:ks, kk, 0:ts],
                                   moving=w_sb[0:ks, kk, c0 - g0:c0 - g0 + cw])
                nisa.nc_matmul(dst=acc[0:ts, 0:cw], stationary=ones[0:1, 0:ts],
                               moving=b_sb[0:1, c0 - g0:c0 - g0 + cw])
                y = nl.ndarray((P, COLS), x.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=y[0:ts, 0:cw], src=acc[0:ts, 0:cw])
                for dst, first in parts:
                    lo, hi = max(c0, first), min(c0 + cw, first + dst.shape[1])
                    if hi > lo:
                        nisa.dma_copy(dst=dst[t0:t0 + ts, lo - first:hi - first], src=y[0:ts, lo - c0:hi - c0])
    return q, k, v


def fused_qkv(x, w_qkv, b_qkv, num_heads, num_kv_heads=None, impl=None):
    """Torch-facing fused QKV with ``ops.fused_qkv`` semantics:
    x [B, T, H] -> q [B, NH, T, D], k, v [B, NKV, T, D]."""
    import torch

    num_kv_heads = num_kv_heads or num_heads
    B, T, H = x.shape
    n_out = w_qkv.shape[0]
    D = _head_dim(H, tuple(w_qkv.shape), num_heads, num_kv_heads)
    if b_qkv is None:
        b_qkv = torch.zeros(n_out, dtype=w_qkv.dtype, device=w_qkv.device)
    b = b_qkv.reshape(1, n_out).to(w_qkv.dtype)
    q, k, v = fused_qkv_kernel(x.reshape(B * T, H).contiguous(), w_qkv.t().contiguous(),
                                        b.contiguous(), num_heads * D, num_kv_heads * D, impl=impl)
    return (q.view(B, T, num_heads, D).transpose(1, 2), k.view(B, T, num_kv_heads, D).transpose(1, 2),
            v.view(B, T, num_kv_heads, D).transpose(1, 2))


def _head_dim(H: int, w_shape: tuple[int, ...], num_heads: int, num_kv_heads: int) -> int:
    """The head size D for ``w_qkv`` [(NH + 2*NKV) * D, H]; raises if ``w_shape`` is not that
    (the kernel would otherwise read part of the weight and drop columns silently)."""
    heads = num_heads + 2 * num_kv_heads
    if len(w_shape) != 2 or w_shape[1] != H or w_shape[0] % heads or not w_shape[0]:
        raise ValueError(f"fused_qkv: w_qkv must be [(num_heads + 2 * num_kv_heads) * D, H] = "
                         f"[{heads} * D, {H}], got {list(w_shape)}")
    return w_shape[0] // heads


__all__ = ["column_group", "fused_qkv", "fused_qkv_kernel"]
