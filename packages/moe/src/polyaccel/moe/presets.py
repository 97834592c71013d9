"""Model configs as small functions: tiny ones for tests and examples, and the benchmark shape.

Each returns a Transformers config, so the same preset builds our model
(``polyaccel.moe.AutoModelForCausalLM.from_config``) or Transformers' own.
"""

from __future__ import annotations

from typing import Any

import transformers


def tiny(model_type: str, **overrides: Any) -> transformers.PreTrainedConfig:
    """A few-thousand-parameter config of ``model_type`` (qwen3_moe, mixtral, olmoe,
    deepseek_v3) for CPU tests.

    Shapes are chosen to exercise the interesting paths: GQA, 8 experts top-2, Qwen3's
    dense ``mlp_only_layers`` and ``norm_topk_prob``, Mixtral's sliding window, OLMoE's
    ``clip_qkv``, DeepSeek-V3's MLA, shared experts and group-limited sigmoid router.
    ``overrides`` replace any field.
    """
    common = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128,
                  router_aux_loss_coef=0.01, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen3_moe":
        fields = dict(common, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                      norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])
        cls = transformers.Qwen3MoeConfig
    elif model_type == "mixtral":
        fields = dict(common, intermediate_size=16, num_local_experts=8, sliding_window=6)
        cls = transformers.MixtralConfig
    elif model_type == "olmoe":
        fields = dict(common, num_key_value_heads=4, intermediate_size=16, num_experts=8, clip_qkv=4.0)
        cls = transformers.OlmoeConfig
    elif model_type == "deepseek_v3":
        fields = dict(common, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                      n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                      num_hidden_layers=3, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=6, routed_scaling_factor=2.5, norm_topk_prob=True)
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(f"no tiny preset for model_type={model_type!r}")
    fields.update(overrides)
    return cls(**fields)


def qwen3_30b_a3b(num_hidden_layers: int = 48, **overrides: Any) -> transformers.Qwen3MoeConfig:
    """Qwen3-30B-A3B's shapes (hidden 2048, 128 experts top-8, expert FFN 768, 32 q / 4 kv
    heads, head_dim 128, vocab 151936); ``num_hidden_layers=8`` is the benchmark workload."""
    fields = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=32, num_key_value_heads=4,
                  head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def olmoe_1b_7b(num_hidden_layers: int = 16, **overrides: Any) -> transformers.OlmoeConfig:
    """OLMoE-1B-7B's shapes (hidden 2048, 64 experts top-8 without top-k renormalisation, expert
    FFN 1024, 16 heads, vocab 50304); all 16 layers by default."""
    fields = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                  norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, pad_token_id=1, bos_token_id=None, eos_token_id=50279)
    fields.update(overrides)
    return transformers.OlmoeConfig(**fields)


def mixtral_8x7b(num_hidden_layers: int = 32, **overrides: Any) -> transformers.MixtralConfig:
    """Mixtral-8x7B's shapes (hidden 4096, 8 experts top-2, expert FFN 14336, 32 q / 8 kv heads,
    vocab 32000); ``num_hidden_layers=4`` is the benchmark workload."""
    fields = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-5, sliding_window=None,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    fields.update(overrides)
    return transformers.MixtralConfig(**fields)


def qwen3_235b_a22b(num_hidden_layers: int = 94, **overrides: Any) -> transformers.Qwen3MoeConfig:
    """Qwen3-235B-A22B's shapes (hidden 4096, 128 experts top-8, expert FFN 1536, 64 q / 4 kv
    heads of 128, vocab 151936); ``num_hidden_layers=2`` is a benchmark workload (6.2B parameters)."""
    fields = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    fields.update(overrides)
    return transformers.Qwen3MoeConfig(**fields)


def moonlight_16b_a3b(num_hidden_layers: int = 27, **overrides: Any) -> transformers.DeepseekV3Config:
    """Moonlight-16B-A3B's shapes, a DeepSeek-V3-architecture model: multi-head latent attention
    (16 heads, KV rank 512, no query compression), 64 routed experts top-6 plus 2 shared (FFN
    1408), sigmoid router with score correction, first layer dense (FFN 11264), vocab 163840;
    ``num_hidden_layers=8`` is a benchmark workload (4.8B parameters)."""
    fields = dict(vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
                  num_hidden_layers=num_hidden_layers, num_attention_heads=16, num_key_value_heads=16,
                  n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                  first_k_dense_replace=1, routed_scaling_factor=2.446, norm_topk_prob=True,
                  q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 50_000.0})
    fields.update(overrides)
    return transformers.DeepseekV3Config(**fields)
