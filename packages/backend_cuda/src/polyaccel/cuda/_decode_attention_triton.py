"""The Triton kernels of :mod:`polyaccel.cuda.decode_attention`, at module level so that both
kernels can call the shared combine (the interpreter does not see helpers in a closure).
Imported only when a kernel first runs: importing it imports Triton."""

import triton
import triton.language as tl

from polyaccel.cuda._fused_decode_triton import attend_block, dependent_start


@triton.jit
def combine_row(M_IN, L_IN, ACC, OUT, row, H, sob, soh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    # The row's pieces in piece order, weighted by exp(piece max - row max).
    b = row // H
    h = row % H
    i = tl.arange(0, SPLITS_P2)
    piece = i < SPLITS
    d = tl.arange(0, BLOCK_D)
    m = tl.load(M_IN + row * SPLITS + i, mask=piece, other=float("-inf"), cache_modifier=".cg")
    l_sum = tl.load(L_IN + row * SPLITS + i, mask=piece, other=0.0, cache_modifier=".cg")
    acc = tl.load(ACC + (row * SPLITS + i)[:, None] * BLOCK_D + d[None, :], mask=piece[:, None], other=0.0,
                  cache_modifier=".cg")
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
    total = tl.sum(w * l_sum, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(OUT + b * sob + h * soh + d, o.to(OUT.dtype.element_ty), mask=d < D)

@triton.jit
def partial(Q, K, V, MASK, M_OUT, L_OUT, ACC, COUNTS, OUT, S, H, scale,
            sqb, sqh, skb, skh, sks, svb, svh, svs, smb, sms, sob, soh,
            CHUNK, HAS_MASK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, ONE_KERNEL: tl.constexpr):
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
                                     m, l_sum, acc)
    out = row * SPLITS + split
    tl.store(M_OUT + out, m)
    tl.store(L_OUT + out, l_sum)
    tl.store(ACC + out * BLOCK_D + d, acc)
    if ONE_KERNEL:
        # COUNTS: zeros, one counter per row, fresh each call. Whichever piece is last, the
        # combine reads all pieces in piece order: the same bits.
        tl.debug_barrier()
        if tl.atomic_add(COUNTS + row, 1, sem="acq_rel") == SPLITS - 1:
            combine_row(M_OUT, L_OUT, ACC, OUT, row, H, sob, soh, D, BLOCK_D, SPLITS, SPLITS_P2)


@triton.jit
def combine(M_IN, L_IN, ACC, OUT, H, sob, soh, D: tl.constexpr, BLOCK_D: tl.constexpr,
            SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    combine_row(M_IN, L_IN, ACC, OUT, tl.program_id(0), H, sob, soh, D, BLOCK_D, SPLITS, SPLITS_P2)
