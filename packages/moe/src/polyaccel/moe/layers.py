"""Building blocks shared by polyaccel's MoE models: norms, rotary embedding, attention,
router/gates, fused experts, the sparse MoE block, and the losses.

Parameters are named and shaped exactly as in Transformers v5 (``mlp.gate.weight [E, H]``,
``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) so v5's
checkpoint conversion applies unchanged. Compute goes through ``polyaccel.core.ops`` so a
hardware backend's kernels plug in.

Shape legend: B batch, S sequence, T tokens (B*S), H hidden, E experts, k experts per token,
I expert FFN width, NH query heads, NKV key/value heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyaccel.core import ops
from polyaccel.moe.grouped_linear import fusable, grouped_linear
from polyaccel.moe.lora import LoraFactors, dense_lora, grouped_lora_linear, merged_weight, unwrap_peft

# ---------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: statistics in fp32, output in the input dtype.

    ``impl="torch"`` reproduces Transformers' formula bit for bit (scale applied in the input
    dtype); ``impl="fused"`` calls ``polyaccel.core.ops.rms_norm`` (scale applied in fp32), which
    a backend may replace with a fused kernel.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.impl = "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "fused":
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, impl={self.impl}"


# ---------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------


class RotaryEmbedding(nn.Module):
    """Rotary position embedding: ``(cos, sin)`` in fp32 for given positions.

    Computed once per forward and shared by every layer. ``rope_type`` ``"default"`` is
    computed here; static scaled variants (``linear``, ``yarn``, ``llama3``, ...) take their
    inverse frequencies from Transformers' ``ROPE_INIT_FUNCTIONS``.
    """

    #: rope types whose frequencies change with the sequence length (not supported here)
    DYNAMIC_TYPES = ("dynamic", "longrope")

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.rope_type = rope_type(config)
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [D/2] (fp32) and the cos/sin scale for this config."""
        if self.rope_type != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, None)
        base = self.config.rope_parameters["rope_theta"]
        dim = head_dim(self.config)
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, S] -> cos, sin [B, S, D] in fp32."""
        freqs = position_ids.float()[..., None] * self.inv_freq.float().to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rope_type(config: Any) -> str:
    """The config's rope type (``"default"`` when it does not say)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type", "default")


def head_dim(config: Any) -> int:
    """Attention head size: ``config.head_dim`` if set, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleaved: bool = False, heads_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, NH, S, D] and k [B, NKV, S, D] by cos/sin [B, S, D] (math in fp32);
    with ``heads_first=False``, q [B, S, NH, D] and k [B, S, NKV, D].

    ``interleaved``: the checkpoint pairs dims (0, 1), (2, 3), ... (DeepSeek) instead of
    (i, i + D/2); they are de-interleaved first, the same permutation for q and k.
    """
    cos, sin = (cos[:, None], sin[:, None]) if heads_first else (cos[:, :, None], sin[:, :, None])

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if interleaved:
            xf = torch.cat((xf[..., 0::2], xf[..., 1::2]), dim=-1)
        x1, x2 = xf.chunk(2, dim=-1)
        return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    return rotate(q), rotate(k)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class AttentionContext:
    """What every attention layer of one forward shares.

    attention_mask: None (all tokens real), a 2-D padding mask [B, past + S] (1 = real), or a
        ready 4-D mask (bool, True = attend, or additive float) broadcastable to [B, NH, S, Sk].
    past_key_values: a Transformers ``Cache`` or None.
    sliding_window: keys further back than this many positions are not attended (None: off).
    impl: the ``BackendConfig.attn`` choice (``"auto"`` resolved by the model's forward).
    """

    attention_mask: torch.Tensor | None = None
    past_key_values: Any = None
    sliding_window: int | None = None
    impl: str = "sdpa"


