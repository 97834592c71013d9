"""FFN kernel: ``act(x @ w1.T + b1) @ w2.T + b2`` that moves every weight byte from HBM once
per call, however many token tiles there are.

Layouts (weights are transposed once at load time, not per call):
    x [T, H], w1_t [H, F], b1 [F, 1], w2_t [F, H], b2 [H, 1] -> out [T, H] (x's dtype).

Tiling. Tokens are tiled by 128 (``token_tile``). F is cut into 128-row chunks and the chunks
into *groups* whose weights fit in SBUF next to the per-token-tile working set
(:func:`plan`; with several groups, two groups' weights must fit so the next group's load
overlaps the current group's compute). For each group (outer loop) its weight tiles are DMA'd in once; then every
token tile (inner loop) streams past them:

1. load the x tile [t, H] and transpose it on the Tensor Engine to xT [H, t] (H on
   partitions, in 128-row slices), the moving operand of both matmuls;
2. for each F chunk: hT[f, t] = sum over H slices of w1_t[h, f].T @ xT[h, t] in PSUM, then
   act(. + b1) on the Scalar Engine into SBUF (bias is per partition);
3. for each H slice: yT[h, t] = sum over the group's F chunks of w2_t[f, h].T @ hT[f, t].

With one group (weights resident: the common case, e.g. canary-1b-flash in bf16) yT + b2 is
final; it is transposed back to [t, H] and stored. With several groups the partial yT of
every token stays in an fp32 SBUF accumulator across groups, and the last group adds b2 and
stores. Either way weights cross HBM->SBUF exactly once; only x is re-read per group. This
is the schedule that beat a per-token-tile weight reload by 2x at batch 96 (Deepgram, Nova-3).
"""

from __future__ import annotations

import dataclasses
import math

from polyaccel.neuron.nki_api import kernel
from polyaccel.neuron.sim.rules import SBUF_BYTES_PER_PARTITION

nki = nl = nisa = None  # bound per implementation by nki_api.Kernel.build

P = 128


@dataclasses.dataclass(frozen=True)
class FFNPlan:
    """How many 128-row F chunks share one weight load (``group``) and how many groups."""

    group: int
    groups: int


def plan(T: int, H: int, F: int, itemsize: int, sbuf_budget: int = SBUF_BYTES_PER_PARTITION) -> FFNPlan:
    """Pick the F-chunk group size whose weights fit ``sbuf_budget`` bytes per partition."""
    n_h, n_f = math.ceil(H / P), math.ceil(F / P)
    per_chunk = (n_h * P + H + 1 + 2 * P) * itemsize  # w1 cols, w2 rows, b1, hT (double-buffered)
    # x, xT, y tiles double-buffered as the token loop rebinds them; fp32 yT; b2
    fixed = 2 * (2 * H + n_h * P) * itemsize + 2 * P * 4 + n_h * itemsize + 1024
    if fixed + n_f * per_chunk <= sbuf_budget:
        return FFNPlan(n_f, 1)
    fixed += n_h * T * 4  # partial sums of every token, fp32, kept across groups
    # two groups' weights are live at a group boundary: the next loads while the last computes
    group = (sbuf_budget - fixed) // (2 * per_chunk)
    if group < 1:
        raise ValueError(f"FFN H={H}, F={F}, T={T} does not fit SBUF ({sbuf_budget} B/partition): "
                         f"split the tokens over several calls")
    return FFNPlan(group, math.ceil(n_f / group))


