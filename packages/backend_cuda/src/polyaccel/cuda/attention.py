"""Core ``attention`` on CUDA through ``F.scaled_dot_product_attention`` (flash / cuDNN /
memory-efficient kernels chosen by PyTorch), with the reference's semantics: GQA, a boolean
or additive mask, causal alignment to the end, and zeros (not NaN) for fully masked rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """q [B, NH, Tq, D], k/v [B, NKV, Tk, D] -> [B, NH, Tq, D] in ``q.dtype``."""
    tq, tk = q.shape[-2], k.shape[-2]
    if causal and (mask is not None or tq != tk):
        # SDPA's is_causal aligns the diagonal to the start; ours aligns it to the end.
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, float("-inf"))
        causal = False
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.nan_to_num_(0.0) if mask is not None else out
