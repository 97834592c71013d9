"""The Triton kernels of :mod:`polyaccel.cuda.decode_attention`, at module level so that they
can call the online-softmax block shared with the cached self-attention (the interpreter does
not see helpers in a closure).
Imported only when a kernel first runs: importing it imports Triton."""

import triton
import triton.language as tl

from polyaccel.cuda._fused_decode_triton import attend_block, dependent_start


@triton.jit
def partial(Q, K, V, MASK, KS, VS, M_OUT, L_OUT, ACC, S, H, scale,
            sqb, sqh, skb, skh, sks, svb, svh, svs, smb, sms, ssb, ssh, sss,
            CHUNK, HAS_MASK: tl.constexpr, SCALED: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    row = tl.program_id(0)  # b * H + h
    split = tl.program_id(1)
    b = row // H
    h = row % H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * sqb + h * sqh + d, mask=dmask, other=0.0).to(tl.float32) * scale
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, S)
    for start in range(lo, hi, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        smask = s < hi
        if HAS_MASK:
            smask = smask & (tl.load(MASK + b * smb + s * sms, mask=smask, other=0) != 0)
        m, l_sum, acc = attend_block(K + b * skb + h * skh, V + b * svb + h * svh, sks, svs, q, s, smask, d, dmask,
                                     m, l_sum, acc, KS + b * ssb + h * ssh, VS + b * ssb + h * ssh, sss, SCALED)
    out = row * SPLITS + split
    tl.store(M_OUT + out, m)
    tl.store(L_OUT + out, l_sum)
    tl.store(ACC + out * BLOCK_D + d, acc)


@triton.jit
def combine(M_IN, L_IN, ACC, OUT, H, sob, soh, D: tl.constexpr, BLOCK_D: tl.constexpr,
            SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    # The row's pieces in piece order, weighted by exp(piece max - row max).
    row = tl.program_id(0)
    b = row // H
    h = row % H
    i = tl.arange(0, SPLITS_P2)
    piece = i < SPLITS
    d = tl.arange(0, BLOCK_D)
    m = tl.load(M_IN + row * SPLITS + i, mask=piece, other=float("-inf"))
    l_sum = tl.load(L_IN + row * SPLITS + i, mask=piece, other=0.0)
    acc = tl.load(ACC + (row * SPLITS + i)[:, None] * BLOCK_D + d[None, :], mask=piece[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(w * l_sum, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b * sob + h * soh + d, o.to(OUT.dtype.element_ty), mask=d < D)
