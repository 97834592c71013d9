"""One-token attention with a fixed key split: core's ``decode_attention`` on CUDA.

A decoder step's query attends to S keys (1,500 encoder frames, or the self-attention cache).
Flash attention splits the keys over more blocks the fewer (batch x heads) there are, so a
row's result depends on the batch it runs in. Here every (row, head) is cut into the same
pieces whatever the batch (:class:`SplitConfig`): a program per piece computes its running
max, sum and weighted values, and a second kernel combines the pieces in a fixed order.
The same bits at every batch size, and B x H x splits programs keep the GPU's bandwidth busy at batch 1 too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polyaccel.cuda._triton import cdiv, dependent_launch, triton_kernels, use_triton


class SplitConfig(NamedTuple):
    """How a (row, head)'s keys are cut: ``splits`` pieces read ``block_s`` keys at a time,
    ``num_warps`` per program. Never chosen by the batch (a row's bits must not depend on it)."""

    splits: int = 3
    block_s: int = 512
    num_warps: int = 8


CONFIG = SplitConfig(3, 512, 8)
"""The launch bf16/fp16 keys take. On an H200 over 1,500 keys (20 heads of 64; 2026-12-03, 60
launches swept, docs/benchmarks.md) it matched the best at 1 row (5.3 us) and was the fastest
at 16 and 128 rows (37.5 / 232 us against the earlier 12 pieces of 128 keys' 46 / 291 us)."""

FP8_CONFIG = SplitConfig(3, 512, 4)
"""The launch e4m3 keys and values (``k_scale``/``v_scale``) take: with half the bytes per key,
four warps keep more programs resident (24.4 / 144 us at 16 / 128 rows against eight warps'
28 / 176; 5.0 us at 1 row)."""


def config_for(head_dim: int, scaled: bool) -> SplitConfig:
    """The launch a head dim takes (never the batch): :data:`FP8_CONFIG` for e4m3 keys,
    else :data:`CONFIG`, with at most 32K values in a [keys, head dim] fp32 tile (head dim
    128: 256 keys a load), and four warps from head dim 128 on. On an H200 over canary's 375
    frames of 8 heads of 128 (2026-12-03, docs/benchmarks.md) four warps took 6.2 / 10.0 /
    66.0 us at 1 / 16 / 128 rows against eight warps' 5.7 / 11.4 / 89.2."""
    splits, block_s, num_warps = FP8_CONFIG if scaled else CONFIG
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    return SplitConfig(splits, min(block_s, 32768 // max(block_d, 64)), 4 if block_d >= 128 else num_warps)


@triton_kernels
def _kernels():
    from polyaccel.cuda import _decode_attention_triton  # imports Triton

    return _decode_attention_triton


def _scales_ok(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, B: int, H: int, S: int) -> bool:
    if k_scale is None and v_scale is None:
        return True
    return (k_scale is not None and v_scale is not None and k_scale.shape == v_scale.shape == (B, H, S)
            and k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.stride() == v_scale.stride())


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, config: SplitConfig | None = None) -> torch.Tensor:
    """Core ``decode_attention`` on CUDA: q [B, H, 1, D], k/v [B, H, S, D] (last dim
    contiguous; e4m3 with ``k_scale``/``v_scale`` [B, H, S] fp32, the same strides), ``mask``
    boolean broadcastable to [B, 1, 1, S] -> [B, H, 1, D]; ``config`` (default :data:`CONFIG`)
    the key split. Other inputs (grouped heads, D > 256, ...) take core's reference."""
    B, H, T, D = q.shape
    S = k.shape[2]
    ok = (use_triton(q) and T == 1 and k.shape == v.shape == (B, H, S, D) and D <= 256
          and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and _scales_ok(k_scale, v_scale, B, H, S)
          and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[-1] == S
                                and mask.shape[1] == mask.shape[2] == 1 and mask.shape[0] in (1, B))))
    if not ok:
        from polyaccel.core.ops import decode_attention as core_op

        return core_op.reference(q, k, v, mask, k_scale, v_scale)
    scaled = k_scale is not None
    splits, block_s, num_warps = config or config_for(D, scaled)
    block_d = max(16, 1 << (D - 1).bit_length())
    splits = min(splits, cdiv(S, block_s))  # no piece without a key (short caches)
    kernels = _kernels()
    rows = B * H
    m = torch.empty(rows * splits, device=q.device, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = torch.empty(rows * splits * block_d, device=q.device, dtype=torch.float32)
    out = torch.empty(B, H, 1, D, device=q.device, dtype=q.dtype)
    if mask is not None:
        mask_u8 = mask.view(torch.uint8) if mask.is_contiguous() else mask.to(torch.uint8)
        smb = 0 if mask.shape[0] == 1 else mask_u8.stride(0)
        sms = mask_u8.stride(3)
    else:
        mask_u8, smb, sms = q, 0, 0  # never read
    chunk = cdiv(cdiv(S, splits), block_s) * block_s  # a whole number of blocks per piece
    shape = dict(D=D, BLOCK_D=block_d, SPLITS=splits, SPLITS_P2=1 << (splits - 1).bit_length(),
                 **dependent_launch(q.device))
    ks, vs = (k_scale, v_scale) if scaled else (m, m)  # never read without scales
    kernels.partial[(rows, splits)](q, k, v, mask_u8, ks, vs, m, l_sum, acc, S, H, D ** -0.5,
                                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                                    v.stride(0), v.stride(1), v.stride(2), smb, sms,
                                    *(ks.stride() if scaled else (0, 0, 0)), chunk,
                                    HAS_MASK=mask is not None, SCALED=scaled, BLOCK_S=block_s,
                                    num_warps=num_warps, **shape)
    kernels.combine[(rows,)](m, l_sum, acc, out, H, out.stride(0), out.stride(1), **shape)
    return out