def self_attention(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], ctx: AttentionContext) -> torch.Tensor:
    """Causal self-attention with RoPE, KV cache and GQA.

    q [B, S, NH, D], k/v [B, S, NKV, D] -> [B, S, NH * D]. ``module.layer_idx`` names the
    layer in the cache; ``module.scaling`` is the softmax scale.
    """
    B, S = q.shape[:2]
    if ctx.impl == "fa4" and plain_causal(ctx, S) and getattr(module, "te_attention", None) is None:
        # The backend's flash kernel takes [B, S, H, D] as projected: rotate in that layout too,
        # so that compiled layers hand it the layout it was traced with (no copies).
        q, k = apply_rotary(q, k, *rope, heads_first=False)
        return ops.causal_attention(q, k, v, module.scaling).reshape(B, S, -1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rotary(q, k, *rope)
    past = 0
    if ctx.past_key_values is not None:
        past = ctx.past_key_values.get_seq_length(module.layer_idx)
        k, v = ctx.past_key_values.update(k, v, module.layer_idx)
    te_attn = getattr(module, "te_attention", None)
    if te_attn is not None and ctx.attention_mask is None and ctx.sliding_window is None and past == 0:
        out = te_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.reshape(B, S, -1)
    return causal_sdpa(q, k, v, ctx, past, module.scaling).transpose(1, 2).reshape(B, S, -1)


def plain_causal(ctx: AttentionContext, seq: int) -> bool:
    """Whether ``seq`` new tokens attend causally to themselves alone: no padding mask, no
    cache, no sliding window shorter than the sequence."""
    return (ctx.attention_mask is None and ctx.past_key_values is None and seq > 1
            and (ctx.sliding_window is None or ctx.sliding_window >= seq))


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext, past: int,
                scale: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with the context's causal/padding/window mask.

    q [B, NH, S, D], k [B, NKV, Sk, D], v [B, NKV, Sk, Dv] (NKV divides NH; Sk = cached + new
    keys, ``past`` = tokens seen before this call) -> [B, NH, S, Dv].
    """
    B, _, S, _ = q.shape
    mask, dead = mask_and_dead_rows(ctx, B, S, k.shape[-2], past, q.device)
    if ctx.impl == "fa4" and mask is None and dead is None and k.shape[-2] == S and S > 1:
        # The backend's flash kernel (FlashAttention-4 on CUDA) takes [B, S, H, D] as projected.
        return ops.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale).transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    # On CUDA only flash (no masks) and math kernels take GQA; repeat K/V for cuDNN and for
    # masked calls, where the memory-efficient kernel beats math.
    if gqa and q.is_cuda and (ctx.impl == "cudnn" or mask is not None):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    with sdpa_backend(ctx.impl, q.device):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and S > 1,
                                             scale=scale, enable_gqa=gqa)
    return out if dead is None else out.masked_fill(dead, 0.0)


def attention_mask_for(ctx: AttentionContext, batch: int, q_len: int, kv_len: int, past: int,
                       device: torch.device) -> torch.Tensor | None:
    """The SDPA mask for one layer, or None when plain causal (``is_causal``) is exact.

    Query i sits at absolute position ``past + i``; key j at ``past + q_len - kv_len + j``
    (a sliding-window cache keeps only the last keys). A query that would see no key (left
    padding) attends everywhere instead: :func:`causal_sdpa` zeroes its output.
    """
    return mask_and_dead_rows(ctx, batch, q_len, kv_len, past, device)[0]


def mask_and_dead_rows(ctx: AttentionContext, batch: int, q_len: int, kv_len: int, past: int,
                       device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`attention_mask_for`'s mask and, for a 2-D padding mask, which queries see no key
    ([B, 1, S, 1] bool; None otherwise): their output must be zeros, as in Transformers. A fully
    masked row can give NaN in fused kernels, so such a query attends everywhere and its
    output, and with it every gradient through it, is zeroed after the attention."""
    keep = _keep_mask(ctx, batch, q_len, kv_len, past, device)
    if keep is None or ctx.attention_mask is None or ctx.attention_mask.dim() != 2:
        return keep, None
    dead = ~keep.any(-1, keepdim=True)
    return keep | dead, dead


def _keep_mask(ctx: AttentionContext, batch: int, q_len: int, kv_len: int, past: int,
               device: torch.device) -> torch.Tensor | None:
    """Which keys each query sees (a ready 4-D mask as given), or None when plain causal
    (``is_causal``) is exact; a left-padding query's row is all False."""
    m = ctx.attention_mask
    if m is not None and m.dim() == 4:
        return m
    # A window at least as long as every position so far hides no key.
    window = ctx.sliding_window if ctx.sliding_window is not None and ctx.sliding_window < past + q_len else None
    if m is None and window is None and kv_len == q_len:
        return None
    if m is None and window is None and q_len == 1:
        return None  # one new token attends to every cached key
    q_pos = torch.arange(q_len, device=device) + past
    k_pos = torch.arange(kv_len, device=device) + (past + q_len - kv_len)
    keep = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
    keep = keep[None, None].expand(batch, 1, q_len, kv_len)
    if m is not None:
        keep = keep & m[:, None, None, -kv_len:].bool()
    return keep


def sdpa_backend(impl: str, device: torch.device):
    """Context that forces the SDPA backend named by ``BackendConfig.attn`` (CUDA only)."""
    if device.type != "cuda" or impl in ("auto", "sdpa", "te", "fa4"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[impl])


# ---------------------------------------------------------------------------------------------
# Router / gates
# ---------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Picks k experts per token.

    ``mode="learned"``: softmax (fp32) over ``x @ weight.T``, top-k, renormalised to sum 1
    when ``norm_topk_prob`` (Qwen3-MoE and OLMoE when configured; Mixtral always).
    ``mode="balanced"``: the benchmark gate, see :func:`balanced_routing`; ``weight`` stays
    (so checkpoints round-trip) but is unused.

    Returns router logits [T, E] (None for the balanced gate), weights [T, k] fp32 and
    expert indices [T, k] int64.
    """

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.mode = "learned"
        self.noise = 0.0

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``weight``: use this instead of ``self.weight`` (a LoRA-adapted router, see lora.py)."""
        if self.mode == "balanced":
            w, idx = balanced_routing(x, self.top_k, self.num_experts, self.noise)
            return None, w, idx
        logits = F.linear(x, self.weight if weight is None else weight)
        w, idx = ops.router_topk(logits, self.top_k, self.norm_topk_prob)
        return logits, w, idx

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"mode={self.mode}" + (f", noise={self.noise}" if self.noise else ""))


