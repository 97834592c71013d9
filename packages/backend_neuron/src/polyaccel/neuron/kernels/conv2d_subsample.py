"""Conv2d subsampling: 3x3, stride 2, padding 1, + bias + ReLU, as matmuls on SBUF tiles.

Layouts: x [B, Cin, T, F]; w_k [9 * Cin, Cout] with row (kh * 3 + kw) * Cin + ci (the
PyTorch weight [Cout, Cin, 3, 3] permuted once at load time); bias [Cout, 1]
-> out [B, Cout, ceil(T/2), ceil(F/2)]. Stacking three calls gives the x8 front end.

Tiling. Output rows are processed in blocks of ``rows`` so that rows x F_out <= 512 fp32 (one
PSUM bank, the matmul's moving-size limit). For each block the padded input slab it needs
(2*rows + 1 input rows, F + 2 columns, channels on partitions) is DMA'd into a zeroed SBUF
tile. Then:

* im2col (9 * Cin <= 128, e.g. the first layer, Cin = 1): the nine stride-2 shifted views of
  the slab are copied (SBUF->SBUF DMA) onto 9 * Cin partitions, and one matmul per Cout
  chunk contracts taps and channels together;
* shifted matmuls (wider layers): for every Cin chunk and tap, the strided view
  slab[ci, kh::2, kw::2] is the moving operand and w_k's [ci, Cout] rows for that tap the
  stationary one; all 9 * ceil(Cin/128) products accumulate in the same PSUM tile.

Bias + ReLU run on the Scalar Engine on the way out of PSUM. Weights are loaded once per
call. Writing this by hand (there is no conv2d in the NKI Library) is what let Deepgram
compile batches above 32.
"""

from __future__ import annotations

import math

from polyaccel.neuron.nki_api import kernel

nki = nl = nisa = None  # bound per implementation by nki_api.Kernel.build

P = 128


@kernel
def conv2d_subsample_kernel(x, w_k, bias):
    """NKI 3x3/stride-2 conv + ReLU: see the module docstring for layouts and tiling."""
    B, Cin, T, F = x.shape
    Cout = w_k.shape[1]
    T_out, F_out = (T - 1) // 2 + 1, (F - 1) // 2 + 1
    rows = max(1, min(T_out, 512 // F_out))
    n_ci, n_co = math.ceil(Cin / P), math.ceil(Cout / P)
    im2col = 9 * Cin <= P
    out = nl.ndarray((B, Cout, T_out, F_out), x.dtype, buffer=nl.shared_hbm)

    if im2col:
        w_sb = nl.ndarray((9 * Cin, Cout), w_k.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=w_sb, src=w_k)
    else:
        w_sb = nl.ndarray((P, n_ci, 9, Cout), w_k.dtype, buffer=nl.sbuf)
        for c in range(n_ci):
            cis = min(P, Cin - c * P)
            for tap in range(9):
                r0 = tap * Cin + c * P
                nisa.dma_copy(dst=w_sb[0:cis, c, tap, :], src=w_k[r0:r0 + cis, :])
    b_sb = nl.ndarray((P, n_co), bias.dtype, buffer=nl.sbuf)
    for m in range(n_co):
        cos = min(P, Cout - m * P)
        nisa.dma_copy(dst=b_sb[0:cos, m:m + 1], src=bias[m * P:m * P + cos, :])

    for b in range(B):
        for blk in range(math.ceil(T_out / rows)):
            r0 = blk * rows
            rs = min(rows, T_out - r0)
            top = 2 * r0 - 1  # input row of slab row 0 (row -1 is padding)
            lo, hi = max(0, top), min(T, top + 2 * rs + 1)
            slab = nl.ndarray((P, n_ci, 2 * rows + 1, F + 2), x.dtype, buffer=nl.sbuf)
            for c in range(n_ci):
                cis = min(P, Cin - c * P)
                nisa.memset(dst=slab[0:cis, c, :, :], value=0.0)
                nisa.dma_copy(dst=slab[0:cis, c, lo - top:hi - top, 1:F + 1],
                              src=x[b, c * P:c * P + cis, lo:hi, :])
            if im2col:
                patches = nl.ndarray((9 * Cin, rows, F_out), x.dtype, buffer=nl.sbuf)
                for tap in range(9):
                    kh, kw = divmod(tap, 3)
                    nisa.dma_copy(dst=patches[tap * Cin:(tap + 1) * Cin, 0:rs, :],
                                  src=slab[0:Cin, 0, kh:kh + 2 * rs - 1:2, kw:kw + 2 * F_out - 1:2])
            for m in range(n_co):
                cos = min(P, Cout - m * P)
                acc = nl.ndarray((P, rows, F_out), nl.float32, buffer=nl.psum)
                if im2col:
                    nisa.nc_matmul(dst=acc[0:cos, 0:rs, :], stationary=w_sb[:, m * P:m * P + cos],
                                   moving=patches[:, 0:rs, :])
                else:
                    for c in range(n_ci):
                        cis = min(P, Cin - c * P)
                        for tap in range(9):
                            kh, kw = divmod(tap, 3)
                            nisa.nc_matmul(dst=acc[0:cos, 0:rs, :],
                                           stationary=w_sb[0:cis, c, tap, m * P:m * P + cos],
                                           moving=slab[0:cis, c, kh:kh + 2 * rs - 1:2, kw:kw + 2 * F_out - 1:2])
                y = nl.ndarray((P, rows, F_out), x.dtype, buffer=nl.sbuf)
                nisa.activation(dst=y[0:cos, 0:rs, :], op=nl.relu, data=acc[0:cos, 0:rs, :],
                                bias=b_sb[0:cos, m:m + 1])
                nisa.dma_copy(dst=out[b, m * P:m * P + cos, r0:r0 + rs, :], src=y[0:cos, 0:rs, :])
    return out


def conv2d_subsample(x, weights, biases, stride=2, lengths=None, impl=None):
    """Torch-facing stacked conv2d subsampling with ``ops.conv2d_subsample`` semantics:
    one kernel call per layer (3 layers -> x8), each layer's input zeroed past ``lengths``."""
    import torch

    from polyaccel.core.ops import zero_frames_past

    if stride != 2:
        raise ValueError(f"the NKI conv2d_subsample kernel is stride 2 only, got {stride}")
    for w, bias in zip(weights, biases, strict=True):
        if tuple(w.shape[-2:]) != (3, 3):
            raise ValueError(f"the NKI conv2d_subsample kernel is 3x3 only, got {tuple(w.shape)}")
        cout, cin = w.shape[:2]
        w_k = w.permute(2, 3, 1, 0).reshape(9 * cin, cout).contiguous()
        if bias is None:
            bias = torch.zeros(cout, dtype=w.dtype, device=w.device)
        b = bias.reshape(cout, 1).to(w.dtype)
        if lengths is not None:
            x = zero_frames_past(x, lengths)
            lengths = (lengths + 1) // 2
        x = conv2d_subsample_kernel(x.contiguous(), w_k, b.contiguous(), impl=impl)
    return x


__all__ = ["conv2d_subsample", "conv2d_subsample_kernel"]
