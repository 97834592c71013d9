"""Model FLOPs per token and device peak FLOP/s, for tokens/s -> MFU.

Counts matmul FLOPs only (2 per multiply-accumulate), the convention of the PaLM paper's MFU: attention projections, causal attention scores (QK^T and PV over on
average half the sequence), the active experts (top-k routed plus shared), the router, dense
MLP layers and the LM head. Training = 3x forward (backward is twice the forward);
activation-checkpoint recompute is *not* counted (that is what makes it *model* FLOPs).
Norms, rotary, softmax and embeddings lookups are ignored (well under 1%).
"""

from __future__ import annotations

from typing import Any

import torch

#: Dense bf16 datasheet peaks in FLOP/s, matched by substring of the device name.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return v
    return default


def forward_flops_per_token(config: Any, seq_len: int, *, weights_only: bool = False) -> float:
    """Forward matmul FLOPs per token of a dense or MoE decoder for sequences of ``seq_len``
    (``weights_only``: the matmuls with weights, attention's score matmuls left out).

    ``config`` is a Hugging Face config (or its dict): Qwen2/3-MoE, Mixtral, OLMoE,
    DeepSeek-V3-style (latent attention, shared experts, first dense layers) and dense
    Llama-likes are read.
    """
    h = _get(config, "hidden_size")
    layers = _get(config, "num_hidden_layers")
    nq = _get(config, "num_attention_heads")
    nkv = _get(config, "num_key_value_heads", default=nq)
    d = _get(config, "head_dim", default=h // nq)
    vocab = _get(config, "vocab_size")
    dense_ffn = _get(config, "intermediate_size")
    experts = _get(config, "num_experts", "num_local_experts", "n_routed_experts", default=0)
    top_k = _get(config, "num_experts_per_tok", "moe_topk", default=0)
    expert_ffn = _get(config, "moe_intermediate_size", default=dense_ffn)
    shared_ffn = _get(config, "shared_expert_intermediate_size", default=0)
    shared_ffn += _get(config, "n_shared_experts", default=0) * expert_ffn
    sparse_step = _get(config, "decoder_sparse_step", default=1) or 1
    mlp_only = set(_get(config, "mlp_only_layers", default=[]) or [])
    first_dense = _get(config, "first_k_dense_replace", default=0)

    attn_proj = 2 * h * (nq * d + 2 * nkv * d) + 2 * nq * d * h
    attn_scores = 2 * nq * d * seq_len  # (2 matmuls x 2 FLOPs x S/2 keys on average) x nq x d
    kv_rank = _get(config, "kv_lora_rank")
    if kv_rank:  # DeepSeek's multi-head latent attention: low-rank K/V (and Q), rope dims apart
        nope, rope, v = (_get(config, k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        q_rank = _get(config, "q_lora_rank")
        q_proj = 2 * h * q_rank + 2 * q_rank * nq * (nope + rope) if q_rank else 2 * h * nq * (nope + rope)
        attn_proj = q_proj + 2 * h * (kv_rank + rope) + 2 * kv_rank * nq * (nope + v) + 2 * nq * v * h
        attn_scores = nq * seq_len * (nope + rope + v)  # QK^T over nope+rope dims, PV over v, S/2 keys
    dense_mlp = 2 * 3 * h * dense_ffn  # gate, up, down
    moe_mlp = 2 * 3 * h * expert_ffn * top_k + 2 * 3 * h * shared_ffn + 2 * h * experts

    total = 0.0
    for i in range(layers):
        is_moe = experts > 0 and i not in mlp_only and i >= first_dense and (i + 1) % sparse_step == 0
        total += attn_proj + (attn_scores if not weights_only else 0) + (moe_mlp if is_moe else dense_mlp)
    return total + 2 * h * vocab


def train_flops_per_token(config: Any, seq_len: int, *, frozen_base: bool = False) -> float:
    """Forward + backward model FLOPs per token: 3x forward; with ``frozen_base`` (LoRA) the
    weights get no gradients, so their matmuls count twice (forward, input gradient) and only
    attention's score matmuls three times (adapters' rank-r matmuls are left out)."""
    forward = forward_flops_per_token(config, seq_len)
    if not frozen_base:
        return 3.0 * forward
    weights = forward_flops_per_token(config, seq_len, weights_only=True)
    return 2.0 * weights + 3.0 * (forward - weights)


def peak_flops(device: torch.device | str, override_tflops: float | None = None) -> float | None:
    """Peak dense bf16 FLOP/s of one ``device``; None when unknown (CPU: MFU is reported n/a).

    ``override_tflops`` (``--peak-tflops``) wins, e.g. 800 for the H200's measured matmul peak.
    """
    if override_tflops:
        return override_tflops * 1e12
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1], or None when the peak is unknown."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
