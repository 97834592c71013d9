"""polyaccel's MoE model implementations, one architecture per module.

``MODEL_TYPES`` maps a Transformers ``config.model_type`` to the module and class that
implement it; modules are imported on first use.
"""

from __future__ import annotations

import importlib

MODEL_TYPES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("polyaccel.moe.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "mixtral": ("polyaccel.moe.models.mixtral", "MixtralForCausalLM"),
    "olmoe": ("polyaccel.moe.models.olmoe", "OlmoeForCausalLM"),
    "deepseek_v3": ("polyaccel.moe.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def causal_lm_class(model_type: str):
    """Our causal-LM class for ``model_type``, or None when we have no implementation."""
    entry = MODEL_TYPES.get(model_type)
    if entry is None:
        return None
    module, name = entry
    return getattr(importlib.import_module(module), name)
