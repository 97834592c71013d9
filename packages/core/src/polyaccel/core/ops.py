"""Reference implementations of polyaccel's named kernel ops (plain PyTorch, any device).

Each function here is an op (see :mod:`polyaccel.core.kernels`): calling it runs the
backend's registered kernel for the input's device if there is one, else this body.

Shape legend: B batch, T time/tokens, H hidden (model dim), C channels, E experts,
K reduction dim, N output dim, D head dim, NH heads, k experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from polyaccel.core.kernels import registry

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation_fn(name: str):
    """The elementwise activation called ``name`` (silu/swish, gelu, gelu_tanh, relu)."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(_ACTIVATIONS)}") from None


@registry.define
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@registry.define
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@registry.define
def ffn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
        b2: torch.Tensor | None, activation: str = "silu") -> torch.Tensor:
    """Two-layer feed-forward: ``act(x @ w1.T + b1) @ w2.T + b2``.

    x [..., H], w1 [F, H], w2 [H, F]. The conformer and Whisper FFN.
    """
    return F.linear(activation_fn(activation)(F.linear(x, w1, b1)), w2, b2)


@registry.define
def swiglu(gate_up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up[..., :I]`` is gate and ``gate_up[..., I:]`` is up.

    ``num_valid`` (a 0-dim tensor, 2-D ``gate_up``): rows from there on are dropped copies
    (:func:`moe_permute`); their output and gradient are unspecified, so a backend may skip
    them. This reference computes every row."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@registry.define
def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A learned MoE router's choice: ``softmax(logits)`` in fp32, its ``top_k`` largest per row
    (weights fp32 [T, k], expert ids int64 [T, k], largest first), renormalised to sum 1 when
    ``renormalize``. Differentiable in ``logits`` through the weights."""
    w, idx = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


@registry.define
def fused_qkv(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, num_heads: int,
              num_kv_heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One projection for Q, K and V, split into heads.

    x [B, T, H], w_qkv [(NH + 2*NKV) * D, H] -> q [B, NH, T, D], k, v [B, NKV, T, D].
    """
    num_kv_heads = num_kv_heads or num_heads
    B, T, _ = x.shape
    qkv = F.linear(x, w_qkv, b_qkv)
    D = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    return (q.view(B, T, num_heads, D).transpose(1, 2),
            k.view(B, T, num_kv_heads, D).transpose(1, 2),
            v.view(B, T, num_kv_heads, D).transpose(1, 2))


@registry.define
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
              causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Softmax attention. q [B, NH, Tq, D], k/v [B, NKV, Tk, D] (NKV divides NH).

    ``mask`` is boolean (True = attend) or additive float, broadcastable to [B, NH, Tq, Tk].
    ``causal`` aligns the diagonal to the end (query i sees keys <= i + Tk - Tq).
    """
    nh, nkv = q.shape[1], k.shape[1]
    if nkv != nh:
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    tq, tk = q.shape[-2], k.shape[-2]
    if causal:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows give zeros, not NaN
    return torch.matmul(probs, v.float()).to(q.dtype)


@registry.define
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal self-attention in the [batch, sequence, heads, dim] layout models project into.

    q [B, S, NH, D], k [B, S, NKV, D], v [B, S, NKV, Dv] (NKV divides NH) -> [B, S, NH, Dv]:
    query i sees keys 0..i; no mask, no cache. Differentiable. This reference is
    ``F.scaled_dot_product_attention`` on transposed views; a backend may register a flash
    kernel that takes the layout as it is (FlashAttention-4 on CUDA where installed).
    """
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, scale=scale, enable_gqa=k.shape[2] != q.shape[2])
    return out.transpose(1, 2)


