"""``polyaccel.moe.Trainer``: ``transformers.Trainer`` on polyaccel's fast training path.

A drop-in subclass (TRL's ``SFTTrainer`` takes the same change through
:func:`fast_trainer_class`). It changes four things, each only where it applies and each
logged once where it does not:

- the optimizer: for ``optim="adamw_torch"`` / ``"adamw_torch_fused"`` (Transformers'
  defaults), :class:`~polyaccel.moe.optim.FlatAdamW`, the same AdamW math over one flat
  buffer per group, with Trainer's weight-decay groups and hyperparameters (leaving the expert
  gradients that the graphed micro-step writes over unzeroed when that micro-step will run);
- gradient clipping: the norm is measured on the device and the clipping factor is applied
  inside FlatAdamW's pass (no host sync, no extra pass over the gradients); the expert
  gradients' share of the norm comes from the weight-gradient kernel that wrote them;
- the micro-step: on one CUDA device with a polyaccel model, each micro-batch's forward and
  backward replay as one CUDA graph (:class:`~polyaccel.moe.graphed_step.GraphedMicroStep`)
  with the expert weight-gradient window :mod:`polyaccel.moe.fast_path` picks;
- the NaN/inf filter of logged losses (``logging_nan_inf_filter``, on by default) runs on the
  device instead of as an ``if`` on each micro-batch's loss (a host sync per micro-batch).

Losses are Trainer's (``num_items_in_batch`` normalisation included); checkpoints and resume
are Trainer's own (FlatAdamW's ``state_dict`` has torch AdamW's format), except that
``resume_from_checkpoint=True`` skips a checkpoint whose save a kill cut off.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from torch import nn

from polyaccel.moe import fast_path
from polyaccel.moe.graphed_step import overwritten_params
from polyaccel.moe.optim import FlatAdamW, clip_coefficient, grad_norm

_ADAMW = ("adamw_torch", "adamw_torch_fused")
logger = logging.getLogger("polyaccel.moe")


def newest_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir`` that holds ``trainer_state.json``
    (what Trainer writes last into a checkpoint), or ``None``. Newer ones without it, which a kill
    during their save left, are skipped with a warning naming them: Transformers would take the
    newest and fail on it (``FileNotFoundError``)."""
    found = [(int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
             if (m := re.fullmatch(r"checkpoint-(\d+)", p.name)) and p.is_dir()]
    for _, path in sorted(found, reverse=True):
        if _has_trainer_state(path):
            return str(path)
        logger.warning("polyaccel.moe: %s has no trainer_state.json (its save was cut off); resuming from an "
                       "earlier checkpoint", path)
    return None


def _has_trainer_state(checkpoint: Path) -> bool:
    """Whether ``checkpoint/trainer_state.json`` is a regular file (a link to one is fine)
    holding a whole JSON object: a kill can cut it; a FIFO or a device is never read."""
    try:
        fd = os.open(checkpoint / "trainer_state.json", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            return stat.S_ISREG(os.fstat(fd).st_mode) and isinstance(json.loads(f.read()), dict)
    except (OSError, ValueError, RecursionError):
        return False


class _KeepFlatGrads(transformers.TrainerCallback):
    """Trainer sets gradients to ``None`` after each step (``model.zero_grad()``); FlatAdamW
    and the replayed graphs need them to stay their flat views, so give them back."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = self.trainer.flat_optimizer()
        if opt is not None:
            opt.zero_grad()


class FastPathMixin:
    """The fast-path overrides of :class:`Trainer`, for any ``transformers.Trainer`` subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._micro_step: Any = None
        self._micro_index = 0
        self._graph_checked = False
        self.add_callback(_KeepFlatGrads(self))

    # ---- optimizer ---------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """FlatAdamW for Trainer's AdamW settings when every trainable param is a plain tensor."""
        opt_model = self.model if model is None else model
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            trainable = [p for p in opt_model.parameters() if p.requires_grad]
            optim = str(getattr(self.args.optim, "value", self.args.optim))
            if optim not in _ADAMW:
                fast_path.say_once(f"FlatAdamW off: Trainer optim={optim!r} is not AdamW")
            elif not trainable or any(type(p.data) is not torch.Tensor for p in trainable):
                fast_path.say_once("FlatAdamW off: parameters are sharded (DTensor) or none is trainable")
            else:
                # Expert weights whose gradients the graphed micro-step will write over need no
                # zeroing in the optimizer's pass (2 of the 16 bytes per parameter it moves).
                overwritten = [] if self._graph_blockers(opt_model, flat_adamw=True) else overwritten_params(opt_model)
                self.optimizer_cls_and_kwargs = (FlatAdamW, {
                    "lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                    "eps": self.args.adam_epsilon, "grads_overwritten": overwritten})
        return super().create_optimizer(model)

    def flat_optimizer(self) -> FlatAdamW | None:
        """The FlatAdamW under Trainer's (possibly wrapped) optimizer, if that is what runs."""
        opt = getattr(self, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer
        return opt if isinstance(opt, FlatAdamW) else None

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """The gradient norm, measured on the device; clipping rides on FlatAdamW's pass."""
        opt = self.flat_optimizer()
        # fp16's loss scaler: Trainer's own path unscales the gradients before measuring them.
        if opt is None or self.accelerator.num_processes > 1 or getattr(self.accelerator, "scaler", None) is not None:
            return super()._clip_grad_norm(model)
        known = self._micro_step.expert_grad_sumsq() if self._micro_step is not None else None
        norm = grad_norm(model, opt, known)
        opt.scale_next_step(clip_coefficient(norm, self.args.max_grad_norm))
        return norm

    # ---- checkpoints -------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Resume our model from the plain Hugging Face checkpoint its ``save_pretrained`` wrote
        (per-expert keys), in place (the parameters stay FlatAdamW's views)."""
        from polyaccel.moe.ep_checkpoint import load_local_weights
        from polyaccel.moe.models.base import MoeForCausalLM

        model = self.model if model is None else model
        if not isinstance(model, MoeForCausalLM):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_local_weights(model, resume_from_checkpoint)

    def _save_rng_state(self, output_dir: str) -> None:
        """Trainer's RNG file, its NumPy state rewritten as a tensor (:func:`tensorize_numpy_rng`)."""
        super()._save_rng_state(output_dir)
        name = "rng_state.pth" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}.pth"
        tensorize_numpy_rng(Path(output_dir) / name)

    # ---- micro-step --------------------------------------------------------------------------
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; ``args.logging_nan_inf_filter`` is put back as it was after it
        (:meth:`_filter_loss` takes that filter over while it runs)."""
        self._filter_moved, self._training = False, True
        if args and args[0] is True:
            args = (self._resume_target(), *args[1:])
        elif kwargs.get("resume_from_checkpoint") is True:
            kwargs["resume_from_checkpoint"] = self._resume_target()
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._filter_moved:
                self.args.logging_nan_inf_filter = True
            self._filter_moved = self._training = False

    def _resume_target(self) -> str | bool:
        """What ``resume_from_checkpoint=True`` resumes from: the newest complete checkpoint (else
        ``True``, left to Trainer: it says there is none)."""
        return newest_complete_checkpoint(self.args.output_dir) or True

    @contextlib.contextmanager
    def _args_as_given(self) -> Any:
        """The user's ``logging_nan_inf_filter`` back in ``args`` for a while (what a checkpoint's
        ``training_args.bin`` records), when :meth:`_filter_loss` switched it off."""
        if not getattr(self, "_filter_moved", False):
            yield
            return
        self.args.logging_nan_inf_filter = True
        try:
            yield
        finally:
            self.args.logging_nan_inf_filter = False

    def _save(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``_save`` (it writes ``training_args.bin``), with the arguments as given."""
        with self._args_as_given():
            return super()._save(*args, **kwargs)

    def _push_from_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's hub upload of a checkpoint (it writes ``training_args.bin``), with the
        arguments as given."""
        with self._args_as_given():
            return super()._push_from_checkpoint(*args, **kwargs)

    def _filter_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Trainer's ``logging_nan_inf_filter`` on the device: a NaN or infinite micro-batch loss
        adds the average of the losses since the last log instead, as Trainer's own check does,
        but without its ``if`` on a device tensor (a host sync per micro-batch, which leaves the
        GPU idle while the next micro-batch is prepared). Trainer's check is switched off for
        the run once this one can stand in for it (Transformers keeps the running loss in
        ``self._tr_loss``); checkpoints still record the setting as given (:meth:`_save`)."""
        if not getattr(self, "_training", False):  # a micro-step outside train(): Trainer filters nothing
            return loss
        if not self._filter_moved:
            if not (self.args.logging_nan_inf_filter and torch.is_tensor(getattr(self, "_tr_loss", None))
                    and hasattr(self, "_globalstep_last_logged")):
                return loss
            self.args.logging_nan_inf_filter = False
            self._filter_moved = True
        total = self._tr_loss
        if total.device != loss.device:
            return loss  # Trainer reports this itself
        average = total / (1 + self.state.global_step - self._globalstep_last_logged)
        return torch.where(torch.isfinite(loss), loss, average)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """Trainer's micro-step, replayed as a CUDA graph where :meth:`_graphed_step` applies;
        its loss filtered on the device (:meth:`_filter_loss`)."""
        step = self._graphed_step(model, inputs)
        n = max(1, int(getattr(self, "current_gradient_accumulation_steps", 1) or 1))
        i = self._micro_index % n
        self._micro_index = 0 if i == n - 1 else i + 1
        if step is None:
            return self._filter_loss(super().training_step(model, inputs, num_items_in_batch))
        model.train()
        batch = {k: v for k, v in self._prepare_inputs(inputs).items() if torch.is_tensor(v)}
        if num_items_in_batch is not None:
            batch["num_items_in_batch"] = torch.as_tensor(num_items_in_batch, device=self.args.device)
        return self._filter_loss(step(micro_batch=(i, n), **batch))

    def _graphed_step(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        """The :class:`GraphedMicroStep` of this run, or None (then why is logged once)."""
        if self._graph_checked:
            return self._micro_step
        self._graph_checked = True
        device = next(model.parameters()).device
        config = getattr(model, "config", None)
        opt = self.flat_optimizer()
        why = self._graph_blockers(model, flat_adamw=opt is not None)
        if why:
            if opt is not None:
                opt.zero_every_grad()  # no micro-step writes over the expert gradients
            if device.type == "cuda":
                fast_path.say_once("Trainer: CUDA graph per micro-step off: " + "; ".join(why))
            return None
        from polyaccel.moe.graphed_step import GraphedMicroStep

        plan = fast_path.plan(
            model_config=config, device=device, cuda_graph=True, wgrad_window="auto", fsdp=False,
            optimizer="flat_adamw", activation_checkpointing=False, param_dtype=torch.bfloat16,
            fused_grad_accumulation=model.backend_config.grad_accumulation == "fused",
            tokens_per_micro_batch=int(inputs["input_ids"].numel()) if "input_ids" in inputs else 0,
            grad_accum=self.args.gradient_accumulation_steps)
        self._micro_step = GraphedMicroStep(model, warmup=2, wgrad_window=plan.wgrad_window,
                                            loss_fn=functools.partial(self._graph_loss, model))
        return self._micro_step

    def _graph_blockers(self, model: nn.Module, flat_adamw: bool) -> list[str]:
        """Why this run's micro-step cannot replay as a CUDA graph (empty: it can)."""
        from polyaccel.moe.models.base import MoeForCausalLM

        why = fast_path.graph_blockers(
            device=next(model.parameters()).device, fsdp=False, optimizer="flat_adamw" if flat_adamw else "adamw",
            activation_checkpointing=bool(self.args.gradient_checkpointing),
            peft=not isinstance(model, MoeForCausalLM) and hasattr(model, "peft_config"),
            param_dtype=next(model.parameters()).dtype)
        for unmet, reason in ((not isinstance(model, MoeForCausalLM), "the model is not a polyaccel MoE model"),
                              (self.accelerator.num_processes > 1 or self.args.n_gpu > 1,
                               "several processes or GPUs (DDP/FSDP) run the step"),
                              (self.label_smoother is not None or self.compute_loss_func is not None,
                               "a custom loss (label smoothing or compute_loss_func) is set")):
            if unmet:
                why.append(reason)
        return why

    def _graph_loss(self, model: nn.Module, **batch: torch.Tensor) -> torch.Tensor:
        """Trainer's loss of one micro-batch (what ``compute_loss`` + ``training_step`` back-propagate)."""
        n_items = batch.get("num_items_in_batch")
        with self.compute_loss_context_manager():
            loss = model(**batch, use_cache=False).loss
        if n_items is None:
            loss = loss / self.current_gradient_accumulation_steps
        return loss


def tensorize_numpy_rng(path: Path) -> None:
    """Store the NumPy generator state in Trainer's RNG file ``path`` as an int64 tensor.

    Trainer pickles it as an ``ndarray``, which plain ``torch.load(weights_only=True)`` refuses
    (Trainer itself reads it with NumPy allow-listed); ``np.random.set_state`` takes the tensor
    back as is, so plain ``transformers.Trainer`` resumes from the file unchanged.
    """
    if not path.is_file():
        return
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        state = torch.load(path, weights_only=True)
    numpy_state = state.get("numpy")
    if not (isinstance(numpy_state, tuple) and len(numpy_state) > 1 and isinstance(numpy_state[1], np.ndarray)):
        return
    state["numpy"] = (numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:])
    import io

    from polyaccel.core.files import replace_file

    buffer = io.BytesIO()
    torch.save(state, buffer)
    replace_file(path, buffer.getvalue())  # a new file beside it (never through a link), synced, renamed


class Trainer(FastPathMixin, transformers.Trainer):
    """``transformers.Trainer`` that takes polyaccel's fast path where it applies (module docstring)."""


@functools.cache
def fast_trainer_class(base: type) -> type:
    """``base`` (a ``transformers.Trainer`` subclass such as TRL's ``SFTTrainer``) with the
    fast-path overrides: ``fast_trainer_class(SFTTrainer)(model=model, ...)``."""
    if not issubclass(base, transformers.Trainer):
        raise TypeError(f"{base.__name__} is not a transformers.Trainer subclass")
    return type(f"Fast{base.__name__}", (FastPathMixin, base), {"__doc__": Trainer.__doc__})