@kernel
def ffn_kernel(x, w1_t, b1, w2_t, b2, activation="silu", token_tile=128,
               sbuf_budget=SBUF_BYTES_PER_PARTITION):
    """NKI FFN: see the module docstring for layouts and tiling."""
    T, H = x.shape
    F = w1_t.shape[1]
    wdt = w1_t.dtype
    act = {"silu": nl.silu, "swish": nl.silu, "relu": nl.relu, "gelu": nl.gelu}[activation]
    n_h, n_f, n_t = math.ceil(H / P), math.ceil(F / P), math.ceil(T / token_tile)
    sched = plan(T, H, F, wdt.itemsize, sbuf_budget)

    out = nl.ndarray((T, H), x.dtype, buffer=nl.shared_hbm)
    b2_sb = nl.ndarray((P, n_h), wdt, buffer=nl.sbuf)
    for m in range(n_h):
        ms = min(P, H - m * P)
        nisa.dma_copy(dst=b2_sb[0:ms, m:m + 1], src=b2[m * P:m * P + ms, :])
    if sched.groups > 1:
        acc = nl.ndarray((P, n_h, T), nl.float32, buffer=nl.sbuf)

    for g in range(sched.groups):
        c_lo, c_hi = g * sched.group, min(n_f, (g + 1) * sched.group)
        f_lo, f_hi = c_lo * P, min(F, c_hi * P)
        last = g == sched.groups - 1

        # This group's weights: each byte DMA'd once, reused by every token tile below.
        w1_sb = nl.ndarray((P, n_h, f_hi - f_lo), wdt, buffer=nl.sbuf)
        for k in range(n_h):
            ks = min(P, H - k * P)
            nisa.dma_copy(dst=w1_sb[0:ks, k, :], src=w1_t[k * P:k * P + ks, f_lo:f_hi])
        w2_sb = nl.ndarray((P, c_hi - c_lo, H), wdt, buffer=nl.sbuf)
        b1_sb = nl.ndarray((P, c_hi - c_lo), wdt, buffer=nl.sbuf)
        for j in range(c_hi - c_lo):
            f0 = f_lo + j * P
            fs = min(P, F - f0)
            nisa.dma_copy(dst=w2_sb[0:fs, j, :], src=w2_t[f0:f0 + fs, :])
            nisa.dma_copy(dst=b1_sb[0:fs, j:j + 1], src=b1[f0:f0 + fs, :])

        for t in range(n_t):
            t0 = t * token_tile
            ts = min(token_tile, T - t0)
            x_sb = nl.ndarray((token_tile, H), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=x_sb[0:ts, :], src=x[t0:t0 + ts, :])
            xT = nl.ndarray((P, n_h, token_tile), wdt, buffer=nl.sbuf)
            for k in range(n_h):
                ks = min(P, H - k * P)
                xT_ps = nl.ndarray((P, token_tile), nl.float32, buffer=nl.psum)
                nisa.nc_transpose(dst=xT_ps[0:ks, 0:ts], data=x_sb[0:ts, k * P:k * P + ks])
                nisa.tensor_copy(dst=xT[0:ks, k, 0:ts], src=xT_ps[0:ks, 0:ts])

            hT = nl.ndarray((P, c_hi - c_lo, token_tile), wdt, buffer=nl.sbuf)
            for j in range(c_hi - c_lo):
                fs = min(P, F - (f_lo + j * P))
                h_ps = nl.ndarray((P, token_tile), nl.float32, buffer=nl.psum)
                for k in range(n_h):
                    ks = min(P, H - k * P)
                    nisa.nc_matmul(dst=h_ps[0:fs, 0:ts], stationary=w1_sb[0:ks, k, j * P:j * P + fs],
                                   moving=xT[0:ks, k, 0:ts])
                nisa.activation(dst=hT[0:fs, j, 0:ts], op=act, data=h_ps[0:fs, 0:ts],
                                bias=b1_sb[0:fs, j:j + 1])

            if last:
                y_sb = nl.ndarray((token_tile, H), x.dtype, buffer=nl.sbuf)
            for m in range(n_h):
                ms = min(P, H - m * P)
                y_ps = nl.ndarray((P, token_tile), nl.float32, buffer=nl.psum)
                for j in range(c_hi - c_lo):
                    fs = min(P, F - (f_lo + j * P))
                    nisa.nc_matmul(dst=y_ps[0:ms, 0:ts], stationary=w2_sb[0:fs, j, m * P:m * P + ms],
                                   moving=hT[0:fs, j, 0:ts])
                if sched.groups > 1 and g == 0:
                    nisa.tensor_copy(dst=acc[0:ms, m, t0:t0 + ts], src=y_ps[0:ms, 0:ts])
                elif sched.groups > 1 and not last:
                    nisa.tensor_tensor(dst=acc[0:ms, m, t0:t0 + ts], data1=acc[0:ms, m, t0:t0 + ts],
                                       data2=y_ps[0:ms, 0:ts], op=nl.add)
                if last:
                    yT = nl.ndarray((P, token_tile), nl.float32, buffer=nl.sbuf)
                    if sched.groups > 1:
                        nisa.tensor_tensor(dst=yT[0:ms, 0:ts], data1=acc[0:ms, m, t0:t0 + ts],
                                           data2=y_ps[0:ms, 0:ts], op=nl.add)
                        nisa.activation(dst=yT[0:ms, 0:ts], op=nl.copy, data=yT[0:ms, 0:ts],
                                        bias=b2_sb[0:ms, m:m + 1])
                    else:
                        nisa.activation(dst=yT[0:ms, 0:ts], op=nl.copy, data=y_ps[0:ms, 0:ts],
                                        bias=b2_sb[0:ms, m:m + 1])
                    y_ps2 = nl.ndarray((token_tile, P), nl.float32, buffer=nl.psum)
                    nisa.nc_transpose(dst=y_ps2[0:ts, 0:ms], data=yT[0:ms, 0:ts])
                    nisa.tensor_copy(dst=y_sb[0:ts, m * P:m * P + ms], src=y_ps2[0:ts, 0:ms])
            if last:
                nisa.dma_copy(dst=out[t0:t0 + ts, :], src=y_sb[0:ts, :])
    return out


def ffn(x, w1, b1, w2, b2, activation="silu", impl=None):
    """Torch-facing FFN with ``ops.ffn`` semantics (x [..., H], w1 [F, H], w2 [H, F]).

    Runs the kernel through ``impl`` (see :mod:`polyaccel.neuron.nki_api`); weights are
    transposed here, which a model does once at load time.
    """
    import torch

    lead, H = x.shape[:-1], x.shape[-1]
    F = w1.shape[0]
    wdt = w1.dtype
    b1 = b1 if b1 is not None else torch.zeros(F, dtype=wdt, device=w1.device)
    b2 = b2 if b2 is not None else torch.zeros(H, dtype=wdt, device=w1.device)
    out = ffn_kernel(x.reshape(-1, H).contiguous(), w1.t().contiguous(), b1.reshape(F, 1).to(wdt),
                              w2.t().contiguous(), b2.reshape(H, 1).to(wdt), activation, impl=impl)
    return out.reshape(*lead, H)


__all__ = ["FFNPlan", "ffn", "ffn_kernel", "plan"]
