"""polyaccel MoE: drop-in faster fine-tuning of Hugging Face Mixture-of-Experts models.

``from polyaccel.moe import AutoModelForCausalLM, BackendConfig`` is the whole API most
scripts need; a training loop of one's own adds :class:`FlatAdamW` in place of
``torch.optim.AdamW``, and ``transformers.Trainer`` users take :class:`Trainer`; see
``docs/moe.md``.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyaccel.moe.auto import AutoModelForCausalLM
    from polyaccel.moe.config import BackendConfig
    from polyaccel.moe.graphed_step import GraphedMicroStep
    from polyaccel.moe.optim import FlatAdamW
    from polyaccel.moe.trainer import Trainer, fast_trainer_class

__all__ = ["AutoModelForCausalLM", "BackendConfig", "FlatAdamW", "GraphedMicroStep", "Trainer", "fast_trainer_class"]

_HOMES = {"AutoModelForCausalLM": "auto", "BackendConfig": "config", "FlatAdamW": "optim",
          "GraphedMicroStep": "graphed_step", "Trainer": "trainer", "fast_trainer_class": "trainer"}


def __getattr__(name: str) -> Any:
    # Imported when first asked for: importing the package (as `polyaccel-moe` and
    # `python -m polyaccel.moe.cli` do first) loads no torch, so a Ctrl-C while torch loads
    # reaches the CLI's handler; the Trainer integration imports transformers.Trainer.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'polyaccel.moe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"polyaccel.moe.{home}"), name)