@registry.define
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row: q [B, H, 1, D], k/v [B, H, S, D], ``mask``
    boolean (True = attend) broadcastable to [B, 1, 1, S] -> [B, H, 1, D].

    With ``k_scale``/``v_scale`` [B, H, S] fp32, k and v are e4m3 rows (``rows_to_fp8`` per
    key), each standing for ``row * scale``; the attention then runs in fp32.

    Backends implement it with kernels whose result for a row does not depend on the batch
    (no key split chosen by batch x heads), so a decoder step gives the same bits at every
    batch size. The reference is SDPA; a row with every key masked gives zeros (a padding row
    of a batch), not NaN.
    """
    if (k_scale is None) != (v_scale is None):
        raise ValueError("decode_attention: give both k_scale and v_scale, or neither")
    if k_scale is not None:
        k, v = (t.float() * s.unsqueeze(-1) for t, s in ((k, k_scale), (v, v_scale)))
        out = F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if mask is None else out.nan_to_num(0.0)


@registry.define
def cached_decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                            position: torch.Tensor) -> torch.Tensor:
    """One query token per row against a self-attention cache: q [B, H, 1, D], cache_k/v
    [B, H, C, D], position [B] (read on the device) -> [B, H, 1, D]. Row b attends to cache
    positions ``0..position[b]``; later positions are never read."""
    visible = torch.arange(cache_k.shape[2], device=position.device) <= position[:, None]
    return decode_attention(q, cache_k, cache_v, visible[:, None, None, :])


@registry.define
def ln_linear(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LayerNorm, a linear layer and an activation: ``act(layer_norm(x) @ weight.T + bias)``.

    x [..., K], weight [N, K] -> [..., N] in ``x.dtype``, then cast to ``out_dtype`` if given.
    A decoder step's pre-LN projections; backends fuse the norm into the GEMM's prologue.
    """
    y = F.linear(layer_norm(x, ln_weight, ln_bias, eps), weight, bias)
    if activation is not None:
        y = activation_fn(activation)(y)
    return y if out_dtype is None else y.to(out_dtype)


@registry.define
def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T + bias``: x [..., K], weight [N, K], residual [..., N]."""
    return residual + F.linear(x, weight, bias)


@registry.define
def ln_qkv_into_cache_(x: torch.Tensor, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, eps: float,
                       weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                       cache_k: torch.Tensor, cache_v: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """A decoder step's self-attention input: LayerNorm, then the q, k and v projections
    (``weights`` and ``biases`` in that order, each [H * D, K]; a bias may be None). k and v
    are written into ``cache_k``/``cache_v`` [B, H, C, D] at ``position`` [B] (read on the
    device); q is returned as [B, H, 1, D]. x [B, K] or [B, 1, K]."""
    B, H, _, D = cache_k.shape
    h = layer_norm(x.reshape(B, -1), ln_weight, ln_bias, eps)
    q, k, v = (F.linear(h, w, b).view(B, H, 1, D) for w, b in zip(weights, biases, strict=True))
    where = position.view(B, 1, 1, 1).expand_as(k)
    cache_k.scatter_(2, where, k)
    cache_v.scatter_(2, where, v)
    return q


@registry.define
def greedy_pick(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy decoding step's choice: for each row of ``logits + bias`` in fp32 (logits
    [B, V], bias [V] fp32, ``-inf`` to suppress a token), the index of its first largest value
    [B] int64 and that value's log-probability [B] fp32. Rows holding NaN: unspecified."""
    scores = logits.float() + bias
    best = scores.argmax(dim=-1)
    return best, torch.log_softmax(scores, dim=-1).gather(1, best[:, None])[:, 0]


@registry.define
def greedy_advance_(logits: torch.Tensor, bias: torch.Tensor, tokens: torch.Tensor, position: torch.Tensor,
                    finished: torch.Tensor, logprob_sum: torch.Tensor, counted: torch.Tensor, out: torch.Tensor,
                    step: torch.Tensor, eos_id: int) -> None:
    """A greedy step's choice and bookkeeping, in place: :func:`greedy_pick` of each row, its
    log-probability added to ``logprob_sum`` and 1 to ``counted`` for rows not ``finished``;
    the choice (``eos_id`` for finished rows) stored in ``out`` [B, T] at column ``step``
    (clamped to T - 1) and in ``tokens``; ``finished`` set on ``eos_id``; ``position`` + 1.
    ``step`` [1] is read, not advanced. tokens/position/out int64, finished bool, sums fp32."""
    best, logprob = greedy_pick(logits, bias)
    live = (~finished).float()
    logprob_sum.add_(logprob * live)
    counted.add_(live)
    best = best.masked_fill(finished, eos_id)
    column = step.clamp(max=out.shape[1] - 1).expand(best.shape[0], 1)
    out.scatter_(1, column, best[:, None])
    finished.logical_or_(best == eos_id)
    tokens.copy_(best)
    position.add_(1)


