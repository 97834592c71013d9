"""OLMoE (OLMoE-1B-7B) on polyaccel layers.

Same parameter names and shapes as ``transformers.OlmoeForCausalLM``: attention with RMSNorm
over the whole q projection (all heads together) and over the whole k projection, optional
``clip_qkv`` clamping, RoPE, no sliding window; MoE blocks with a softmax top-k router
(renormalised when ``norm_topk_prob``) and fused experts.

Shape legend: B batch, S sequence, H hidden, NH query heads, NKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import OlmoeConfig

from polyaccel.moe.layers import AttentionContext, RMSNorm, SparseMoeBlock, head_dim, self_attention
from polyaccel.moe.models.base import MoeDecoderLayer, MoeForCausalLM, MoeModel


class OlmoeAttention(nn.Module):
    """Self-attention with full-width q/k RMSNorm and optional q/k/v clamping."""

    def __init__(self, config: OlmoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim**-0.5
        self.clip_qkv = config.clip_qkv
        nh, nkv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, nh * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(nh * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm((config.hidden_size // nh) * nkv, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q_BSND = q.view(B, S, -1, self.head_dim)
        k_BSKD = k.view(B, S, -1, self.head_dim)
        v_BSKD = v.view(B, S, -1, self.head_dim)
        return self.o_proj(self_attention(self, q_BSND, k_BSKD, v_BSKD, rope, ctx))


class OlmoeDecoderLayer(MoeDecoderLayer):
    """Attention + MoE block, pre-norm residual."""

    def __init__(self, config: OlmoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = OlmoeAttention(config, layer_idx)
        self.mlp = SparseMoeBlock(config.num_experts, config.hidden_size, config.intermediate_size,
                                  config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class OlmoeModel(MoeModel):
    """The OLMoE decoder stack (never a sliding window)."""

    config_class = OlmoeConfig
    decoder_layer_class = OlmoeDecoderLayer
    _no_split_modules = ["OlmoeDecoderLayer"]

    @property
    def sliding_window(self) -> None:
        return None


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE causal LM, a drop-in for ``transformers.OlmoeForCausalLM``."""

    config_class = OlmoeConfig
    model_class = OlmoeModel
    _no_split_modules = ["OlmoeDecoderLayer"]
