"""polyaccel MoE: drop-in faster fine-tuning of Hugging Face Mixture-of-Experts models.

``from polyaccel.moe import AutoModelForCausalLM, BackendConfig`` is the whole API most
scripts need; a training loop of one's own adds :class:`FlatAdamW` in place of
``torch.optim.AdamW``, and ``transformers.Trainer`` users take :class:`Trainer`; see
``docs/moe.md``.
"""

from typing import Any

from polyaccel.moe.auto import AutoModelForCausalLM
from polyaccel.moe.config import BackendConfig
from polyaccel.moe.optim import FlatAdamW

__all__ = ["AutoModelForCausalLM", "BackendConfig", "FlatAdamW", "GraphedMicroStep", "Trainer", "fast_trainer_class"]


def __getattr__(name: str) -> Any:
    # The Trainer integration imports transformers.Trainer (and accelerate): only when asked.
    if name == "GraphedMicroStep":
        from polyaccel.moe.graphed_step import GraphedMicroStep

        return GraphedMicroStep
    if name in ("Trainer", "fast_trainer_class"):
        from polyaccel.moe import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'polyaccel.moe' has no attribute {name!r}")
