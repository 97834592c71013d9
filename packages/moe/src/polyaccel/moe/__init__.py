"""polyaccel MoE: drop-in faster fine-tuning of Hugging Face Mixture-of-Experts models.

``from polyaccel.moe import AutoModelForCausalLM, BackendConfig`` is the whole API most
scripts need; see ``docs/moe.md``.
"""

from polyaccel.moe.auto import AutoModelForCausalLM
from polyaccel.moe.config import BackendConfig

__all__ = ["AutoModelForCausalLM", "BackendConfig"]
