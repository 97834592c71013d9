"""Core ``causal_attention`` on CUDA through FlashAttention-4's CuTe kernels, where installed.

FlashAttention-4 (package ``flash-attn-4``, module ``flash_attn.cute``) has Hopper (sm90) and
Blackwell (sm100) forward and backward kernels that take the [B, S, H, D] layout the
projections produce and GQA in the kernel (no K/V repeat, no transposes). On an H200, causal,
head dim 128, seq 4096 (``tools/bench_attention.py``) its forward runs ~1.6x cuDNN's; its
backward is ahead for GQA shapes and behind for some MHA ones, so models choose per shape
(``polyaccel.moe``'s ``attn="auto"``).

The kernels are wrapped as two ``torch.library`` custom ops with autograd, so compiled layers
keep them in one graph and CUDA graphs capture them. Inputs FlashAttention-4 cannot take (off
CUDA, not fp16/bf16, other GPU generations, head dims it does not build) take core's reference.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

INSTALL_HINT = "pip install 'polyaccel-backend-cuda[fa4]' (flash-attn-4 and the CUTLASS DSL)"


@functools.cache
def fa4_installed() -> bool:
    """Whether the ``flash_attn.cute`` package can be found (not imported: that takes seconds)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _interface():  # noqa: ANN202
    try:
        from flash_attn.cute import interface
    except ModuleNotFoundError as e:
        raise ImportError(f"FlashAttention-4 is not importable ({e}): {INSTALL_HINT}") from e
    return interface


@functools.cache
def _arch_ok(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FlashAttention-4 takes these [B, S, H, D] inputs here."""
    if not (fa4_installed() and q.is_cuda and q.dim() == 4 and k.dim() == 4 and v.dim() == 4):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not (q.dtype == k.dtype == v.dtype):
        return False
    d, dv = q.shape[-1], v.shape[-1]
    if not (8 <= d <= 256 and 8 <= dv <= 256 and d % 8 == 0 and dv % 8 == 0):
        return False
    if k.shape[2] == 0 or q.shape[2] % k.shape[2] or q.shape[1] != k.shape[1]:
        return False
    return _arch_ok(q.device.index or 0)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("polyaccel_cuda::fa4_causal_fwd", mutates_args=())
def fa4_causal_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention forward: (out [B, S, NH, Dv], log-sum-exp [B, NH, S] fp32)."""
    out, lse, *_ = _interface()._flash_attn_fwd(_last_dim_contiguous(q), _last_dim_contiguous(k),
                                                _last_dim_contiguous(v), softmax_scale=scale, causal=True,
                                                return_lse=True)
    return out, lse


@fa4_causal_fwd.register_fake
def _(q, k, v, scale):  # noqa: ANN001, ANN202
    b, s, nh, _ = q.shape
    return q.new_empty(b, s, nh, v.shape[-1]), q.new_empty(b, nh, s, dtype=torch.float32)


@torch.library.custom_op("polyaccel_cuda::fa4_causal_bwd", mutates_args=())
def fa4_causal_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention backward: (dq, dk, dv) shaped as q, k, v."""
    dq, dk, dv = _interface()._flash_attn_bwd(q, k, v, out, _last_dim_contiguous(dout), lse,
                                               softmax_scale=scale, causal=True,
                                               deterministic=torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv


@fa4_causal_bwd.register_fake
def _(dout, q, k, v, out, lse, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v), out, lse)
    ctx.scale = scale


def _backward(ctx, dout, dlse):  # noqa: ANN001, ANN202
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = fa4_causal_bwd(dout, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


fa4_causal_fwd.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Core ``causal_attention`` on CUDA: FlashAttention-4 where :func:`supports` says so,
    else core's reference (SDPA)."""
    if not supports(q, k, v):
        from polyaccel.core.ops import causal_attention as core_op

        return core_op.reference(q, k, v, scale)
    return fa4_causal_fwd(q, k, v, float(scale if scale is not None else q.shape[-1] ** -0.5))[0]
