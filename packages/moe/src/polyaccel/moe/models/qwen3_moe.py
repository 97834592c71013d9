"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B) on polyaccel layers.

Same parameter names and shapes as ``transformers.Qwen3MoeForCausalLM``: attention with
per-head RMSNorm on q and k, GQA, RoPE, optional sliding window; MoE blocks with a softmax
top-k router (renormalised when ``norm_topk_prob``) and fused experts; dense MLP layers where
``mlp_only_layers`` / ``decoder_sparse_step`` say so.

Shape legend: B batch, S sequence, H hidden, NH query heads, NKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3MoeConfig

from polyaccel.moe.layers import AttentionContext, DenseMLP, RMSNorm, SparseMoeBlock, head_dim, self_attention
from polyaccel.moe.models.base import MoeDecoderLayer, MoeForCausalLM, MoeModel


class Qwen3MoeAttention(nn.Module):
    """Self-attention with RMSNorm over each head's q and k (before RoPE)."""

    def __init__(self, config: Qwen3MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim**-0.5
        nh, nkv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, nh * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(nh * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        q_BSND = self.q_norm(self.q_proj(x).view(B, S, -1, self.head_dim))
        k_BSKD = self.k_norm(self.k_proj(x).view(B, S, -1, self.head_dim))
        v_BSKD = self.v_proj(x).view(B, S, -1, self.head_dim)
        return self.o_proj(self_attention(self, q_BSND, k_BSKD, v_BSKD, rope, ctx))


class Qwen3MoeDecoderLayer(MoeDecoderLayer):
    """Attention + (MoE block or dense MLP), pre-norm residual."""

    def __init__(self, config: Qwen3MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3MoeAttention(config, layer_idx)
        if (layer_idx not in config.mlp_only_layers and config.num_experts > 0
                and (layer_idx + 1) % config.decoder_sparse_step == 0):
            self.mlp = SparseMoeBlock(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      config.num_experts_per_tok, config.norm_topk_prob, config.hidden_act)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoeModel(MoeModel):
    """The Qwen3-MoE decoder stack."""

    config_class = Qwen3MoeConfig
    decoder_layer_class = Qwen3MoeDecoderLayer
    _no_split_modules = ["Qwen3MoeDecoderLayer"]


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE causal LM, a drop-in for ``transformers.Qwen3MoeForCausalLM``."""

    config_class = Qwen3MoeConfig
    model_class = Qwen3MoeModel
    _no_split_modules = ["Qwen3MoeDecoderLayer"]
