"""Mixtral (8x7B, 8x22B) on polyaccel layers.

Same parameter names and shapes as ``transformers.MixtralForCausalLM`` (v5 layout: experts
fused under ``mlp.experts``; the original ``block_sparse_moe.experts.*.w1/w2/w3`` checkpoint
keys are converted by Transformers on load and written back on save). Plain GQA attention with
RoPE, sliding window when the config sets one; router softmax top-k, always renormalised;
optional router jitter noise in training.

Shape legend: B batch, S sequence, H hidden, NH query heads, NKV key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import MixtralConfig

from polyaccel.moe.layers import AttentionContext, RMSNorm, SparseMoeBlock, head_dim, self_attention
from polyaccel.moe.models.base import MoeDecoderLayer, MoeForCausalLM, MoeModel


class MixtralAttention(nn.Module):
    """Self-attention without biases or q/k norms."""

    def __init__(self, config: MixtralConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim**-0.5
        nh, nkv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, nh * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, nkv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(nh * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        q_BSND = self.q_proj(x).view(B, S, -1, self.head_dim)
        k_BSKD = self.k_proj(x).view(B, S, -1, self.head_dim)
        v_BSKD = self.v_proj(x).view(B, S, -1, self.head_dim)
        return self.o_proj(self_attention(self, q_BSND, k_BSKD, v_BSKD, rope, ctx))


class MixtralDecoderLayer(MoeDecoderLayer):
    """Attention + MoE block, pre-norm residual."""

    def __init__(self, config: MixtralConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MixtralAttention(config, layer_idx)
        self.mlp = SparseMoeBlock(config.num_local_experts, config.hidden_size, config.intermediate_size,
                                  config.num_experts_per_tok, True, config.hidden_act,
                                  jitter_noise=config.router_jitter_noise)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MixtralModel(MoeModel):
    """The Mixtral decoder stack."""

    config_class = MixtralConfig
    decoder_layer_class = MixtralDecoderLayer
    _no_split_modules = ["MixtralDecoderLayer"]


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral causal LM, a drop-in for ``transformers.MixtralForCausalLM``."""

    config_class = MixtralConfig
    model_class = MixtralModel
    _no_split_modules = ["MixtralDecoderLayer"]

    @staticmethod
    def config_num_experts(config: MixtralConfig) -> int:
        return config.num_local_experts
