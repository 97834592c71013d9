"""What may and may not change when a fine-tuning run resumes from a checkpoint.

Fixed for the life of a run (a resume that changes them is refused, exit 2, naming the key
and both values): the LoRA adapters' settings (``lora.r``, ``alpha``, ``dropout``,
``target_modules``, ``experts``, ``router``: the checkpoint's adapters would be loaded as
they are, whatever the new values say) and the model's shape (:data:`SHAPE_KEYS` of the
resolved model config).

Applied from the resumed step on: ``train.lr`` and the schedule (``warmup_steps``,
``schedule``, ``min_lr_ratio``, ``max_steps``) and the other AdamW settings (``betas``,
``eps``, ``weight_decay``). The checkpoint's optimizer and scheduler state would restore the
old values; :func:`apply_train_settings` puts the new ones in (a warning names each change),
so a resume with unchanged settings continues bit for bit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe.train_config import ConfigError, FinetuneConfig, TrainConfig

logger = logging.getLogger("polyaccel.moe")

#: model config fields that fix the parameters' shapes (compared when present on both sides)
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts",
              "num_local_experts", "n_routed_experts", "n_shared_experts", "shared_expert_intermediate_size",
              "tie_word_embeddings")
#: ``lora`` keys a resumed run must keep (``recompute`` may change)
LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "experts", "router")
#: ``train`` keys applied anew on resume
TRAIN_KEYS = ("lr", "warmup_steps", "schedule", "min_lr_ratio", "max_steps", "betas", "eps", "weight_decay")
_REFUSED = ("resume with the settings it was written with, or use a new checkpoint.dir (train.lr, the LR "
            "schedule and the other AdamW settings may change on resume: the new values apply from the "
            "resumed step)")


def model_shape(model_config: Any) -> dict[str, Any]:
    """The :data:`SHAPE_KEYS` fields ``model_config`` sets (saved in the trainer state)."""
    return {k: getattr(model_config, k) for k in SHAPE_KEYS if getattr(model_config, k, None) is not None}


def saved_run(path: Path) -> dict[str, Any]:
    """The run config and model shape a checkpoint's trainer state records (memory-mapped:
    its optimizer tensors are not read); empty where an older checkpoint lacks them, or the
    file holds no trainer state at all."""
    state = ckpt.load_file(path / ckpt.TRAINER_STATE, mmap=True)
    if not isinstance(state, dict):  # not a trainer state: the resume refuses it later, naming the file
        return {"config": {}, "model_shape": {}}
    shape = state.get("model_shape")
    if shape is None and (path / "config.json").is_file():  # a full model saved before model_shape existed
        try:
            shape = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k in SHAPE_KEYS}
        except (OSError, ValueError, RecursionError, AttributeError):  # unreadable, nested too deeply, not an object
            shape = None
    return {"config": state.get("config") if isinstance(state.get("config"), dict) else {},
            "model_shape": shape if isinstance(shape, dict) else {}}


def check_resume_settings(cfg: FinetuneConfig, model_config: Any, path: Path, *, shape: bool = True) -> None:
    """Refuse (:class:`ConfigError`) resuming from ``path`` with LoRA settings or (``shape``)
    a model shape other than the checkpoint's; see the module docstring for what may change."""
    saved = saved_run(path)
    if cfg.lora is not None and isinstance(saved["config"].get("lora"), dict):
        ours = cfg.to_dict()["lora"]
        for key in LORA_KEYS:
            _same(path, f"lora.{key}", saved["config"]["lora"].get(key), ours.get(key))
        base = saved["config"].get("model")
        if isinstance(base, dict) and "path" in base and base["path"] != cfg.model.path:
            logger.warning("polyaccel.moe: model.path changed on resume: the checkpoint's LoRA adapters were trained "
                           "on the base model %s, this run loads %s under them (the same model moved is fine; another "
                           "one gives other results)", base["path"], cfg.model.path)
    if shape:
        ours = model_shape(model_config)
        for key, value in saved["model_shape"].items():
            if key in ours:
                _same(path, f"the model's {key}", value, ours[key])


def _same(path: Path, key: str, saved: Any, ours: Any) -> None:
    if saved is None or _normal(saved) == _normal(ours):
        return
    raise ConfigError(f"checkpoint.resume: {path} was written with {key}={_show(saved)}, this run has "
                      f"{_show(ours)}; it cannot change mid-run: {_REFUSED}", key="checkpoint.resume")


def _normal(value: Any) -> Any:
    """Lists of names compare as sets (their order does not matter to PEFT)."""
    return sorted(value) if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value) else value


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, list | tuple) else str(value)


def apply_train_settings(optimizer: torch.optim.Optimizer, scheduler: Any, t: TrainConfig,
                         saved: dict[str, Any]) -> None:
    """After the optimizer and scheduler states are restored: put this run's peak ``lr`` (with
    its schedule, at the resumed step), ``betas``, ``eps`` and ``weight_decay`` back in, as the
    user asked, instead of the checkpoint's; warn about each value that differs from
    ``saved`` (the checkpoint's ``train`` section)."""
    for key in TRAIN_KEYS:
        old, new = saved.get(key), getattr(t, key)
        if old is not None and _normal(old) != _normal(list(new) if isinstance(new, tuple) else new):
            logger.warning("polyaccel.moe: train.%s changed on resume: the checkpoint's run used %s, this run %s; "
                           "the new value applies from the resumed step", key, _show(old), _show(new))
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * factor
        group["betas"] = tuple(t.betas)
        group["eps"] = t.eps
        group["weight_decay"] = t.weight_decay if all(p.ndim >= 2 for p in group["params"]) else 0.0
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
