"""DeepSeek-V3 style models (DeepSeek-V3/R1 shapes, Moonlight, ...) on polyaccel layers.

Same parameter names and shapes as ``transformers.DeepseekV3ForCausalLM``: multi-head latent
attention (MLA: low-rank q, a shared compressed KV latent plus one shared RoPE key, expanded
per head by ``kv_b_proj``; the cache holds the compressed latent), the first
``first_k_dense_replace`` layers dense, the rest MoE with shared experts and a sigmoid,
group-limited router with a score-correction bias.

Shape legend: B batch, S sequence, Sk keys (cached + new), H hidden, NH heads, R kv latent
rank, Dn/Dr q/k head dims without/with RoPE, Dv value head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import DeepseekV3Config

from polyaccel.moe.layers import (
    AttentionContext,
    DenseMLP,
    RMSNorm,
    SigmoidGroupRouter,
    SparseMoeBlock,
    apply_rotary,
    causal_sdpa,
)
from polyaccel.moe.models.base import MoeDecoderLayer, MoeForCausalLM, MoeModel


def mla_softmax_scale(config: DeepseekV3Config) -> float:
    """``1/sqrt(Dn + Dr)``, times YaRN's ``mscale**2`` when the RoPE scaling sets ``mscale_all_dim``."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        self.head_dim = self.nope_dim + self.rope_dim
        self.rope_interleave = bool(config.rope_interleave)
        self.scaling = mla_softmax_scale(config)
        H, NH = config.hidden_size, self.num_heads
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(H, NH * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, NH * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_rank + self.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank)
        self.kv_b_proj = nn.Linear(self.kv_rank, NH * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(NH * self.v_dim, H, bias=config.attention_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> torch.Tensor:
        B, S, _ = x.shape
        NH = self.num_heads
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(B, S, NH, self.head_dim).transpose(1, 2).split([self.nope_dim, self.rope_dim], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent_B1SR = self.kv_a_layernorm(latent).view(B, 1, S, self.kv_rank)
        k_rot_B1SD = k_rot.view(B, 1, S, self.rope_dim)
        q_rot, k_rot_B1SD = apply_rotary(q_rot, k_rot_B1SD, *rope, interleaved=self.rope_interleave)
        past = 0
        if ctx.past_key_values is not None:  # cache the compressed latent, not per-head K/V
            past = ctx.past_key_values.get_seq_length(self.layer_idx)
            latent_B1SR, k_rot_B1SD = ctx.past_key_values.update(latent_B1SR, k_rot_B1SD, self.layer_idx)
        Sk = latent_B1SR.shape[2]
        kv = self.kv_b_proj(latent_B1SR).view(B, Sk, NH, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot_B1SD.expand(B, NH, Sk, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        out_BNSV = causal_sdpa(q, k, v, ctx, past, self.scaling)
        return self.o_proj(out_BNSV.transpose(1, 2).reshape(B, S, NH * self.v_dim))


class DeepseekV3MoE(SparseMoeBlock):
    """Routed experts (sigmoid group-limited router) plus always-on shared experts."""

    def __init__(self, config: DeepseekV3Config) -> None:
        E, H = config.n_routed_experts, config.hidden_size
        gate = SigmoidGroupRouter(E, H, config.num_experts_per_tok, config.norm_topk_prob, config.n_group,
                                  config.topk_group, config.routed_scaling_factor)
        super().__init__(E, H, config.moe_intermediate_size, config.num_experts_per_tok,
                         config.norm_topk_prob, config.hidden_act, gate=gate)
        self.shared_experts = DenseMLP(H, config.moe_intermediate_size * config.n_shared_experts,
                                       config.hidden_act)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        routed, router_logits = super().forward(x)
        return routed + self.shared_experts(x)[0], router_logits


class DeepseekV3DecoderLayer(MoeDecoderLayer):
    """MLA + (dense MLP for the first ``first_k_dense_replace`` layers, else MoE), pre-norm."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx)
        if layer_idx >= config.first_k_dense_replace:
            self.mlp = DeepseekV3MoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV3Model(MoeModel):
    """The DeepSeek-V3 decoder stack (no sliding window)."""

    config_class = DeepseekV3Config
    decoder_layer_class = DeepseekV3DecoderLayer
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]

    @property
    def sliding_window(self) -> None:
        return None

    def attention_geometry(self) -> tuple[int, int, int, int]:
        """Latent attention expands to plain multi-head attention: heads of nope + rope dims for
        queries and keys, ``v_head_dim`` for values."""
        c = self.config
        return c.num_attention_heads, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim


class DeepseekV3ForCausalLM(MoeForCausalLM):
    """DeepSeek-V3 causal LM, a drop-in for ``transformers.DeepseekV3ForCausalLM``.

    Like Transformers' class it has no router aux loss (balance comes from the router's
    ``e_score_correction_bias``); the multi-token-prediction layer of the original checkpoints is not
    part of the model and its keys are ignored on load.
    """

    config_class = DeepseekV3Config
    model_class = DeepseekV3Model
    has_aux_loss = False
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias"]
    _keys_to_ignore_on_load_unexpected = [r"model\.layers\.61.*"]

    @staticmethod
    def config_num_experts(config: DeepseekV3Config) -> int:
        return config.n_routed_experts