class SigmoidGroupRouter(TopKRouter):
    """DeepSeek-V3 router: sigmoid scores (fp32), group-limited top-k.

    Experts are picked by ``score + e_score_correction_bias`` among the ``topk_group`` best of
    ``n_group`` expert groups (a group scores the sum of its two best); their weights are the
    unbiased scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``.
    """

    def __init__(self, num_experts: int, hidden_size: int, top_k: int, norm_topk_prob: bool,
                 n_group: int, topk_group: int, routed_scaling_factor: float) -> None:
        super().__init__(num_experts, hidden_size, top_k, norm_topk_prob)
        self.n_group, self.topk_group, self.routed_scaling_factor = n_group, topk_group, routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        if self.mode == "balanced":
            w, idx = balanced_routing(x, self.top_k, self.num_experts, self.noise)
            return None, w, idx
        T, E, G = x.shape[0], self.num_experts, self.n_group
        logits = F.linear(x.float(), (self.weight if weight is None else weight).float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep[:, :, None].expand(T, G, E // G).reshape(T, E), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, w * self.routed_scaling_factor, idx


def balanced_routing(x: torch.Tensor, top_k: int, num_experts: int, noise: float = 0.0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Benchmark gate: token t, slot j goes to expert ``(t * k + j + shift_t) % E``, weight 1/k.

    With ``noise == 0`` every expert gets exactly ``T * k / E`` rows (when E divides T * k).
    With ``noise > 0``, ``shift_t`` is ``floor(noise * E * u_t)`` where ``u_t`` in [0, 1) is a
    hash of token t's activations, computed on the device: routing is uneven like a real
    router's but deterministic in the input, so activation-checkpoint recompute routes the
    same way, and there is no host sync. x [T, H] -> (weights [T, k] fp32, indices [T, k]).
    """
    T = x.shape[0]
    idx = torch.arange(T * top_k, device=x.device).view(T, top_k)
    if noise > 0:
        with torch.no_grad():
            s = x.detach().float().sum(-1) + 0.5 * x.detach().float()[:, ::7].sum(-1)
            u = torch.frac(torch.sin(s * 12.9898 + 78.233).abs() * 43758.5453)
            idx = idx + (u * (noise * num_experts)).long()[:, None]
    w = torch.full((T, top_k), 1.0 / top_k, device=x.device, dtype=torch.float32)
    return w, idx % num_experts


# ---------------------------------------------------------------------------------------------
# Experts and the sparse MoE block
# ---------------------------------------------------------------------------------------------


class Experts(nn.Module):
    """E gated FFN experts stored fused, as Transformers v5 stores them.

    gate_up_proj [E, 2I, H] (gate rows then up rows), down_proj [E, H, I]. ``impl``:
    ``"grouped_mm"`` sorts token copies by expert and runs two grouped GEMMs (no per-expert
    Python loop, no host sync on a backend with a device grouped GEMM); ``"eager"`` loops
    over experts (a reference).

    Under expert parallelism (:func:`polyaccel.moe.expert_parallel.apply_expert_parallel`) the
    two parameters hold only this rank's ``E / ep`` experts (DTensor ``Shard(0)`` over ``ep``)
    and ``dispatcher`` (a :class:`polyaccel.moe.dispatchers.TokenDispatcher`) moves token copies
    to the experts' ranks and back; ``num_experts`` stays the global count.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = act
        self.impl = "grouped_mm"
        self.fuse_wgrad = False  # BackendConfig(grad_accumulation="fused"): polyaccel.moe.grouped_linear
        self.dispatcher: Any = None  # set by expert parallelism

    def gated(self, gate_up: torch.Tensor, num_valid: torch.Tensor | None = None) -> torch.Tensor:
        """act(gate) * up for [..., 2I] -> [..., I]; rows from ``num_valid`` on may be skipped
        (dropped copies of an expert-parallel dispatch, see ``ops.swiglu``)."""
        if self.act in ("silu", "swish"):
            return ops.swiglu(gate_up, num_valid)
        gate, up = gate_up.chunk(2, dim=-1)
        return ops.activation_fn(self.act)(gate) * up

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                lora: dict[str, list[LoraFactors]] | None = None) -> torch.Tensor:
        """x [T, H], idx [T, k], w [T, k] -> sum_j w[t, j] * expert_{idx[t, j]}(x[t]), [T, H].

        ``lora``: LoRA factors per parameter name (``gate_up_proj``, ``down_proj``; from
        :func:`polyaccel.moe.lora.unwrap_peft`), added per expert without forming ``W + B·A``.
        """
        if self.dispatcher is not None:
            if lora:
                raise NotImplementedError("LoRA on experts under expert parallelism is not supported")
            return self._forward_expert_parallel(x, idx, w)
        if self.impl == "eager":
            return self._forward_eager(x, idx, w, lora)
        x_sorted, order, counts = ops.moe_permute(x, idx, self.num_experts)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        if lora:
            return ops.moe_unpermute(self._forward_lora(x_sorted, offsets, lora), order, w)
        if self.fuse_wgrad:
            rows = torch.div(order, idx.shape[1], rounding_mode="floor").to(torch.int32)
            h = self.gated(grouped_linear(x_sorted, self.gate_up_proj, offsets, gathered_from=(x, rows)))
            y = grouped_linear(h, self.down_proj, offsets)
        else:
            h = self.gated(ops.grouped_mm(x_sorted, self.gate_up_proj, offsets))
            y = ops.grouped_mm(h, self.down_proj, offsets)
        return ops.moe_unpermute(y, order, w)

    # ---- expert parallelism (polyaccel.moe.expert_parallel) ---------------------------------
    def _forward_expert_parallel(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dispatch copies to the experts' ranks, run the local experts, combine back."""
        x_local, counts, handle = self.dispatcher.dispatch(x, idx, w)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        valid = getattr(handle, "valid_rows", None)  # fixed-size dispatch: rows past it are dropped copies
        if self.fuse_wgrad and not hasattr(self.gate_up_proj, "to_local"):
            # Plain local parameters (polyaccel.moe.dense_replicas): fused weight gradients.
            h = self.gated(grouped_linear(x_local, self.gate_up_proj, offsets,
                                          gathered_from=getattr(handle, "gathered_from", None)), valid)
            y = grouped_linear(h, self.down_proj, offsets)
        else:
            h = self.gated(ops.grouped_mm(x_local, _local(self.gate_up_proj), offsets), valid)
            y = ops.grouped_mm(h, _local(self.down_proj), offsets)
        return self.dispatcher.combine(y, handle)

    def _forward_lora(self, x_sorted: torch.Tensor, offsets: torch.Tensor,
                      lora: dict[str, list[LoraFactors]]) -> torch.Tensor:
        """Sorted expert outputs [T*k, H], each grouped GEMM with its adapters' products added in
        (:func:`~polyaccel.moe.lora.grouped_lora_linear`). The sorted input copies are kept for
        the gate_up adapter's dA rather than re-gathered in the backward: 1% of a 24-layer
        Qwen3-30B-A3B LoRA step for 0.11 GiB a layer (H200, docs/benchmarks.md)."""
        h = grouped_lora_linear(x_sorted, self.gate_up_proj, offsets, lora.get("gate_up_proj", ()))
        return grouped_lora_linear(self.gated(h), self.down_proj, offsets, lora.get("down_proj", ()))

    def _forward_eager(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                       lora: dict[str, list[LoraFactors]] | None = None) -> torch.Tensor:
        lora = lora or {}
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.num_experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            h = F.linear(x[tok], self.gate_up_proj[e])
            for f in lora.get("gate_up_proj", ()):
                h = h + dense_lora(x[tok], LoraFactors(f.A[e], f.B[e], f.scale))
            h = self.gated(h)
            y = F.linear(h, self.down_proj[e])
            for f in lora.get("down_proj", ()):
                y = y + dense_lora(h, LoraFactors(f.A[e], f.B[e], f.scale))
            out.index_add_(0, tok, y.float() * w[tok, slot, None].float())
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        E, I2, H = self.gate_up_proj.shape
        return f"experts={E}, hidden={H}, intermediate={I2 // 2}, act={self.act}, impl={self.impl}"


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's block of a DTensor parameter (differentiable), or the tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


class SparseMoeBlock(nn.Module):
    """Router + experts: x [B, S, H] -> (y [B, S, H], router logits [B*S, E] or None).

    ``jitter_noise`` (Mixtral) multiplies the input by U(1-j, 1+j) in training, as Transformers
    does; the noise comes from the torch RNG, which activation checkpointing restores.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
                 norm_topk_prob: bool, act: str, jitter_noise: float = 0.0,
                 gate: TopKRouter | None = None) -> None:
        super().__init__()
        self.gate = gate if gate is not None else TopKRouter(num_experts, hidden_size, top_k, norm_topk_prob)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act)
        self.jitter_noise = jitter_noise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, S, H = x.shape
        if self.training and self.jitter_noise > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = x.reshape(-1, H)
        gate, gate_lora = unwrap_peft(self.gate)  # PEFT-wrapped router / experts: see polyaccel.moe.lora
        weight = merged_weight(gate.weight, gate_lora["weight"]) if gate_lora else None
        logits, w, idx = gate(x, weight) if weight is not None else gate(x)
        experts, lora = unwrap_peft(self.experts, x.dtype)
        return call_experts(experts, x, idx, w, lora).view(B, S, H), logits


@torch.compiler.disable
def _call_eagerly(experts: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                  lora: dict[str, list[LoraFactors]] | None = None) -> torch.Tensor:
    return experts(x, idx, w, lora) if lora else experts(x, idx, w)


def call_experts(experts: nn.Module, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 lora: dict[str, list[LoraFactors]] | None = None) -> torch.Tensor:
    """``experts(x, idx, w)``; outside ``torch.compile`` under expert parallelism (there the
    experts are their own FSDP2 unit on another mesh, whose unshard hooks must run eagerly: a
    compiled decoder layer would otherwise trace the sharded DTensor weights) and with fused
    weight-gradient accumulation (its backward writes ``.grad``, which a graph cannot). With
    LoRA factors the fused accumulation never applies (the frozen base has no weight gradient;
    :meth:`Experts._forward_lora` ignores ``fuse_wgrad``), so the experts stay in the compiled
    layer: a graph break there would also make a checkpointed layer (selective recomputation,
    :mod:`polyaccel.moe.lora`) fall back to eager as a whole."""
    if getattr(experts, "dispatcher", None) is not None or (getattr(experts, "fuse_wgrad", False) and not lora):
        return _call_eagerly(experts, x, idx, w, lora)
    return experts(x, idx, w, lora) if lora else experts(x, idx, w)


class DenseMLP(nn.Module):
    """Gated FFN ``down(act(gate(x)) * up(x))`` for dense layers between MoE layers."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.down_proj(ops.activation_fn(self.act)(self.gate_proj(x)) * self.up_proj(x)), None


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


def load_balancing_loss(router_logits: Sequence[torch.Tensor | None], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Switch-Transformer auxiliary load-balancing loss over all MoE layers, as Transformers.

    ``E * sum_e f_e * P_e`` where f_e is the fraction of (token, slot) assignments and P_e the
    mean router probability of expert e, both pooled over layers and real (unmasked) tokens.
    router_logits: per layer [T, E] (None entries, e.g. balanced gates, are skipped);
    attention_mask [B, S] with T = B*S. No host sync.
    """
    logits = [g for g in router_logits if g is not None]
    if not logits:
        return None
    probs = torch.softmax(torch.stack(logits).float(), dim=-1)  # [L, T, E]
    L, T, E = probs.shape
    selected = torch.topk(probs, top_k, dim=-1).indices  # [L, T, k]
    if attention_mask is not None and attention_mask.dim() == 2:
        row_w = attention_mask.reshape(-1).to(probs.device, torch.float32)  # [T]
    else:
        row_w = probs.new_ones(T)
    counts = probs.new_zeros(E).scatter_add_(
        0, selected.reshape(-1), row_w[None, :, None].expand(L, T, top_k).reshape(-1))
    prob_sum = (probs * row_w[None, :, None]).sum(dim=(0, 1))
    rows = row_w.sum() * L
    return (counts / rows * (prob_sum / rows)).sum() * num_experts


LM_HEAD_WGRAD = os.environ.get("POLYACCEL_LM_HEAD_WGRAD", "forward").strip().lower()
"""Where a fused LM head's weight gradient (``fuse_weight_grad``) is formed: ``forward`` (the
default) forms it with the loss and adds it, scaled by the upstream gradient, into
``weight.grad`` in the backward (``ops.add_scaled_``: one more pass over the [V, H] gradient
and ``.grad``); ``backward`` keeps the logits' gradient ([N, V], up to
:data:`LM_HEAD_DEFER_BYTES`) until the backward, where one GEMM adds ``grad_logits.T @ (hidden
* upstream)`` into ``weight.grad`` (no [V, H] temporary, no extra pass; the logits' gradient
outlives the forward by the time to the backward's first op). Not timed on a GPU yet, so off
by default: ``POLYACCEL_LM_HEAD_WGRAD=backward`` (read at import, or set the attribute)."""

LM_HEAD_DEFER_BYTES = 2 << 30
"""The largest [N, V] logits' gradient :data:`LM_HEAD_WGRAD` ``backward`` keeps; larger ones
take the chunked forward path."""


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` whose gradients ``ops.linear_cross_entropy_grads``
    forms during the forward (chunked: the [N, V] fp32 logits never exist); the backward only
    scales them by the upstream gradient. With ``into_grad`` the weight's is added into
    ``weight.grad`` in one pass there (``ops.add_scaled_``) instead of being returned for
    autograd to scale and add (two more passes over a [V, H] tensor per micro-batch), or, with
    :data:`LM_HEAD_WGRAD` ``backward``, formed there by one GEMM adding into ``weight.grad``."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk: int, need_h: bool, need_w: bool,  # noqa: ANN001
                into_grad: bool):
        ctx.weight = weight if into_grad and need_w else None
        ctx.deferred = ctx.weight is not None and _defers_lm_head_wgrad(hidden, weight)
        if ctx.deferred:
            loss, grad_h, grad_logits = ops.linear_cross_entropy_logit_grads(hidden, weight, labels, ignore_index,
                                                                             "sum")
            ctx.save_for_backward(grad_h if need_h else None, grad_logits, hidden)
            return loss.float()
        loss, grad_h, grad_w = ops.linear_cross_entropy_grads(hidden, weight, labels, ignore_index, "sum", chunk,
                                                              grad_hidden=need_h, grad_weight=need_w)
        ctx.save_for_backward(grad_h, grad_w)
        return loss.float()

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        w = ctx.weight
        if ctx.deferred:
            grad_h, grad_logits, hidden = ctx.saved_tensors
            scaled = (hidden.float() * grad_out.float()).to(hidden.dtype)  # [N, H]: the upstream scale here
            if w.grad is not None:
                w.grad.addmm_(grad_logits.t(), scaled)
                grad_w = None
            else:  # (no .grad yet: autograd's)
                grad_w = (grad_logits.t() @ scaled).to(w.dtype)
            grad_h = torch._foreach_mul([grad_h], grad_out.float())[0] if grad_h is not None else None
            return grad_h, grad_w, None, None, None, None, None, None
        grad_h, grad_w = ctx.saved_tensors
        if grad_w is not None and w is not None and w.grad is not None:  # (no .grad yet: autograd's)
            ops.add_scaled_(w.grad, grad_w, grad_out)
            grad_w = None
        # (a foreach multiply reads the 0-dim scale on the device and stays vectorized)
        kept = [t for t in (grad_h, grad_w) if t is not None]
        scaled = iter(torch._foreach_mul(kept, grad_out.float()) if kept else ())
        return (next(scaled) if grad_h is not None else None, next(scaled) if grad_w is not None else None,
                None, None, None, None, None, None)


def _defers_lm_head_wgrad(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the LM head's weight gradient is formed in the backward (:data:`LM_HEAD_WGRAD`)."""
    if LM_HEAD_WGRAD not in ("forward", "backward"):
        raise ValueError(f"POLYACCEL_LM_HEAD_WGRAD={LM_HEAD_WGRAD!r}: use forward or backward")
    return LM_HEAD_WGRAD == "backward" and hidden.shape[0] * weight.shape[0] * hidden.element_size() <= \
        LM_HEAD_DEFER_BYTES


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             ignore_index: int = -100, chunk: int = 1024, fuse_weight_grad: bool = False
                             ) -> torch.Tensor:
    """Sum over rows of CE(hidden @ weight.T, labels), never holding full [N, V] fp32 logits.

    hidden [N, H], weight [V, H], labels [N] -> fp32 scalar, through the backend's
    ``linear_cross_entropy_grads`` (core's chunked reference where none is registered).
    ``fuse_weight_grad``: add the weight's gradient into ``weight.grad`` in the backward where
    :func:`~polyaccel.moe.grouped_linear.fusable` allows (autograd then gets none for it).
    """
    # Inside autograd.Function.forward grad mode is always off, so decide here which
    # gradients (formed during the forward) are needed at all.
    grad_on = torch.is_grad_enabled()
    need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
    into_grad = fuse_weight_grad and need_w and fusable(weight)
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk, need_h, need_w, into_grad)


def causal_lm_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *,
                   logits: torch.Tensor | None = None, num_items_in_batch: Any = None,
                   ignore_index: int = -100, chunk: int = 1024,
                   shift_labels: torch.Tensor | None = None, fuse_weight_grad: bool = False) -> torch.Tensor:
    """Next-token cross-entropy as Transformers' ``ForCausalLMLoss`` computes it.

    Labels are shifted left by one (``shift_labels`` if given, already shifted); the mean is
    over non-ignored targets, or the sum divided by ``num_items_in_batch`` when given
    (gradient accumulation). With ``logits`` [B, S, V] it is the standard loss; without,
    the chunked linear cross-entropy on hidden [B, S, H] (``fuse_weight_grad``: see
    :func:`linear_cross_entropy_sum`).
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    if logits is not None:
        total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shift_labels,
                                ignore_index=ignore_index, reduction="sum")
    else:
        total = linear_cross_entropy_sum(hidden.reshape(-1, hidden.shape[-1]), lm_head_weight,
                                         shift_labels, ignore_index, chunk, fuse_weight_grad)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (shift_labels != ignore_index).sum()


def init_std(config: Any) -> float:
    """The init standard deviation Transformers uses for this config."""
    return getattr(config, "initializer_range", None) or 0.02


__all__ = [
    "AttentionContext", "DenseMLP", "Experts", "RMSNorm", "RotaryEmbedding", "SparseMoeBlock",
    "SigmoidGroupRouter", "TopKRouter", "apply_rotary", "balanced_routing", "causal_lm_loss", "head_dim",
    "linear_cross_entropy_sum", "load_balancing_loss", "self_attention",
]