E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: each row's absolute maximum maps onto it."""


@registry.define
def rows_to_fp8(x: torch.Tensor, prologue: str = "none", ln_weight: torch.Tensor | None = None,
                ln_bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [..., K] in e4m3 with its own scale, for an FP8 GEMM's input: ->
    (q [M, K] ``float8_e4m3fn``, scale [M, 1] fp32) with ``q * scale`` about the row, M the
    number of rows. ``prologue`` is applied first, in fp32: ``"none"``, ``"gelu"`` (erf; a
    backend may take its tanh form, within 4.8e-4) or ``"layer_norm"`` (with
    ``ln_weight``/``ln_bias``, ``eps``). The scale maps the row's
    absolute maximum to :data:`E4M3_MAX` (an all-zero row: a tiny scale, zeros)."""
    xf = x.reshape(-1, x.shape[-1]).float()
    if prologue == "layer_norm":
        w, b = (None if t is None else t.float() for t in (ln_weight, ln_bias))
        xf = F.layer_norm(xf, (xf.shape[-1],), w, b, eps)
    elif prologue == "gelu":
        xf = F.gelu(xf)
    elif prologue != "none":
        raise ValueError(f"unknown prologue {prologue!r}; known: none, gelu, layer_norm")
    # times the fp32 reciprocals, never divided: division by a scalar is a multiplication on
    # some devices and a division on others, and a kernel should be able to match either bit for bit
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) * (1 / E4M3_MAX)
    return (xf * scale.reciprocal()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


@registry.define
def depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     padding: int | None = None) -> torch.Tensor:
    """Depthwise 1-D convolution over time. x [B, C, T], weight [C, 1, K] or [C, K].

    ``padding`` defaults to ``(K - 1) // 2`` on both sides ("same" for odd K).
    """
    w = weight if weight.dim() == 3 else weight.unsqueeze(1)
    pad = (w.shape[-1] - 1) // 2 if padding is None else padding
    return F.conv1d(x, w, bias, padding=pad, groups=x.shape[1])


def zero_frames_past(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``x`` [B, C, T, F] with the frames ``t >= lengths[b]`` of each row zeroed (a new tensor,
    in ``x``'s dtype): how ``conv2d_subsample`` clears each layer's input."""
    valid = torch.arange(x.shape[2], device=x.device)[None, :] < lengths.to(x.device)[:, None]
    return x * valid[:, None, :, None].to(x.dtype)


@registry.define
def conv2d_subsample(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                     stride: int = 2, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Stacked conv2d (3x3, stride 2, padding 1) + ReLU, one per weight: x [B, Cin, T, F].

    Three layers give the x8 time subsampling of conformer front ends. Returns
    [B, Cout, T / stride**n, F / stride**n] (rounded up per layer). With ``lengths`` [B]
    (valid frames of dim 2), each layer's input is zero at and past its row's length (which
    is divided by ``stride``, rounded up, per layer): past a length the previous layer left
    ReLU(bias), and a frame's receptive field must see what it would see with no padding.
    """
    for w, b in zip(weights, biases, strict=True):
        if lengths is not None:
            x = zero_frames_past(x, lengths)
            lengths = (lengths + stride - 1) // stride
        x = F.relu(F.conv2d(x, w, b, stride=stride, padding=w.shape[-1] // 2))
    return x


@registry.define
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group linear: rows ``offsets[g-1]:offsets[g]`` of x times ``w[g].T``.

    x [T, K] (rows sorted by group), w [E, N, K] (the ``F.linear`` layout, as Transformers
    v5 stores ``gate_up_proj``/``down_proj``), offsets int32 [E] cumulative row ends.
    Returns [T, N]; rows past ``offsets[-1]`` are zero.
    """
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[g])
        start = end
    return out


@registry.define
def grouped_lowrank_add_(out: torch.Tensor, u: torch.Tensor, factor: torch.Tensor, offsets: torch.Tensor
                         ) -> torch.Tensor:
    """``out[rows of g] += u[rows of g] @ factor[g]`` in place: a rank-r update per group.

    out [T, N], u [T, r] (rows sorted by group), factor [E, r, N] (any strides), offsets int32
    [E] cumulative row ends; rows past ``offsets[-1]`` are left as they are. Products and the
    sum in fp32 (fp64 inputs: fp64), one rounding to ``out``'s dtype. Returns ``out``. (A LoRA adapter's
    ``(x·A)·B`` added into the base GEMM's output without writing the [T, N] delta.)
    """
    T, N = out.shape
    if u.dim() != 2 or u.shape[0] != T or factor.dim() != 3 or factor.shape[1:] != (u.shape[1], N):
        raise ValueError(f"grouped_lowrank_add_: out [T, N] {tuple(out.shape)}, u [T, r] {tuple(u.shape)} and "
                         f"factor [E, r, N] {tuple(factor.shape)} do not fit together")
    ends = offsets.tolist()
    if len(ends) != factor.shape[0] or any(b < a for a, b in zip([0, *ends], ends, strict=False)) or \
            (ends and ends[-1] > T):
        raise ValueError(f"grouped_lowrank_add_: offsets must be {factor.shape[0]} non-decreasing row ends "
                         f"from 0 to at most {T}, got {ends[:8]}{' ...' if len(ends) > 8 else ''}")
    acc = torch.promote_types(out.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            rows = slice(start, end)
            out[rows] = (out[rows].to(acc) + u[rows].to(acc) @ factor[g].to(acc)).to(out.dtype)
        start = end
    return out


@registry.define
def grouped_mm_wgrad(dy: torch.Tensor | Sequence[torch.Tensor], x: torch.Tensor | Sequence[torch.Tensor],
                     offsets: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor | None = None,
                     accumulate: bool = True, sumsq: torch.Tensor | None = None) -> torch.Tensor:
    """Weight gradient of :func:`grouped_mm`: ``dy_g.T @ x_g`` per group, [G, N, K].

    dy [T, N], x [T, K] (rows sorted by group), offsets int32 [G] cumulative row ends. With
    ``out`` given, the product is added into it in place (``accumulate=False``: written over
    it) and ``out`` is returned: gradient accumulation fused into the GEMM (Megatron's trick),
    so a micro-batch's expert weight gradient is never materialized beside ``.grad``.

    ``dy``, ``x`` and ``offsets`` may also be equally long lists, one entry per micro-batch:
    the result is the sum over them, formed in fp32 and rounded once (one pass over ``out``
    for several micro-batches). Products are formed in fp32.

    ``sumsq`` (one fp32 element): set to the sum of squares of the result as stored, so that
    a gradient norm needs no second pass over it (the sum's order is up to the backend, fixed
    for a given shape).
    """
    dys, xs, offs = (list(t) if isinstance(t, (list, tuple)) else [t] for t in (dy, x, offsets))
    if not len(dys) == len(xs) == len(offs) >= 1:
        raise ValueError(f"grouped_mm_wgrad: {len(dys)} dy, {len(xs)} x and {len(offs)} offsets")
    if sumsq is not None and (sumsq.dtype != torch.float32 or sumsq.numel() != 1):
        raise ValueError("grouped_mm_wgrad: sumsq must be one fp32 element")
    G, N, K = offs[0].numel(), dys[0].shape[1], xs[0].shape[1]
    res = out if out is not None else dys[0].new_zeros(G, N, K)
    acc_dtype = torch.promote_types(res.dtype, torch.float32)
    total = torch.zeros(G, N, K, device=res.device, dtype=acc_dtype)
    for d, xx, o in zip(dys, xs, offs, strict=True):
        start = 0
        for g, end in enumerate(o.tolist()):
            if end > start:
                total[g] += d[start:end].to(acc_dtype).T @ xx[start:end].to(acc_dtype)
            start = end
    if out is not None and accumulate:
        total += res
    res.copy_(total)
    if sumsq is not None:
        sumsq.copy_(res.to(acc_dtype).square().sum().reshape(sumsq.shape))
    return res


@registry.define
def moe_permute(x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token copies by expert for grouped GEMM.

    x [T, H], topk_idx [T, k] -> (x_sorted [T*k, H], order [T*k], counts [E]). ``order[i]``
    is the flat (token * k + slot) index of row i of ``x_sorted``; the sort is stable, so
    each expert sees its tokens in original order.

    Copies whose expert id is ``>= num_experts`` are dropped (e.g. routed to experts on other
    ranks): they sort last and are not counted; their rows of ``x_sorted`` (past
    ``counts.sum()``) are zeros here and may hold anything on an accelerator, and no gradient
    flows back from them.
    """
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add rather than bincount: no host sync, traceable without a graph break
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.clamp(max=num_experts), torch.ones_like(flat, dtype=torch.int64))[:num_experts]
    x_sorted = x.index_select(0, order // topk_idx.shape[1])
    rows = torch.arange(order.numel(), device=x.device)
    x_sorted = torch.where((rows < counts.sum())[:, None], x_sorted, x_sorted.new_zeros(()))  # dropped copies
    return x_sorted, order, counts


@registry.define
def moe_unpermute(y_sorted: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor,
                  num_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`moe_permute` with the top-k combine: out[t] = sum_j w[t, j] * y[t, j].

    y_sorted [T*k, H], order [T*k], topk_weights [T, k] -> [T, H] in ``y_sorted.dtype``.
    ``num_valid`` (a 0-dim tensor, read where it lives): rows of ``y_sorted`` from there on
    (dropped copies, never computed) count as zeros and are not read; their gradient is
    unspecified, and the weight gradient of their copies is zero.
    """
    T, k = topk_weights.shape
    if num_valid is not None:
        rows = torch.arange(y_sorted.shape[0], device=y_sorted.device)
        y_sorted = torch.where((rows < num_valid)[:, None], y_sorted, y_sorted.new_zeros(()))
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    y = y.view(T, k, -1)
    return (y.float() * topk_weights.unsqueeze(-1).float()).sum(1).to(y_sorted.dtype)


@registry.define
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` (the LM head plus loss).

    hidden [N, H], weight [V, H], labels [N]. Backends may compute this in chunks so that
    the [N, V] logits never exist in fp32.
    """
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


@registry.define
def linear_cross_entropy_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean", chunk: int = 1024,
                               grad_hidden: bool = True, grad_weight: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`linear_cross_entropy`'s loss and its gradients for an upstream gradient of 1,
    ``(loss, d loss/d hidden or None, d loss/d weight or None)``, formed during the forward
    ``chunk`` rows at a time (no autograd graph; at most a [chunk, V] fp32 block of logits at
    once). For callers that scale and place the gradients themselves. ``reduction``: ``"mean"``
    (over non-ignored labels) or ``"sum"``; backends may pick their own chunking.
    """
    scale = _ce_scale("linear_cross_entropy_grads", labels, ignore_index, reduction)
    N = hidden.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if grad_hidden else None
    grad_w = None
    for start in range(0, N, chunk):
        h, y = hidden[start:start + chunk], labels[start:start + chunk]
        loss_sum, g = _ce_rows(F.linear(h, weight).float(), y, ignore_index, scale, grad_hidden or grad_weight)
        total = total + loss_sum
        if g is None:
            continue
        g = g.to(hidden.dtype)
        if grad_hidden:
            grad_h[start:start + chunk] = g @ weight
        if grad_weight:
            gw = g.t() @ h
            if grad_w is None:
                grad_w = gw if N <= chunk else gw.float()
            else:
                grad_w += gw
    if grad_weight and grad_w is None:  # no rows
        grad_w = torch.zeros_like(weight)
    loss = total if scale is None else total * scale
    return loss, grad_h, grad_w.to(weight.dtype) if grad_w is not None else None


@registry.define
def linear_cross_entropy_logit_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     ignore_index: int = -100, reduction: str = "mean"
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`linear_cross_entropy`'s loss, ``d loss/d hidden`` [N, H] and ``d loss/d logits``
    [N, V] (in ``hidden``'s dtype) for an upstream gradient of 1, the [N, V] block formed at
    once. For callers that form the weight's gradient later themselves
    (``grad_logits.T @ hidden``, times the upstream gradient once it is known: added straight
    into ``weight.grad`` by the GEMM instead of through a separate pass over a [V, H] tensor).
    """
    scale = _ce_scale("linear_cross_entropy_logit_grads", labels, ignore_index, reduction)
    total, g = _ce_rows(F.linear(hidden, weight).float(), labels, ignore_index, scale, True)
    g = g.to(hidden.dtype)
    return (total if scale is None else total * scale), g @ weight, g


def _ce_scale(op: str, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor | None:
    """1 / the counted labels for ``mean`` (a device tensor), None for ``sum``."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'mean' or 'sum', got {reduction!r}")
    return 1.0 / (labels != ignore_index).sum().clamp_min(1).float() if reduction == "mean" else None


def _ce_rows(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, scale: torch.Tensor | None,
             grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed loss of the fp32 ``logits`` rows, their gradient times ``scale`` or None): the
    logits are overwritten."""
    valid = labels != ignore_index
    y_safe = torch.where(valid, labels, torch.zeros_like(labels))
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, y_safe[:, None]).squeeze(1)
    total = torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
    if not grad:
        return total, None
    g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
    g.scatter_add_(1, y_safe[:, None], -torch.ones_like(lse)[:, None])
    g = g * valid[:, None]
    return total, g if scale is None else g * scale


@registry.define
def add_scaled_(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out += x * scale`` in place, ``scale`` a 0-dim tensor read where it lives (no host
    synchronization); fp32 math, one rounding to ``out``'s dtype. Returns ``out``."""
    return out.add_(x.float().mul_(scale.float()))


@registry.define
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                zero_grad: bool = False, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step, in place, over flat tensors of equal length: torch.optim.AdamW's math.

    ``p *= 1 - lr*wd``; ``m = lerp(m, g, 1 - beta1)``; ``v = beta2*v + (1 - beta2)*g*g``;
    ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with ``bc = 1 - beta**step`` (``step`` >= 1
    counts this step). Computed in fp32, stored in each tensor's dtype. ``zero_grad`` also
    writes zeros into ``grad`` (the next accumulation starts from zero with no separate memset).
    ``grad_scale``: a 0-dim tensor the gradient is multiplied by first (gradient clipping's
    coefficient, read where it lives: no host sync and no separate pass over the gradients).
    """
    if step < 1:
        raise ValueError(f"adamw_step_: step must be >= 1 (this step's count), got {step}")
    n = param.numel()
    if any(t.numel() != n for t in (grad, exp_avg, exp_avg_sq)):
        raise ValueError("adamw_step_: param, grad, exp_avg and exp_avg_sq must have the same length")
    p, g, m, v = param.float(), grad.float(), exp_avg.float(), exp_avg_sq.float()  # fp32: no copies
    if grad_scale is not None:
        g = g * grad_scale.float()
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    p.addcdiv_(m, (v.sqrt() / bias_correction2_sqrt).add_(eps), value=-lr / bias_correction1)
    for out, val in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        if out is not val:
            out.copy_(val)
    if zero_grad:
        grad.zero_()


def adamw_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> list[float]:
    """The seven numbers one AdamW step needs, formed in double as torch does:
    ``[1 - lr*wd, 1 - beta1, beta2, 1 - beta2, lr / bc1, sqrt(bc2), eps]`` (the kernels' arguments)."""
    if step < 1:
        raise ValueError(f"adamw_scalars: step must be >= 1 (this step's count), got {step}")
    return [1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, lr / (1.0 - beta1**step),
            math.sqrt(1.0 - beta2**step), eps]
