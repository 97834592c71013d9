"""One-token attention with a fixed key split: core's ``decode_attention`` on CUDA.

A decoder step's query attends to S keys (1,500 encoder frames, or the self-attention cache).
Flash attention splits the keys over more blocks the fewer (batch x heads) there are, so a
row's result depends on the batch it runs in. Here every (row, head) is cut into the same
:data:`SPLITS` pieces whatever the batch: the first kernel computes each piece's running max,
sum and weighted values, the second combines the pieces in a fixed order. The same bits at
every batch size, and B x H x SPLITS programs keep the GPU's bandwidth busy at batch 1 too.
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

SPLITS = 8
BLOCK_S = 64


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial(Q, K, V, MASK, M_OUT, L_OUT, ACC, S, H, scale,
                sqb, sqh, skb, skh, sks, svb, svh, svs, smb, sms,
                CHUNK, HAS_MASK: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_S: tl.constexpr, SPLITS: tl.constexpr):
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
            kv_mask = smask[:, None] & dmask[None, :]
            k = tl.load(K + b * skb + h * skh + s[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
            scores = tl.where(smask, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe)
            v = tl.load(V + b * svb + h * svh + s[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            l_sum = l_sum * alpha + tl.sum(p, axis=0)
            m = m_new
        out = row * SPLITS + split
        tl.store(M_OUT + out, m)
        tl.store(L_OUT + out, l_sum)
        tl.store(ACC + out * BLOCK_D + d, acc)

    @triton.jit
    def combine(M_IN, L_IN, ACC, OUT, H, sob, soh, D: tl.constexpr, BLOCK_D: tl.constexpr,
                SPLITS: tl.constexpr):
        row = tl.program_id(0)
        b = row // H
        h = row % H
        i = tl.arange(0, SPLITS)
        d = tl.arange(0, BLOCK_D)
        m = tl.load(M_IN + row * SPLITS + i)
        l_sum = tl.load(L_IN + row * SPLITS + i)
        acc = tl.load(ACC + (row * SPLITS + i)[:, None] * BLOCK_D + d[None, :])
        m_max = tl.max(m, axis=0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        total = tl.sum(w * l_sum, axis=0)
        o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(OUT + b * sob + h * soh + d, o.to(OUT.dtype.element_ty), mask=d < D)

    return partial, combine


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Core ``decode_attention`` on CUDA: q [B, H, 1, D], k/v [B, H, S, D] (last dim
    contiguous), ``mask`` boolean broadcastable to [B, 1, 1, S] -> [B, H, 1, D]. Other inputs
    (grouped heads, D > 256, ...) take core's reference."""
    B, H, T, D = q.shape
    S = k.shape[2]
    ok = (use_triton(q) and T == 1 and k.shape == v.shape == (B, H, S, D) and D <= 256
          and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
          and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-1] == S
                                and mask.shape[1] == mask.shape[2] == 1 and mask.shape[0] in (1, B))))
    if not ok:
        from polyaccel.core.ops import decode_attention as core_op

        return core_op.reference(q, k, v, mask)
    partial, combine = _kernels()
    block_d = max(16, 1 << (D - 1).bit_length())
    rows = B * H
    m = torch.empty(rows * SPLITS, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(rows * SPLITS * block_d, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    if mask is not None:
        mask_u8 = mask.view(torch.uint8) if mask.is_contiguous() else mask.to(torch.uint8)
        smb = 0 if mask.shape[0] == 1 else mask_u8.stride(0)
        sms = mask_u8.stride(3)
    else:
        mask_u8, smb, sms = q, 0, 0  # never read
    chunk = cdiv(cdiv(S, SPLITS), BLOCK_S) * BLOCK_S  # a whole number of blocks per split
    partial[(rows, SPLITS)](q, k, v, mask_u8, m, l_sum, acc, S, H, D ** -0.5,
                            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                            v.stride(0), v.stride(1), v.stride(2), smb, sms, chunk,
                            HAS_MASK=mask is not None, D=D, BLOCK_D=block_d, BLOCK_S=BLOCK_S, SPLITS=SPLITS)
    combine[(rows,)](m, l_sum, acc, out, H, out.stride(0), out.stride(1), D=D, BLOCK_D=block_d, SPLITS=SPLITS)
    return out
