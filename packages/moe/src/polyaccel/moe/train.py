"""The fine-tuning loop behind ``polyaccel-moe finetune`` and ``polyaccel-moe bench``.

One function, :func:`finetune`, runs a :class:`~polyaccel.moe.train_config.FinetuneConfig`
in any of three settings: in-process on one device, one rank of ``torchrun`` (reads
``RANK``/``WORLD_SIZE``; gloo on CPU, NCCL on CUDA), or one Ray Train worker (the process
group is already up). With more than one rank the model is sharded with FSDP2 over the
data-parallel mesh of a :class:`~polyaccel.core.ParallelPlan`.

Loss normalisation: every micro-batch's summed token loss is divided by the number of
target tokens in the *global* batch (all micro-batches, all ranks), so the gradient is the
global per-token mean whatever ``micro_batch``, ``grad_accum`` and ``dp`` are; dp=2 with
micro-batch 1 trains exactly like one process with micro-batch 2.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import stat
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyaccel.core.backend import BackendUnavailable
from polyaccel.core.clitools import dumps, stdout_gone
from polyaccel.core.files import (
    is_regular,
    missing_dirs,
    read_regular,
    real_path,
    remove_empty_dirs,
    replace_file,
)
from polyaccel.core.parallel import ParallelPlan
from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe import fast_path, grouped_linear
from polyaccel.moe.data import IGNORE_INDEX, Batches, build_dataset
from polyaccel.moe.ep_checkpoint import index_escape
from polyaccel.moe.flops import mfu, peak_flops, train_flops_per_token
from polyaccel.moe.optim import clip_coefficient, step_scaled
from polyaccel.moe.optim import grad_norm as model_grad_norm  # (train's own grad_norm: a float)
from polyaccel.moe.resume_settings import apply_train_settings, check_resume_settings, model_shape
from polyaccel.moe.train_config import (
    ConfigError,
    FinetuneConfig,
    ModelConfig,
    TrainConfig,
    did_you_mean,
    yaml_numbers,
)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
logger = logging.getLogger("polyaccel.moe")


@dataclasses.dataclass(slots=True)
class TrainResult:
    """What a run did. Throughput figures are medians over steps after the first (warm-up).

    Attributes:
        losses: global mean token loss of each optimizer step run in this process.
        step_times: wall seconds of each of those steps.
        tokens_per_s_per_device: global tokens per step / median step time / world size.
        mfu: model FLOPs utilisation per device, None where the peak is unknown (CPU).
        peak_memory_gib: ``torch.cuda.max_memory_allocated`` (CUDA) or peak RSS (CPU).
    """

    start_step: int
    steps: int
    losses: list[float]
    step_times: list[float]
    tokens_per_step: int
    tokens_per_s_per_device: float | None
    flops_per_token: float
    peak_flops: float | None
    mfu: float | None
    peak_memory_gib: float | None
    world_size: int
    output_dir: str | None
    last_checkpoint: str | None
    fast_path: dict[str, Any] = dataclasses.field(default_factory=dict)
    skipped_steps: int = 0
    note: str | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-able headline numbers."""
        return {k: getattr(self, k) for k in ("start_step", "steps", "tokens_per_step",
                                              "tokens_per_s_per_device", "flops_per_token", "mfu",
                                              "peak_memory_gib", "world_size", "output_dir",
                                              "last_checkpoint", "fast_path", "skipped_steps",
                                              "note")} | {
            "final_loss": self.losses[-1] if self.losses else None}


# --------------------------------------------------------------------------------------------
# Processes and devices
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class Runtime:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool


def init_runtime(device: str | torch.device = "auto") -> Runtime:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1) unless one exists
    (Ray Train), and pick this rank's device (``cuda:LOCAL_RANK`` or CPU)."""
    if isinstance(device, torch.device):
        want_cuda = device.type == "cuda"
    else:
        want_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise ConfigError("train.device is 'cuda' but CUDA is not available here (set train.device=cpu, or auto)",
                              key="train.device")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if not isinstance(device, torch.device):
        device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo")
        owns = True
    if dist.is_initialized():
        return Runtime(dist.get_rank(), dist.get_world_size(), device, owns)
    return Runtime(0, 1, device, owns)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def resolve_model_config(cfg: ModelConfig):
    """The Hugging Face ``PretrainedConfig`` of ``cfg`` (checkpoint config + overrides, or
    built from ``cfg.config`` with its ``model_type``); never touches the network."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    bad_config = (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, StrictDataclassError)
    fields = yaml_numbers(dict(cfg.config))
    if cfg.path is not None:
        try:
            found = Path(cfg.path, "config.json").is_file()
        except OSError as e:  # a folder this user may not enter
            raise ConfigError(f"model.path: cannot read {cfg.path} ({e.strerror or e})", key="model.path") from None
        if not found:
            why = "no config.json" if Path(cfg.path).is_dir() else "it is a file" if Path(cfg.path).exists() \
                else "it does not exist"
            raise ConfigError(f"model.path {cfg.path} is not a Hugging Face checkpoint ({why})", key="model.path")
        if (why := index_escape(cfg.path)) is not None:
            raise ConfigError(f"model.path: {why}")
        try:
            # Never a model folder's own Python (auto_map): refused, not prompted for on stdin.
            loaded = AutoConfig.from_pretrained(cfg.path, local_files_only=True, trust_remote_code=False)
        except bad_config as e:
            raise ConfigError(f"model.path: cannot read {Path(cfg.path, 'config.json')}: {e}") from None
        if fields.get("model_type", loaded.model_type) != loaded.model_type:
            raise ConfigError(f"model.config.model_type={fields['model_type']!r}: model.path {cfg.path} holds a "
                              f"{loaded.model_type!r} model, whose weights only that type loads; leave model_type "
                              "out (or use a checkpoint of that type)", key="model.config.model_type")
        aliases = getattr(loaded, "attribute_map", None) or {}  # an override by another name of a field wins too
        fields = loaded.to_dict() | {aliases.get(k, k): v for k, v in fields.items() if k != "model_type"}
    elif "model_type" not in fields:
        raise ConfigError("model: set path (a checkpoint directory), preset, or config with a model_type")
    else:
        _check_aliases(fields)
    fields.pop("transformers_version", None)
    # Through __init__, so derived fields (e.g. per-layer types) follow the overrides.
    try:
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except bad_config as e:
        text = " ".join(str(e).split())
        raise ConfigError(f"model.config: {text[:300]}{' ...' if len(text) > 300 else ''}") from None


def _check_aliases(fields: dict[str, Any]) -> None:
    """Refuse ``model.config`` fields that set one config field under two names with different
    values (``num_experts`` and ``num_local_experts`` of Qwen3-MoE, a preset using one and an
    override the other): Transformers would keep one and silently drop the other."""
    from transformers import CONFIG_MAPPING

    try:
        aliases = getattr(CONFIG_MAPPING[fields["model_type"]], "attribute_map", None) or {}
    except (KeyError, TypeError):  # an unknown model_type: Transformers names it next
        return
    for alias, name in aliases.items():
        if alias in fields and name in fields and fields[alias] != fields[name]:
            raise ConfigError(f"model.config sets {alias}={fields[alias]!r} and {name}={fields[name]!r}, two names of "
                              f"one field; set only {name}", key=f"model.config.{name}")


def _host_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def validate(cfg: FinetuneConfig, model_config: Any) -> None:
    """Shape checks that need the model's config; raises :class:`ConfigError`."""
    t = cfg.train
    for name in ("seq_len", "micro_batch", "grad_accum", "max_steps", "wgrad_window"):
        if getattr(t, name) != "auto" and getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if t.seq_len < 2:  # the model shifts labels: a one-token sample has nothing to predict
        raise ConfigError(f"train.seq_len must be >= 2 (a sample of {t.seq_len} token has no next token to "
                          "predict: nothing would train)")
    step_bytes = 16 * t.seq_len * t.micro_batch * t.grad_accum  # int64 input ids and labels of one step
    if step_bytes > _host_memory() // 2:
        raise ConfigError(f"one optimizer step of train.micro_batch={t.micro_batch} x train.grad_accum={t.grad_accum} "
                          f"sequences of {t.seq_len} tokens holds {step_bytes / 2**30:,.1f} GiB of token ids, over half "
                          "of this machine's memory: lower train.grad_accum or train.micro_batch")
    for name in ("lr", "eps", "weight_decay"):
        if not (math.isfinite(getattr(t, name)) and getattr(t, name) >= 0):
            raise ConfigError(f"train.{name} must be a finite number >= 0, got {getattr(t, name)}")
    if t.eps == 0:  # a parameter whose gradient is 0 all along (an unused token's row) becomes 0 / 0
        raise ConfigError("train.eps must be > 0 (AdamW divides by sqrt(v) + eps, and v stays 0 for a parameter "
                          "no gradient reaches: its update would be NaN), got 0")
    if not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"train.betas must each be in [0, 1), got {list(t.betas)}")
    if t.grad_clip is not None and not (math.isfinite(t.grad_clip) and t.grad_clip >= 0):
        raise ConfigError(f"train.grad_clip must be a finite number >= 0 (0 or null: no clipping), got {t.grad_clip}")
    if not 0 <= t.seed < 2**63:
        raise ConfigError(f"train.seed must be an integer in [0, 2**63), got {t.seed}")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    if cfg.log.peak_tflops is not None and not (math.isfinite(cfg.log.peak_tflops) and cfg.log.peak_tflops > 0):
        raise ConfigError(f"log.peak_tflops must be a number > 0, got {cfg.log.peak_tflops}")
    if cfg.data.synthetic is not None and cfg.data.synthetic.vocab is not None and cfg.data.synthetic.vocab < 1:
        raise ConfigError(f"data.synthetic.vocab must be >= 1, got {cfg.data.synthetic.vocab}")
    if cfg.lora is not None:
        from polyaccel.moe.lora import settings_from

        try:
            settings_from(cfg.lora)
        except ValueError as e:
            raise ConfigError(f"lora: {e}") from e
    _check_model_sizes(model_config)
    experts = next((getattr(model_config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(model_config, k, None)), None)
    top_k = getattr(model_config, "num_experts_per_tok", None)
    if experts and top_k is not None and not 1 <= top_k <= experts:
        raise ConfigError(f"the model config routes each token to num_experts_per_tok={top_k} experts of {experts} "
                          "(it must be 1 to the number of experts)")
    max_pos = getattr(model_config, "max_position_embeddings", None)
    if max_pos is not None and t.seq_len > max_pos:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds the model's max_position_embeddings={max_pos}")
    if cfg.log.every_steps < 1:
        raise ConfigError(f"log.every_steps must be >= 1, got {cfg.log.every_steps}")
    if cfg.checkpoint.every_steps < 0 or cfg.checkpoint.keep_last < 0:
        raise ConfigError("checkpoint.every_steps and checkpoint.keep_last must be >= 0")
    if cfg.model.backend and cfg.model.implementation != "polyaccel":
        raise ConfigError("model.backend applies to implementation: polyaccel only")
    if cfg.parallel.dense == "replicate" and cfg.parallel.dp_replicate > 1:
        raise ConfigError("parallel.dp_replicate is an FSDP (HSDP) setting; with parallel.dense=replicate every rank "
                          "already holds the whole dense model: leave dp_replicate at 1")


_SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "n_group",
                "topk_group", "v_head_dim", "kv_lora_rank")
"""Model config fields that, when set, must be positive integers: a model of 0 layers (or a
negative count) trains and saves an empty decoder; 0 heads or widths crash mid-run."""


def _check_model_sizes(model_config: Any) -> None:
    """Refuse a model config with a size in :data:`_SIZE_FIELDS` below 1, query heads that the
    key/value heads do not divide, an odd rotary head size (in the architectures polyaccel
    implements, which all use RoPE) or an activation no implementation knows; raises
    :class:`ConfigError`."""
    for key in _SIZE_FIELDS:
        value = getattr(model_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ConfigError(f"the model config's {key}={value} must be at least 1", key=f"model.config.{key}")
    heads, kv = (getattr(model_config, k, None) for k in ("num_attention_heads", "num_key_value_heads"))
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise ConfigError(f"the model config's num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv} (each key/value head serves a whole group of query heads)",
                          key="model.config.num_attention_heads")
    from transformers.activations import ACT2FN

    from polyaccel.core.ops import _ACTIVATIONS
    from polyaccel.moe.models import MODEL_TYPES

    rotary = getattr(model_config, "qk_rope_head_dim", None) or getattr(model_config, "head_dim", None)
    hidden = getattr(model_config, "hidden_size", None)
    if not rotary and isinstance(hidden, int) and isinstance(heads, int):
        rotary = hidden // heads
    if getattr(model_config, "model_type", None) in MODEL_TYPES and isinstance(rotary, int) and rotary % 2:  # else a shape error at the first forward
        raise ConfigError(f"the model config's rotary head size is {rotary} (qk_rope_head_dim, else head_dim, else "
                          "hidden_size / num_attention_heads), an odd number: rotary embeddings turn pairs of "
                          "dimensions", key="model.config.head_dim")
    experts, groups, top = (getattr(model_config, k, None) for k in ("n_routed_experts", "n_group", "topk_group"))
    if isinstance(groups, int) and groups >= 1:  # DeepSeek-V3's grouped router: experts in n_group groups
        if isinstance(experts, int) and experts % groups:
            raise ConfigError(f"the model config's n_routed_experts={experts} is not a multiple of n_group={groups}",
                              key="model.config.n_group")
        if isinstance(top, int) and top > groups:
            raise ConfigError(f"the model config's topk_group={top} is more than n_group={groups}",
                              key="model.config.topk_group")
    pad, vocab = getattr(model_config, "pad_token_id", None), getattr(model_config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ConfigError(f"the model config's pad_token_id={pad} is not a token of its vocab_size={vocab}",
                          key="model.config.pad_token_id")
    std = getattr(model_config, "initializer_range", None)
    if isinstance(std, (int, float)) and not (math.isfinite(std) and std >= 0):
        raise ConfigError(f"the model config's initializer_range={std} must be a finite number >= 0",
                          key="model.config.initializer_range")
    rope = getattr(model_config, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else getattr(model_config, "rope_theta", None)
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float))
                              or not math.isfinite(theta) or theta <= 0):
        raise ConfigError(f"the model config's rope_theta={theta!r} must be a positive number",
                          key="model.config.rope_theta")
    act = getattr(model_config, "hidden_act", None)
    if isinstance(act, str) and act not in ACT2FN and act not in _ACTIVATIONS:  # Transformers' KeyError mid-build
        raise ConfigError(f"the model config's hidden_act={act!r} is not an activation polyaccel or Transformers "
                          f"knows (e.g. {', '.join(_ACTIVATIONS)})", key="model.config.hidden_act")


def auto_model_class(implementation: str) -> tuple[type, type | None]:
    """(AutoModel class, its BackendConfig class or None). ``polyaccel`` falls back to plain
    Transformers, with a warning, while ``polyaccel.moe`` does not export its model."""
    import transformers

    if implementation == "transformers":
        return transformers.AutoModelForCausalLM, None
    try:
        from polyaccel.moe import AutoModelForCausalLM, BackendConfig
    except ImportError as e:
        warnings.warn(f"polyaccel.moe.AutoModelForCausalLM is not available ({e}); training with "
                      "transformers.AutoModelForCausalLM instead", stacklevel=2)
        return transformers.AutoModelForCausalLM, None
    return AutoModelForCausalLM, BackendConfig


def backend_config(cfg: ModelConfig) -> Any:
    """``BackendConfig(**cfg.backend)`` for the polyaccel model (None for plain Transformers);
    unknown fields and refused values become :class:`ConfigError`."""
    _, backend_cls = auto_model_class(cfg.implementation)
    if backend_cls is None:
        return None
    fields = [f.name for f in dataclasses.fields(backend_cls)]
    for key in cfg.backend:
        if key not in fields:
            raise ConfigError(f"unknown config key 'model.backend.{key}'{did_you_mean(key, fields)}; "
                              f"BackendConfig fields: {', '.join(fields)}")
    try:
        return backend_cls(**yaml_numbers(cfg.backend))
    except (TypeError, ValueError, ImportError) as e:  # ImportError: a choice whose library is not installed
        raise ConfigError(f"model.backend: {e}") from e


def build_model(cfg: ModelConfig, model_config: Any, *, dtype: torch.dtype, device: torch.device,
                weights: str | Path | None = None, train: TrainConfig | None = None, lora: Any = None,
                world_size: int = 1) -> nn.Module:
    """Instantiate the model in ``dtype`` on ``device``: random init from ``model_config``, or
    the weights of ``weights`` (a checkpoint to resume) or ``cfg.path``.

    ``train`` (with ``lora``, the config's LoRA section or None, and ``world_size``): the model
    is built to be trained that way; the pre-flight memory check then counts its gradients
    and AdamW moments too (:func:`_check_weights_fit`), else the weights alone."""
    _check_layers_fit(model_config)  # here, where the model is built (not on a Ray driver)
    cls, _ = auto_model_class(cfg.implementation)
    kwargs: dict[str, Any] = {"dtype": dtype}
    backend = backend_config(cfg)
    if backend is not None:
        kwargs["backend"] = backend
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    source = weights or cfg.path
    if source is not None and (why := index_escape(source)) is not None:
        raise ConfigError(why)
    if device.type != "meta" and (source is None or train is not None):
        _check_weights_fit(cls, model_config, kwargs, device, train=train, lora=lora, world_size=world_size)
    if source is not None:
        # Loaded on the CPU, then moved: a device_map would need `accelerate`.
        # Safetensors only: a folder of pickled weights (pytorch_model.bin) is refused, never unpickled.
        model, info = cls.from_pretrained(str(source), config=model_config, local_files_only=True,
                                          trust_remote_code=False, use_safetensors=True, output_loading_info=True,
                                          **kwargs)
        if missing := sorted(info.get("missing_keys") or ()):  # Transformers would train them from random values
            raise ckpt.CheckpointError(
                f"{source} lacks {len(missing)} weights of the model ({', '.join(missing[:6])}"
                f"{' ...' if len(missing) > 6 else ''}): training would start them from random values. Use a "
                "complete checkpoint, or the model config it was written with (its config.json)")
    else:
        with device:  # random init straight on the device
            model = cls.from_config(model_config, **kwargs)
    return model.to(device)


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` (a GPU's free memory, or the host's available RAM: Linux's
    ``MemAvailable``, which counts reclaimable page cache), or None when unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


_LAYER_FLOOR_BYTES = 16 * 1024
"""What a decoder layer takes in host memory at the least, weights aside: its modules and
parameter objects (23-40 KiB per layer of the tiny presets of all four architectures, built on
the meta device, by tracemalloc)."""


def _check_layers_fit(model_config: Any) -> None:
    """Refuse a config whose layers could not fit the host's memory even at their smallest
    (each at least two ``hidden_size``-square bf16 attention matrices plus its module objects),
    before anything is built: ``num_hidden_layers: 100000000`` in a config.json would
    otherwise build modules one by one until the machine runs out of memory, before the exact
    count on the meta device could run."""
    layers, hidden = (getattr(model_config, k, 0) or 0 for k in ("num_hidden_layers", "hidden_size"))
    if not (isinstance(layers, int) and isinstance(hidden, int)):  # (Transformers' configs check the types)
        return
    floor = layers * (2 * 2 * hidden * hidden + _LAYER_FLOOR_BYTES)
    free = available_memory(torch.device("cpu"))
    if free is not None and floor > free:
        raise ConfigError(f"the model config's {layers} layers of hidden size {hidden} take at least "
                          f"{floor / 2**30:.1f} GiB of host memory; {free / 2**30:.1f} GiB is available")


def training_state_bytes(weights: int, *, model_config: Any = None, lora: Any = None,
                         world_size: int = 1) -> dict[str, int]:
    """Bytes of what training keeps besides activations, a lower bound of its peak: the
    weights (``weights`` bytes, as built: in the param dtype), the gradients of the trained
    params and AdamW's two moments, both in the trained params' dtype (``FlatAdamW`` and
    ``torch.optim.AdamW`` keep them in the param dtype: bf16, or fp32 with ``fp32_master``).
    Full fine-tuning trains every weight; LoRA (``lora``: the config's section) only the
    adapters (fp32: PEFT's ``autocast_adapter_dtype``; counted by
    :func:`~polyaccel.moe.lora.lora_param_count`, 0 where it does not know the architecture),
    the frozen weights getting none. With several ranks each holds at least the whole model
    while it is built (every rank loads it before sharding) and its share of the state
    (FSDP2 shards it): ``max(weights, all / world_size)``. Keys: ``weights``, ``grads``,
    ``moments``, ``total`` (what one rank needs)."""
    if lora is None:
        grads = weights
    else:
        adapters = 0
        try:
            from polyaccel.moe.lora import lora_param_count, settings_from

            adapters = lora_param_count(model_config, settings_from(lora)) * 4
        except (AttributeError, ImportError, TypeError, ValueError):  # unknown architecture: count none
            pass
        weights += adapters
        grads = adapters
    parts = {"weights": weights, "grads": grads, "moments": 2 * grads}
    everything = sum(parts.values())
    parts["total"] = max(weights, -(-everything // max(1, world_size)))
    return parts


def _check_weights_fit(cls: Any, model_config: Any, kwargs: dict[str, Any], device: torch.device, *,
                       train: TrainConfig | None = None, lora: Any = None, world_size: int = 1) -> None:
    """Raise :class:`ConfigError` before a model is built whose weights (with ``train``:
    weights, gradients and AdamW moments, :func:`training_state_bytes`) exceed what ``device``
    has free (:func:`available_memory`), instead of dying out of memory minutes later. The
    weights are counted exactly on the meta device (a fraction of a second for the 5.6B
    parameters of ``qwen3-30b-a3b-L8``); activations are not counted, so a refused run could
    never have fitted."""
    with torch.device("meta"):
        shapes = cls.from_config(model_config, **kwargs)
    weights = sum(p.numel() * p.element_size() for p in shapes.parameters())
    free = available_memory(device)
    if free is None:
        return
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    if train is None:
        if weights > free:
            raise ConfigError(f"model.config: the model's weights alone take {gib(weights)}; {device} has "
                              f"{gib(free)} free. Choose a smaller config (hidden_size, layers, experts)")
        return
    dtype = kwargs.get("dtype", torch.float32)
    parts = training_state_bytes(weights, model_config=model_config, lora=lora, world_size=world_size)
    if parts["total"] <= free:
        return
    if lora is not None:
        state = (f"the model's weights alone take {gib(weights)} (frozen: no gradients), the LoRA adapters' gradients "
                 f"{gib(parts['grads'])} and AdamW's two moments {gib(parts['moments'])} (fp32)")
    else:
        state = (f"the model's weights alone take {gib(weights)}, their gradients {gib(parts['grads'])} and AdamW's two "
                 f"moments {gib(parts['moments'])} ({str(dtype).removeprefix('torch.')}, the param dtype)")
    per_rank = f" per rank of {world_size}" if world_size > 1 else ""
    smaller = ("e.g. --preset qwen3-moe-tiny on a CPU, or fewer layers: --set model.config.num_hidden_layers=2"
               if device.type == "cpu" else "fewer layers: --set model.config.num_hidden_layers=2; or more GPUs: "
               "under torchrun FSDP2 shards gradients and optimizer state")
    raise ConfigError(
        f"model.config: training this model needs at least {gib(parts['total'])}{per_rank} on {device} before any "
        f"activations ({parts['total']:,} bytes): {state}; {device} has {gib(free)} free ({free:,} bytes). Choose "
        f"a smaller preset or config ({smaller}), or LoRA (a lora section: only the adapters get gradients and "
        "AdamW state)")


# --------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------

def lr_factor(t: TrainConfig) -> Callable[[int], float]:
    """LR multiplier for optimizer step ``s`` (0-based): linear warm-up over
    ``warmup_steps``, then cosine/linear decay to ``min_lr_ratio`` at ``max_steps``, or flat."""
    def factor(s: int) -> float:
        if s < t.warmup_steps:
            return (s + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        progress = min(1.0, (s - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape
    return factor


def build_optimizer(model: nn.Module, t: TrainConfig, device: torch.device,
                    overwritten: Iterable[torch.Tensor] = ()) -> torch.optim.Optimizer:
    """AdamW over the trainable params; no weight decay on vectors (norms, biases).

    ``t.optimizer``: ``flat_adamw`` is :class:`polyaccel.moe.optim.FlatAdamW` (flat buffers, one
    ``ops.adamw_step_`` per buffer; it leaves the grads of ``overwritten`` params unzeroed);
    ``adamw`` is ``torch.optim.AdamW``, fused on CUDA; ``auto`` picks ``flat_adamw`` when every
    param is a plain tensor (one process, or ``parallel.dense=replicate``), else ``adamw``
    (FSDP2's DTensor params).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    kind = t.optimizer
    if kind == "auto":
        kind = "flat_adamw" if all(type(p.data) is torch.Tensor for p in params) else "adamw"
    if kind == "flat_adamw":
        from polyaccel.moe.optim import FlatAdamW

        try:
            return FlatAdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, grads_overwritten=overwritten)
        except ValueError as e:
            raise ConfigError(f"train.optimizer=flat_adamw: {e} (or set train.optimizer=adamw)") from e
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, fused=fused,
                             foreach=None if fused else True)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

def finetune(cfg: FinetuneConfig, *, device: torch.device | None = None,
             stop_after: int | None = None) -> TrainResult:
    """Run (or resume) the fine-tuning job ``cfg`` describes; see the module docstring.

    :param device: force this process's device (Ray Train passes its own); default from
        ``cfg.train.device`` and ``LOCAL_RANK``.
    :param stop_after: return after this optimizer step, as if pre-empted (the LR schedule
        still spans ``train.max_steps``; no final output is written). Tests resume with it.
    """
    from transformers.utils import logging as hf_logging

    rt = init_runtime(device or cfg.train.device)
    bars = hf_logging.is_progress_bar_enabled()
    if not cfg.log.progress_bar or rt.rank != 0:  # nor Transformers' loading/saving bars
        hf_logging.disable_progress_bar()
    try:
        with _RunLocks(cfg, rt.rank):
            return _finetune(cfg, rt, stop_after)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if rt.owns_process_group:
            dist.destroy_process_group()


_LOCK_HEADER = b"polyaccel-moe lock, pid "
"""How a run's lock file starts (then its process id); a file on a lock path that does not
is a user's: refused, never truncated or removed."""


class _RunLocks:
    """An exclusive ``flock`` on ``<folder>.lock`` beside ``checkpoint.dir`` and ``output_dir``
    for the length of a run (rank 0 takes them; every rank learns the verdict): a second run
    writing the same folders (the same command started twice, a requeued job whose first
    copy still runs) is a :class:`ConfigError` before it loads anything, instead of removing
    the first run's checkpoint in progress or mixing their files. Lock files are removed on
    release; one a ``kill -9`` left is harmless (the kernel drops its lock)."""

    def __init__(self, cfg: FinetuneConfig, rank: int):
        self.folders = [(key, Path(folder)) for key, folder in (("checkpoint.dir", cfg.checkpoint.dir),
                                                                  ("output_dir", cfg.output_dir)) if folder]
        self.rank, self.held, self.made = rank, [], []

    def __enter__(self) -> None:
        failure = None
        if self.rank == 0:
            try:
                for key, folder in self.folders:
                    self._acquire(key, folder)
            except ConfigError as e:
                self.release()
                failure = str(e)
        if (failure := _rank0_verdict(failure)) is not None:
            raise ConfigError(failure)

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _acquire(self, key: str, folder: Path) -> None:
        import fcntl

        _writable_dir(key, folder)  # what check_outputs says of a folder that cannot be made, said first
        path = _lock_path(folder)
        if path in (p for _, p in self.held):  # output_dir and checkpoint.dir one folder: refused later
            return
        self.made += [d for d in missing_dirs(path.parent) if d not in self.made]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"{key}: cannot make its lock file {path} ({e.strerror or e})", key=key) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device...: never read nor written
            os.close(fd)
            raise ConfigError(f"{key}: {path} exists and is not a lock file of polyaccel-moe; remove it or choose "
                              "another folder", key=key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            head = os.pread(fd, 64, 0)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                pid = head.removeprefix(_LOCK_HEADER).strip().decode(errors="replace")
                raise ConfigError(f"{key} {folder} is being written by another run ({f'pid {pid}' if pid.isdigit() else path}); "
                                  "wait for it to end, or choose another folder", key=key) from None
            raise ConfigError(f"{key}: cannot lock {path} ({e.strerror or e})", key=key) from None
        head = os.pread(fd, 64, 0)
        if head and not re.fullmatch(rb"polyaccel-moe lock, pid \d+\n?", head):
            os.close(fd)
            raise ConfigError(f"{key}: {path} exists and is not a lock file of polyaccel-moe; remove it or choose "
                              "another folder", key=key)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _LOCK_HEADER + f"{os.getpid()}\n".encode(), 0)
        self.held.append((fd, path))

    def release(self) -> None:
        """Remove the lock files (then drop the locks) and the folders made for them, if empty."""
        while self.held:
            fd, path = self.held.pop()
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)
        remove_empty_dirs(sorted(self.made, key=lambda d: len(d.parts), reverse=True))
        self.made = []


def _lock_path(folder: Path) -> Path:
    """The lock file of an output folder: ``<folder>.lock`` beside it."""
    folder = Path(os.path.abspath(folder))
    return folder.with_name(folder.name + ".lock")


def _is_run_lock(path: Path) -> bool:
    """Whether ``path`` is a run's lock file (a ``checkpoint.dir`` kept inside ``output_dir``
    has its lock there)."""
    if not path.name.endswith(".lock"):
        return False
    head = read_regular(path, 4096)  # (not a link, FIFO or device)
    return head is not None and head[:len(_LOCK_HEADER)] in (_LOCK_HEADER, b"")


def check_config(cfg: FinetuneConfig, *, world_size: int, device: torch.device | None) -> tuple[Any, Path | None]:
    """Every check of ``cfg`` that needs no weights loaded (the local run's and, on the Ray
    driver, before any worker starts): config values, model config, parallel layout, output
    locations (proven writable; nothing is created yet), the checkpoint to resume from and the
    settings it was written with. Raises :class:`ConfigError`; returns the
    resolved model config and the checkpoint to resume from (or None).

    :param device: the device the ranks train on; None: not known yet (the CUDA-only checks of
        ``train.cuda_graph: true`` are then left to the caller).
    """
    t = cfg.train
    model_config = resolve_model_config(cfg.model)
    validate(cfg, model_config)
    backend_config(cfg.model)  # fail on a bad backend section before loading anything
    _check_attention(cfg.model, model_config)
    fsdp = world_size > 1 and cfg.parallel.dense == "fsdp"
    if t.optimizer == "flat_adamw" and fsdp:
        raise ConfigError("train.optimizer=flat_adamw does not run under FSDP2 (it shards the parameters as "
                          "DTensors); use train.optimizer=adamw or auto, or parallel.dense=replicate")
    if t.cuda_graph is True:
        for why in fast_path.graph_blockers(device=device or torch.device("cuda"), fsdp=fsdp, optimizer=t.optimizer,
                                            activation_checkpointing=t.activation_checkpointing,
                                            param_dtype=_param_dtype(t)):
            raise ConfigError(f"train.cuda_graph=true: {why}")
    parallel_plan(cfg, world_size, model_config)
    check_outputs(cfg)
    resume_from = ckpt.find_resume(cfg.checkpoint.dir, cfg.checkpoint.resume)
    _check_later_checkpoints(cfg, resume_from)
    _check_foreign_step_dirs(cfg, resume_from)
    _check_checkpoint_kind(cfg, resume_from)
    _check_inputs_not_pruned(cfg)
    if resume_from is not None:
        # A full model's shape is checked once its weights load (the differing tensors named).
        check_resume_settings(cfg, model_config, resume_from, shape=cfg.lora is not None)
    return model_config, resume_from


def _check_attention(cfg: ModelConfig, model_config: Any) -> None:
    """Refuse an ``attn_implementation`` that Transformers refuses when it builds the model (an
    unknown name, or a kernel whose package is missing: ``flash_attention_2`` without
    ``flash-attn``) before anything loads, by building it on the meta device; it was a traceback
    once the data had been read. Our models ignore the key (a warning: ``model.backend.attn``)."""
    if not cfg.attn_implementation or cfg.implementation != "transformers":
        return
    cls, _ = auto_model_class(cfg.implementation)
    try:
        with torch.device("meta"):
            cls.from_config(copy.deepcopy(model_config), attn_implementation=cfg.attn_implementation)
    except (ValueError, ImportError) as e:
        text = " ".join(str(e).split())
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r}: {text[:300]}"
                          f"{' ...' if len(text) > 300 else ''}", key="model.attn_implementation") from None


def parallel_plan(cfg: FinetuneConfig, world_size: int, model_config: Any) -> ParallelPlan:
    """The run's :class:`ParallelPlan`, checked against the world size and expert count."""
    try:
        plan = ParallelPlan(dp=cfg.parallel.dp or world_size, ep=cfg.parallel.ep, dp_replicate=cfg.parallel.dp_replicate)
        plan.validate(world_size, _num_experts(model_config))
    except ValueError as e:
        raise ConfigError(f"parallel: {e}") from e
    return plan


def _num_experts(model_config: Any) -> int | None:
    return next((getattr(model_config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                 if getattr(model_config, k, None)), None)


def check_run(cfg: FinetuneConfig, *, world_size: int, device: torch.device | None) -> None:
    """What the training function checks before it trains, for a driver that starts the
    ranks elsewhere (Ray): :func:`check_config`, the model shape of the checkpoint to resume
    from, and the data (files, records, token ids), unless that checkpoint is already at
    ``train.max_steps``. Raises :class:`ConfigError`."""
    model_config, resume_from = check_config(cfg, world_size=world_size, device=device)
    if resume_from is not None and (ckpt.checkpoint_step(resume_from) or 0) >= cfg.train.max_steps:
        return  # the ranks only report it
    if resume_from is not None and cfg.lora is None:  # no weights load here to name differing tensors
        check_resume_settings(cfg, model_config, resume_from, shape=True)
    build_dataset(cfg.data, seq_len=cfg.train.seq_len, vocab_size=model_config.vocab_size, seed=cfg.train.seed,
                  tokenizer_path=cfg.model.path, cache_dir=data_cache_dir(cfg))


#: the folder of ``checkpoint.dir`` holding the run's token caches
DATA_CACHE = ".data_cache"


def data_cache_dir(cfg: FinetuneConfig) -> Path | None:
    """Where the run's token cache goes (:mod:`polyaccel.moe.data_cache`): ``.data_cache`` in
    ``checkpoint.dir``, which resuming reads anyway; None without it (``output_dir`` stays
    unmade until the final save: a pre-empted run or a failed save leaves none) or with
    ``data.cache: false``."""
    folder = cfg.checkpoint.dir
    return Path(folder) / DATA_CACHE if folder and cfg.data.cache else None


def _finetune(cfg: FinetuneConfig, rt: Runtime, stop_after: int | None) -> TrainResult:
    t = cfg.train
    model_config, resume_from = check_config(cfg, world_size=rt.world_size, device=rt.device)
    fsdp = rt.world_size > 1 and cfg.parallel.dense == "fsdp"
    replicas = rt.world_size > 1 and cfg.parallel.dense == "replicate"
    plan = parallel_plan(cfg, rt.world_size, model_config)

    fused_accumulation = backend_config(cfg.model) is None or backend_config(cfg.model).grad_accumulation == "fused"
    fast = fast_path.plan(model_config=model_config, device=rt.device, cuda_graph=t.cuda_graph,
                          wgrad_window=t.wgrad_window, fsdp=fsdp, optimizer=t.optimizer,
                          activation_checkpointing=t.activation_checkpointing,
                          fused_grad_accumulation=fused_accumulation and cfg.model.implementation == "polyaccel",
                          tokens_per_micro_batch=t.micro_batch * t.seq_len, grad_accum=t.grad_accum,
                          param_dtype=_param_dtype(t))
    t = dataclasses.replace(t, cuda_graph=fast.cuda_graph, wgrad_window=fast.wgrad_window)

    if resume_from is not None and (ckpt.checkpoint_step(resume_from) or 0) >= t.max_steps:
        return _already_finished(cfg, rt, model_config, resume_from)
    # Told before the output is written over (docs allow it), found before this run prunes checkpoints.
    replaced = _foreign_output(cfg, resume_from) if cfg.output_dir and rt.rank == 0 else None
    source = build_dataset(cfg.data, seq_len=t.seq_len, vocab_size=model_config.vocab_size, seed=t.seed,
                           tokenizer_path=cfg.model.path, cache_dir=data_cache_dir(cfg))
    batches = Batches(source, micro_batch=t.micro_batch, grad_accum=t.grad_accum, dp_rank=rt.rank,
                      dp_size=rt.world_size, seed=t.seed, shuffle=cfg.data.shuffle)

    compute_dtype = _DTYPES[t.dtype]
    param_dtype = torch.float32 if t.fp32_master else compute_dtype
    torch.manual_seed(t.seed)  # identical random init on every rank (FSDP2 does not broadcast)
    model = _load_model(cfg.model, model_config, dtype=param_dtype, device=rt.device,
                        weights=resume_from if cfg.lora is None else None, train=t, lora=cfg.lora,
                        world_size=rt.world_size)
    model.train()
    if t.activation_checkpointing:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora is not None:  # PEFT adapters on the frozen model (a checkpoint holds only the adapters)
        from polyaccel.moe.lora import finetune_setup

        model, t = finetune_setup(model, cfg.lora, t, resume_from, world_size=rt.world_size, ep=cfg.parallel.ep,
                                  graph_asked=cfg.train.cuda_graph is True)
    elif resume_from is not None:  # loaded without a shape error; the layer count etc. may still differ
        check_resume_settings(cfg, model_config, resume_from, shape=True)
    if resume_from is not None or cfg.model.path is not None:
        _check_loaded_weights(model, cfg, resume_from)
    sharded = rt.world_size > 1
    grad_sync = None
    if fsdp:
        from polyaccel.moe.parallelize import apply_fsdp

        apply_fsdp(model, plan, plan.build(rt.world_size, rt.device.type), param_dtype=compute_dtype,
                   reduce_dtype=torch.float32)
    elif replicas:
        from polyaccel.moe.dense_replicas import apply_dense_replicas

        grad_sync = apply_dense_replicas(model, plan.build(rt.world_size, rt.device.type),
                                         tokens_per_rank=t.micro_batch * t.seq_len)
        if t.cuda_graph:
            try:
                _check_graphable_dispatch(model)
            except ConfigError as e:
                if cfg.train.cuda_graph is True:  # asked for explicitly: an error
                    raise
                fast_path.say_once(f"CUDA graph per micro-batch off: {e}")
                t = dataclasses.replace(t, cuda_graph=False)
    autocast = (torch.autocast(rt.device.type, dtype=compute_dtype)
                if param_dtype != compute_dtype and not fsdp else contextlib.nullcontext())
    # Under FSDP2 each rank's loss is scaled by the world size (FSDP averages the gradients);
    # with dense replicas it is the rank's share of the global loss (gradients are summed).
    loss_world = rt.world_size if fsdp else 1
    micro_step = _graphed_micro_step(model, t, autocast, rt.world_size) if t.cuda_graph else None
    optimizer = build_optimizer(model, t, rt.device,
                                overwritten=micro_step.overwritten_params if micro_step is not None else ())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(t))
    step = skipped_before = 0
    if resume_from is not None:
        try:
            state = ckpt.load_trainer_state(resume_from, model, optimizer, per_rank_optimizer=replicas)
        except (ckpt.LayoutMismatch, FileNotFoundError) as e:
            raise ConfigError(f"checkpoint.resume: {e}") from e
        step = _restore_position(resume_from, state, scheduler, batches)
        apply_train_settings(optimizer, scheduler, t, _saved_section(state, "train"))
        skipped_before = int(state.get("skipped_steps", 0))
    start_step = step

    tokens_per_step = batches.samples_per_step * t.seq_len
    flops_tok = train_flops_per_token(model_config, t.seq_len, frozen_base=cfg.lora is not None)
    peak = peak_flops(rt.device, cfg.log.peak_tflops)
    bar = _progress_bar(cfg, rt, start_step)
    metrics_file = _open_metrics(cfg.log.metrics_jsonl, start_step) if cfg.log.metrics_jsonl and rt.rank == 0 else None
    skipped = 0
    losses: list[float] = []
    times: list[float] = []
    last_saved: Path | None = None
    try:
        while step < min(t.max_steps, stop_after or t.max_steps):
            t0 = time.perf_counter()
            micro_batches = batches.next_step()
            n_targets = torch.tensor(sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches),
                                     dtype=torch.float32, device=rt.device)
            if sharded:
                dist.all_reduce(n_targets)
            n_targets.clamp_(min=1)
            loss_sum = torch.zeros((), device=rt.device)
            n_mb = len(micro_batches)
            aux_parts = n_mb if fsdp else n_mb * rt.world_size  # the router aux loss is averaged over these
            for m, mb in enumerate(micro_batches):
                if micro_step is not None:
                    loss_sum += micro_step(input_ids=mb["input_ids"].to(rt.device, non_blocking=True),
                                           labels=mb["labels"].to(rt.device, non_blocking=True),
                                           num_items_in_batch=n_targets, micro_batch=(m, n_mb)).float()
                    continue
                if fsdp:
                    model.set_requires_gradient_sync(m == n_mb - 1)
                with grouped_linear.wgrad_window(defer=grouped_linear.defers(m, n_mb, t.wgrad_window)):
                    with autocast:
                        out = model(input_ids=mb["input_ids"].to(rt.device), labels=mb["labels"].to(rt.device),
                                    num_items_in_batch=n_targets, use_cache=False)
                    loss_part = _scaled_loss(out, model.config, loss_world, aux_parts)
                    loss_part.backward()
                loss_sum += loss_part.detach().float() / loss_world
            grouped_linear.flush_wgrad()
            if fsdp:
                grad_norm, grad_scale = _clip_grads(model, t.grad_clip), None
            else:
                # Clipping folded into the optimizer's pass (FlatAdamW), no host sync before it.
                if grad_sync is not None:
                    grad_sync.all_reduce()
                known = micro_step.expert_grad_sumsq() if micro_step is not None else None
                grad_norm = grad_sync.grad_norm() if grad_sync is not None else model_grad_norm(model, optimizer, known)
                grad_scale = clip_coefficient(grad_norm, t.grad_clip)
            lr = scheduler.get_last_lr()[0]
            if sharded:
                dist.all_reduce(loss_sum)
            # skip decides before the optimizer step (one host sync); stop checks after it, as
            # nothing of a stopped step is ever saved.
            skip = t.nonfinite == "skip" and not _finite(loss_sum, grad_norm)
            if not skip:
                step_scaled(optimizer, grad_scale)
            grad_norm = float(grad_norm)
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_sum.item()
            step += 1
            if skip:
                skipped += 1
                logger.warning("polyaccel.moe: step %d: non-finite loss (%s) or gradient norm (%s); optimizer step "
                               "skipped (train.nonfinite=skip; %d skipped so far)", step, loss, grad_norm, skipped)
            elif not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteError(step, loss, grad_norm, last_saved or resume_from)
            times.append(time.perf_counter() - t0)
            losses.append(loss)

            tok_s = tokens_per_step / times[-1] / rt.world_size
            record = {"step": step, "loss": _finite_or_none(loss), "grad_norm": _finite_or_none(grad_norm), "lr": lr,
                      "tokens_per_s_per_device": tok_s, "mfu": mfu(tok_s, flops_tok, peak)}
            if skip:
                record["skipped"] = True
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}",
                                mfu="n/a" if record["mfu"] is None else f"{record['mfu']:.1%}")
            if rt.rank == 0 and step % cfg.log.every_steps == 0:
                if metrics_file is not None:
                    metrics_file = _write_metrics(metrics_file, record)
                if bar is None:
                    _print_metrics(dumps(record))
            if step == t.max_steps:  # neither the final checkpoint nor output_dir of a model that did not train
                _check_trained(model, skipped_before + skipped, step, last_saved or resume_from)
            every = cfg.checkpoint.every_steps
            if cfg.checkpoint.dir and ((every and step % every == 0) or step == t.max_steps):
                created = missing_dirs(Path(cfg.checkpoint.dir))  # what a failed save removes again
                try:
                    last_saved = ckpt.save_checkpoint(cfg.checkpoint.dir, step, model, optimizer,
                                                      _trainer_extra(cfg, scheduler, batches, model_config,
                                                                     skipped_before + skipped),
                                                      keep_last=cfg.checkpoint.keep_last,
                                                      per_rank_optimizer=replicas)
                except Exception as e:
                    if dist.is_initialized() and not isinstance(e, ckpt.CheckpointWriteError):
                        raise  # a collective failed (a rank died...): the ranks cannot act together
                    # Every rank is here (the save agreed on the failure): rank 0 keeps the weights.
                    _raise_on_any_rank(_checkpoint_failed(cfg, model, step, e, last_saved or resume_from,
                                                          final=step == t.max_steps, created=created,
                                                          writer=rt.rank == 0))
    finally:
        if bar is not None:
            bar.close()
        if metrics_file is not None:
            metrics_file.close()

    if cfg.output_dir and step == t.max_steps:
        foreign = None
        if replaced:  # warned by the save, once it knows the files it writes (what it replaces, what it keeps)
            foreign = (f"output_dir {cfg.output_dir} holds a saved model ({replaced}) that "
                       + (f"no checkpoint in this run's checkpoint.dir {cfg.checkpoint.dir} matches (another run's?)"
                          if cfg.checkpoint.dir else "this run did not write (it has no checkpoint.dir)"))
        save_final(model, cfg, rt, step=step, final_checkpoint=last_saved, foreign=foreign)
    measured = times[1:] or times
    tok_s_dev = tokens_per_step / statistics.median(measured) / rt.world_size if measured else None
    return TrainResult(
        start_step=start_step, steps=step, losses=losses, step_times=times, tokens_per_step=tokens_per_step,
        tokens_per_s_per_device=tok_s_dev, flops_per_token=flops_tok, peak_flops=peak,
        mfu=mfu(tok_s_dev, flops_tok, peak) if tok_s_dev else None, peak_memory_gib=_peak_memory_gib(rt.device),
        world_size=rt.world_size, output_dir=cfg.output_dir,
        last_checkpoint=str(last_saved or resume_from) if (last_saved or resume_from) else None,
        fast_path=_fast_path_summary(model, optimizer, t), skipped_steps=skipped)


def _restore_position(path: Path, state: dict[str, Any], scheduler: Any, batches: Batches) -> int:
    """Load a checkpoint's LR schedule and data position; return its step. A trainer state
    without them is a :class:`~polyaccel.moe.checkpoint.CheckpointError`; one whose data order
    this run cannot continue (another ``train.seed``, ``data.shuffle``, or data that packs into
    another number of samples) a :class:`ConfigError`."""
    try:
        scheduler.load_state_dict(state["scheduler"])
        batches.load_state_dict(state["data"])
        return int(state["step"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ckpt.CheckpointError(f"{path / ckpt.TRAINER_STATE} is not a polyaccel trainer state "
                                   f"({type(e).__name__}: {e})") from None
    except ValueError as e:
        raise ConfigError(f"checkpoint.resume: {path}: {e}; resume with the data, data settings, train.seq_len "
                          "and train.seed it was written with, or use a new checkpoint.dir") from None


def _param_dtype(t: TrainConfig) -> torch.dtype:
    """The dtype parameters are stored in."""
    return torch.float32 if t.fp32_master else _DTYPES[t.dtype]


def _fast_path_summary(model: nn.Module, optimizer: torch.optim.Optimizer, t: TrainConfig) -> dict[str, Any]:
    """Which parts of the fast path this run took (see :mod:`polyaccel.moe.fast_path`)."""
    from polyaccel.moe import attention_choice

    attention = (sorted(set(attention_choice.chosen().values()))
                 or sorted({str(m.attn_impl) for m in model.modules() if hasattr(m, "attn_impl")}))
    return {"compiled_layers": any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()),
            "optimizer": type(optimizer).__name__, "cuda_graph": bool(t.cuda_graph), "wgrad_window": t.wgrad_window,
            "attention": "+".join(attention)}


def _graphed_micro_step(model: nn.Module, t: TrainConfig, autocast: Any, world_size: int) -> Any:
    """The micro-step (scaled loss, backward) as a replayed CUDA graph: one process, or dense
    replicas (the loss is this rank's share of the global loss; gradients are summed later)."""
    from polyaccel.moe.graphed_step import GraphedMicroStep

    def loss_fn(input_ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor) -> torch.Tensor:
        with autocast:
            out = model(input_ids=input_ids, labels=labels, num_items_in_batch=num_items_in_batch, use_cache=False)
        return _scaled_loss(out, model.config, 1, t.grad_accum * world_size)

    return GraphedMicroStep(model, warmup=2, wgrad_window=t.wgrad_window, loss_fn=loss_fn)


def _check_graphable_dispatch(model: nn.Module) -> None:
    """Raise ConfigError unless every expert dispatcher runs without host syncs."""
    from polyaccel.moe.expert_parallel import expert_modules

    for m in expert_modules(model):
        d = getattr(m, "dispatcher", None)
        if d is not None and not d.sync_free:
            raise ConfigError(f"train.cuda_graph=true with expert parallelism needs a dispatcher that never waits "
                              f"on the host; {d.name!r} reads its split sizes on the host every layer. Use "
                              "model.backend.dispatcher=allgather")


def _scaled_loss(out: Any, config: Any, world_size: int, micro_batches: int) -> torch.Tensor:
    """The micro-batch loss to back-propagate so that, after FSDP averages gradients over
    ``world_size`` ranks (1: gradients are summed over ranks), the step's gradient is the
    global per-token mean of the token loss (already divided by the global target count) plus
    the router's load-balancing loss averaged over ``micro_batches`` (micro-batches of a step,
    times the ranks when gradients are summed)."""
    aux = getattr(out, "aux_loss", None)
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if aux is None or not getattr(config, "output_router_logits", False) or not coef:
        return out.loss * world_size
    aux_part = coef * aux.to(out.loss.device)
    return (out.loss - aux_part) * world_size + aux_part / micro_batches


def _clip_grads(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm to ``max_norm`` (None: only measure); return the norm."""
    from polyaccel.moe.expert_parallel import clip_grad_norm_

    # Parameters may live on two meshes (FSDP's dp mesh, the experts' MoE mesh).
    return float(clip_grad_norm_(model.parameters(), max_norm))


def _trainer_extra(cfg: FinetuneConfig, scheduler, batches: Batches, model_config: Any,
                   skipped_steps: int) -> dict[str, Any]:
    return {"scheduler": scheduler.state_dict(), "data": batches.state_dict(), "config": cfg.to_dict(),
            "model_shape": model_shape(model_config), "skipped_steps": skipped_steps}


def _saved_section(state: dict[str, Any], name: str) -> dict[str, Any]:
    """Section ``name`` of the run config a trainer state records (empty when absent)."""
    config = state.get("config")
    section = config.get(name) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else {}


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite (``train.nonfinite: stop``)."""

    def __init__(self, step: int, loss: float, grad_norm: float, last_checkpoint: Path | None):
        self.step = step
        kept = f"the last checkpoint, {last_checkpoint}, is untouched" if last_checkpoint else "no checkpoint was written"
        super().__init__(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopped before "
                         f"saving anything from this step ({kept}). Lower train.lr, check the data, or set "
                         "train.nonfinite=skip to skip such steps")


class NothingTrainedError(NonFiniteError):
    """A run that reached ``train.max_steps`` without a usable model: every step skipped
    (``train.nonfinite: skip``), or non-finite weights; nothing final was saved."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.step = None


def _check_trained(model: nn.Module, skipped: int, steps: int, last_checkpoint: Path | None) -> None:
    """Raise :class:`NothingTrainedError` when all ``steps`` were skipped or a weight is NaN or
    infinite (collective when distributed)."""
    kept = f"the last checkpoint, {last_checkpoint}, is untouched" if last_checkpoint else "no checkpoint was kept"
    unsaved = f"neither output_dir nor the final checkpoint was written ({kept})"
    if steps and skipped >= steps:
        raise NothingTrainedError(f"all {steps} steps were skipped (non-finite loss or gradient norm, "
                                  f"train.nonfinite=skip): the model did not train, so {unsaved}. Check the "
                                  "model's weights and the data, or lower train.lr")
    bad = first_nonfinite(model.named_parameters(), across_ranks=True)
    if bad is not None:
        raise NothingTrainedError(f"the trained weights are not finite ({bad} holds NaN or infinite values), so "
                                  f"{unsaved}. Lower train.lr or check the data")


def _check_loaded_weights(model: nn.Module, cfg: FinetuneConfig, resume_from: Path | None) -> None:
    """Refuse (:class:`ConfigError`) weights that hold NaN or infinite values, naming the first
    such tensor: no step could train from them."""
    bad = first_nonfinite(model.named_parameters())
    if bad is None:
        return
    from_checkpoint = resume_from is not None and (cfg.lora is None or "lora_" in bad)  # LoRA: adapters only
    key, where = ("checkpoint.resume", resume_from) if from_checkpoint else ("model.path", cfg.model.path)
    raise ConfigError(f"{key}: the weights loaded from {where} are not finite: {bad} holds NaN or infinite values "
                      "(the first such tensor). Every step would be non-finite; use intact weights", key=key)


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]], *, across_ranks: bool = False) -> str | None:
    """The name of the first tensor holding a NaN or an infinity, or None: one max-abs
    reduction per tensor on its device (``torch._foreach_norm``, ord inf; NaN propagates) and
    one host sync. ``across_ranks``: each rank checks its shards (DTensor ``to_local``) and the
    verdicts are combined over the process group (collective; same names on every rank)."""
    pairs = [(n, p.detach().to_local() if hasattr(p, "to_local") else p.detach()) for n, p in named]
    if not pairs:
        return None
    names = [n for n, _ in pairs]
    tensors = [x for _, x in pairs]
    full = [i for i, x in enumerate(tensors) if x.numel()]
    device = tensors[full[0]].device if full else tensors[0].device
    finite = torch.ones(len(names), dtype=torch.int32, device=device)
    if full:
        norms = torch._foreach_norm([tensors[i] for i in full], float("inf"))
        finite[full] = torch.stack([n.float().to(device) for n in norms]).isfinite().int()
    if across_ranks and dist.is_initialized():
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    bad = (finite == 0).nonzero().flatten().tolist()  # the one host sync
    return names[bad[0]] if bad else None


def _finite(loss: torch.Tensor, grad_norm: torch.Tensor | float) -> bool:
    """Whether loss and gradient norm are both finite: one host sync."""
    norm = torch.as_tensor(grad_norm, device=loss.device)
    return bool((torch.isfinite(loss) & torch.isfinite(norm)).item())


def _finite_or_none(x: float) -> float | None:
    """``x``, or None (JSON ``null``) for NaN and infinities, which JSON cannot hold."""
    return x if math.isfinite(x) else None


def check_outputs(cfg: FinetuneConfig) -> None:
    """:func:`_check_outputs`, an OS error (a name too long...) said as a :class:`ConfigError`."""
    try:
        _check_outputs(cfg)
    except OSError as e:
        raise ConfigError(f"an output location cannot be used: {ckpt.describe(e)}") from None


def _check_outputs(cfg: FinetuneConfig) -> None:
    """Check that every output location is, or can become, a writable directory (by creating
    and removing a probe in it or its nearest existing parent), before anything is loaded;
    nothing is left behind, so a refused run creates no directory: ``checkpoint.dir``, the
    metrics file's folder and ``output_dir`` are made when training writes to them. Raises
    :class:`ConfigError`."""
    if cfg.log.metrics_jsonl:
        metrics = Path(cfg.log.metrics_jsonl)
        for key in ("output_dir", "checkpoint.dir"):
            folder = cfg.output_dir if key == "output_dir" else cfg.checkpoint.dir
            if folder and real_path(metrics) == real_path(Path(folder)):
                raise ConfigError(f"log.metrics_jsonl: {metrics} is {key}, a directory this run writes; "
                                  "name a file (e.g. metrics.jsonl inside it)", key="log.metrics_jsonl")
        if cfg.output_dir and (name := _saved_name(metrics, Path(cfg.output_dir))) is not None:
            raise ConfigError(f"log.metrics_jsonl: {metrics} is {name} in output_dir {cfg.output_dir}, a file the "
                              "final save writes (or deletes, or a folder it removes); the save would destroy the "
                              "metrics log. Name another file for log.metrics_jsonl (e.g. "
                              f"{Path(cfg.output_dir) / 'metrics.jsonl'}) or choose another output_dir",
                              key="log.metrics_jsonl")
        if cfg.checkpoint.dir and (parent := real_path(metrics).parent) != (ck := real_path(Path(cfg.checkpoint.dir))) \
                and parent.is_relative_to(ck):
            raise ConfigError(f"log.metrics_jsonl: {metrics} is inside a folder of checkpoint.dir {cfg.checkpoint.dir}, "
                              "which a save replaces or a prune removes. Name a file outside it (or directly in "
                              "checkpoint.dir)", key="log.metrics_jsonl")
        if metrics.is_dir():
            raise ConfigError(f"log.metrics_jsonl: {metrics} is a directory, not a file")
        if (line := _foreign_line(metrics)) is not None:
            raise ConfigError(f"log.metrics_jsonl: {metrics} already exists and is not a metrics log (line {line} "
                              "is not a step record); this run would rewrite it. Choose another file")
        _writable_dir("log.metrics_jsonl", metrics.parent)
    if cfg.checkpoint.dir:
        _writable_dir("checkpoint.dir", Path(cfg.checkpoint.dir))
    if cfg.output_dir:
        _writable_dir("output_dir", Path(cfg.output_dir))
        _check_output_dir(cfg, Path(cfg.output_dir))
        _check_saved_tokenizer(cfg)


_SAVED_NAMES = frozenset({"config.json", "adapter_config.json", "generation_config.json", "README.md",
                          "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
                          "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
                          "preprocessor_config.json", "processor_config.json"})
"""Names of files the final save writes besides the weights (:data:`_WEIGHT_FILE`) and
``tokenizer*``: Transformers' config and generation config, PEFT's adapter config and
``README.md`` (only where there is none: :data:`_KEPT_NAMES`), a tokenizer's or processor's
other files."""


def _saved_name(path: Path, out: Path) -> str | None:
    """How ``path`` is named in ``out`` when the final save to ``out`` writes, deletes or
    removes it (a name it saves, an earlier weight file, anything in its staging folder),
    else None. Both ``path`` as given and where its links lead are checked."""
    real_out = real_path(out)
    for p in (Path(os.path.abspath(path)), real_path(path)):
        full = real_path(p.parent) / p.name
        if full.is_relative_to(real_out / _STAGING):
            return str(full.relative_to(real_out))
        if full.parent == real_out and _file_name(p.name):
            return p.name
    return None


def _not_a_folder(path: Path) -> bool:
    """Whether something other than a directory (a link to one included) is at ``path``."""
    try:
        return not stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _file_name(name: str) -> bool:
    """Whether ``name`` is one the final save may write (or delete) in ``output_dir``."""
    return name in _SAVED_NAMES or name == _RECORD or name.startswith("tokenizer") or bool(_WEIGHT_FILE.match(name))


def _saved_tokenizer(cfg: FinetuneConfig) -> str | None:
    """The tokenizer directory whose tokenizer ``output_dir`` gets beside the model, or None."""
    tok_dir = cfg.data.tokenizer or cfg.model.path
    return tok_dir if tok_dir and any(Path(tok_dir).glob("tokenizer*")) else None


def _check_saved_tokenizer(cfg: FinetuneConfig) -> None:
    """Load the tokenizer the final save copies into ``output_dir`` now, before training: one
    that cannot be loaded (a cut-off ``tokenizer.json``) would otherwise fail that save, and
    every fallback folder, after training (pre-tokenized data never loads it earlier)."""
    tok_dir = _saved_tokenizer(cfg)
    if tok_dir is None:
        return
    from polyaccel.moe.data import load_tokenizer

    try:
        load_tokenizer(tok_dir)
    except Exception as e:  # ConfigError, or what the tokenizers library raises for a damaged file
        why = str(e).removeprefix(f"cannot load a tokenizer from {tok_dir}: ")
        raise ConfigError(f"output_dir: the final save copies the tokenizer in {tok_dir}, which cannot be loaded "
                          f"({' '.join(why.split())[:300]}); repair or remove its tokenizer files, or set "
                          "data.tokenizer to a tokenizer that loads (checked before training, not after)",
                          key="data.tokenizer" if cfg.data.tokenizer else "model.path") from None


def _check_output_dir(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse an ``output_dir`` whose save would overwrite what this run reads (the model or
    tokenizer directory), a checkpoint, or files of a folder that holds no saved model."""
    real = real_path(out)
    for key, value in (("model.path", cfg.model.path), ("data.tokenizer", cfg.data.tokenizer)):
        if value and real_path(Path(value)) == real:
            raise ConfigError(f"output_dir: {out} is {key}, which this run reads; saving there would overwrite it. "
                              "Choose another output_dir")
    if cfg.checkpoint.dir and real.is_relative_to(real_path(Path(cfg.checkpoint.dir))):
        raise ConfigError(f"output_dir: {out} is inside checkpoint.dir {cfg.checkpoint.dir}, where it would change "
                          "or be pruned with the checkpoints. Choose a directory outside it")
    for key, value in (("checkpoint.dir", cfg.checkpoint.dir), ("checkpoint.resume", cfg.checkpoint.resume),
                       ("model.path", cfg.model.path), ("data.tokenizer", cfg.data.tokenizer),
                       ("data.jsonl", cfg.data.jsonl), ("data.text", cfg.data.text)):
        if value and value not in ("auto", "none") and real_path(Path(value)).is_relative_to(real / _STAGING):
            raise ConfigError(f"{key}: {value} is inside {out / _STAGING}, the folder the final save starts "
                              "by removing. Move it elsewhere")
    if _not_a_folder(out / _STAGING):
        raise ConfigError(f"output_dir: {out / _STAGING} is not a folder (a link, FIFO, socket or file), and the final "
                          "save stages its files in a folder of that name; remove it or choose another output_dir")
    if out.is_dir():
        folders = sorted(p.name for p in out.iterdir() if p.is_dir() and _file_name(p.name))
        if folders:
            raise ConfigError(f"output_dir: {out / folders[0]} is a folder where the final save writes a file of "
                              "that name (model weights, a config, the tokenizer's files); rename or move it, or "
                              "choose another output_dir")
        names = sorted(p.name for p in out.iterdir() if not p.is_dir() and p.name != _RECORD
                       and not _is_metrics_log(cfg, p) and not _is_run_lock(p))
        if ckpt.MANIFEST in names or ckpt.TRAINER_STATE in names or any(map(_HF_TRAINER_STATE.fullmatch, names)):
            # another run's, checkpoint.resume, or a Transformers Trainer checkpoint (checkpoint-N)
            raise ConfigError(f"output_dir: {out} is a training checkpoint; saving there would change its weights, "
                              "so it could no longer be resumed from. Choose another output_dir")
        saved = any(n in ("config.json", _ADAPTER_CONFIG) for n in names) and any(map(_WEIGHT_FILE.match, names))
        saved = saved or (out / _STAGING).is_dir()  # our own save, cut off by a kill
        if names and not saved:  # a config.json alone may be the user's own (a project folder)
            raise ConfigError(f"output_dir: {out} already holds files and no saved model ({', '.join(names[:5])}"
                              f"{', ...' if len(names) > 5 else ''}); saving there could overwrite or delete some. "
                              "Choose a new or empty directory")
        _check_output_kind(cfg, out, names)


def _is_metrics_log(cfg: FinetuneConfig, path: Path) -> bool:
    """Whether ``path`` is this run's ``log.metrics_jsonl`` (kept in ``output_dir``, it is the
    run's own file: a rerun that resumes must not be refused for it)."""
    return bool(cfg.log.metrics_jsonl) and real_path(path) == real_path(Path(cfg.log.metrics_jsonl))


def _check_output_kind(cfg: FinetuneConfig, out: Path, names: list[str]) -> None:
    """Refuse saving LoRA adapters over a saved full model, or a full model over saved adapters:
    the earlier weights would be deleted and the folder left half one kind, half the other."""
    weights = [n for n in names if _WEIGHT_FILE.match(n)]
    if cfg.lora is not None:
        other = [n for n in weights if not n.startswith("adapter_model")]
        what = "a full model"
    else:
        other = [n for n in names if n == _ADAPTER_CONFIG or n.startswith("adapter_model")]
        what = "LoRA adapters"
    if other:
        raise ConfigError(f"output_dir: {out} holds {what} ({', '.join(other[:3])}); this run saves "
                          f"{'LoRA adapters' if cfg.lora is not None else 'a full model'}, which would delete or "
                          "mix with it. Choose a new or empty directory")


_ADAPTER_CONFIG = "adapter_config.json"


def _check_inputs_not_pruned(cfg: FinetuneConfig) -> None:
    """Refuse a ``model.path`` or ``data.tokenizer`` that is (inside) a checkpoint folder of this
    run's ``checkpoint.dir`` when ``keep_last`` prunes old checkpoints: the run would delete the
    model it was told to start from, and rerunning the same command would then fail."""
    if not cfg.checkpoint.dir or cfg.checkpoint.keep_last == 0:
        return
    root = real_path(Path(cfg.checkpoint.dir))
    for key, value in (("model.path", cfg.model.path), ("data.tokenizer", cfg.data.tokenizer)):
        if not value or not (real := real_path(Path(value))).is_relative_to(root) or real == root:
            continue
        step = real.relative_to(root).parts[0]
        if ckpt.step_number(step) is not None:
            raise ConfigError(f"{key}: {value} is in checkpoint {step} of checkpoint.dir {cfg.checkpoint.dir}, which "
                              f"checkpoint.keep_last={cfg.checkpoint.keep_last} prunes during this run (a rerun would then "
                              "find no model). Copy it elsewhere, set checkpoint.keep_last=0, or use a new checkpoint.dir",
                              key=key)


def _check_checkpoint_kind(cfg: FinetuneConfig, resume_from: Path | None) -> None:
    """Refuse resuming a LoRA run from a full fine-tuning checkpoint, or the reverse."""
    if resume_from is None or (resume_from / _ADAPTER_CONFIG).is_file() == (cfg.lora is not None):
        return
    held, run = (("LoRA adapters", "full fine-tuning (no lora section)") if cfg.lora is None
                 else ("a full model, no LoRA adapters", "LoRA"))
    raise ConfigError(f"checkpoint.resume: {resume_from} holds {held}, and this run is {run}; resume with the "
                      "settings that wrote it, or use a new checkpoint.dir", key="checkpoint.resume")


def _check_later_checkpoints(cfg: FinetuneConfig, resume_from: Path | None) -> None:
    """Refuse a run that would overwrite (or mix with its own) intact checkpoints in
    ``checkpoint.dir`` past the step it starts from: any, with ``checkpoint.resume=none``; the
    newer ones, when a checkpoint is named (those that fail their manifest may be written over,
    as ``auto`` does with damaged newer ones)."""
    if not cfg.checkpoint.dir or cfg.checkpoint.resume == "auto":
        return
    start = (ckpt.checkpoint_step(resume_from) or 0) if resume_from is not None else -1
    later = [p for p in ckpt.written_checkpoints(cfg.checkpoint.dir) if (ckpt.checkpoint_step(p) or 0) > start
             and (resume_from is None or not (p / ckpt.MANIFEST).is_file() or ckpt.verify_checkpoint(p) is None)]
    if later:
        names = ", ".join(p.name for p in later[:4]) + (", ..." if len(later) > 4 else "")
        start_from = "starts over" if resume_from is None else f"restarts from step {start}"
        raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} holds checkpoints past the step this run starts from "
                          f"({names}); checkpoint.resume={cfg.checkpoint.resume} {start_from}, so they would be "
                          "overwritten or mixed with this run's. Choose a new checkpoint.dir, or move them away",
                          key="checkpoint.dir")


def _check_foreign_step_dirs(cfg: FinetuneConfig, resume_from: Path | None) -> None:
    """Refuse a ``checkpoint.dir`` holding, for a step the run will save (past the one it starts
    from, up to ``train.max_steps``), a ``step_N`` folder of other files (no manifest, no
    trainer state: saving step N would replace it) or a ``step_N`` / ``step_N.tmp`` that is no
    folder (a file: saving step N would fail, after training)."""
    start = (ckpt.checkpoint_step(resume_from) or 0) if resume_from is not None else 0
    in_the_way = [p for step, p in ckpt.not_folders(cfg.checkpoint.dir) if start < step <= cfg.train.max_steps]
    if in_the_way:
        names = ", ".join(p.name for p in in_the_way[:4]) + (", ..." if len(in_the_way) > 4 else "")
        raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} holds files named like this run's checkpoints "
                          f"({names}: not folders); the checkpoint of that step could not be written after training "
                          "up to it. Move them away, or choose a new checkpoint.dir", key="checkpoint.dir")
    found = [p for p in ckpt.not_checkpoints(cfg.checkpoint.dir)
             if start < (ckpt.checkpoint_step(p) or 0) <= cfg.train.max_steps]
    if found:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(f"checkpoint.dir {cfg.checkpoint.dir} holds folders named like checkpoints that are not "
                          f"checkpoints ({names}: no manifest.json or {ckpt.TRAINER_STATE}); this run's checkpoint of "
                          "that step would replace them. Move them away, or choose a new checkpoint.dir",
                          key="checkpoint.dir")


def _writable_dir(key: str, path: Path) -> None:
    """Make sure ``path`` is or can become a writable directory, creating nothing that stays:
    a probe directory is made and removed in ``path`` or its nearest existing parent (what
    permissions alone cannot tell: root, read-only mounts, ``/proc``...). ``checkpoint.dir``
    and ``output_dir`` may not be the file system's root (nor have a name too long...)."""
    if key in ("checkpoint.dir", "output_dir") and Path(os.path.abspath(path)).parent == Path(os.path.abspath(path)):
        raise ConfigError(f"{key}: {path} is the root of the file system; name a folder of its own for the run to "
                          "write", key=key)
    try:
        _probe_dir(key, path)
    except OSError as e:
        raise ConfigError(f"{key}: {path} cannot be used ({ckpt.describe(e)})", key=key) from None


def _probe_dir(key: str, path: Path) -> None:
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    os.stat(existing)  # a dangling link or a loop of links: its OSError names it
    if not existing.is_dir():
        raise ConfigError(f"{key}: cannot create the directory {path}: {existing} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".polyaccel-probe-", dir=existing))
    except OSError as e:
        why = e.strerror or str(e)
        if existing == path:
            raise ConfigError(f"{key}: the directory {path} is not writable ({why})") from None
        raise ConfigError(f"{key}: cannot create the directory {path}: nothing can be created in {existing} "
                          f"({why})") from None


_RECORD_HEAD = b'{"step": '
"""How every line of a metrics log starts (:func:`_write_metrics` writes ``step`` first)."""


def _foreign_line(path: Path) -> int | None:
    """The first line of an existing file at ``path`` that a metrics log cannot hold (a JSON
    object with an integer ``step``), or None; a last line without newline (cut by a kill)
    is allowed when it is the start of a step record (``{"step": ``, as every line is
    written), whatever follows: a file of one line without newline (a note, a one-line JSON
    config) is not a metrics log, and a resume would have emptied it."""
    if not path.is_file():
        return None
    lines = path.read_bytes().split(b"\n")
    lines, cut = lines[:-1], lines[-1]  # the last piece is empty or a cut line
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else {"step": 0}
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than json parses
            return n
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            return n
    if cut and not (cut.startswith(_RECORD_HEAD) or _RECORD_HEAD.startswith(cut)):
        return len(lines) + 1
    return None


def _open_metrics(path: str, start_step: int):
    """Open the metrics file for appending. A run that resumes first drops its records of
    steps after ``start_step`` (it writes them again) and any partial line a kill left
    (whatever its bytes: cut UTF-8, or JSON nested too deeply to parse; :func:`check_outputs`
    has refused any other line that is not a step record). A run from step 0 writes a new log:
    an earlier one with records is kept, renamed ``<name>.1`` (``.2``, ...)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if start_step == 0 and p.is_file() and p.stat().st_size:
        kept = _keep_aside(p)
        logger.warning("polyaccel.moe: log.metrics_jsonl %s held an earlier run's records; kept as %s", p, kept)
    elif p.is_file():
        kept = []
        for line in p.read_bytes().split(b"\n"):  # the lines _foreign_line read
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than json parses
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= start_step:
                kept.append(line + b"\n")
        replace_file(p, b"".join(kept))
    return p.open("a")


def _keep_aside(path: Path) -> Path:
    """Rename ``path`` to the first free ``<name>.N`` (never over an existing file) and return it."""
    n = 1
    while True:
        aside = path.with_name(f"{path.name}.{n}")
        try:
            os.link(path, aside)  # fails if aside exists: nothing is replaced
        except FileExistsError:
            n += 1
            continue
        except OSError:  # a file system without hard links
            if os.path.lexists(aside):
                n += 1
                continue
            os.rename(path, aside)
            return aside
        path.unlink()
        return aside


def _write_metrics(file: Any, record: dict[str, Any]) -> Any:
    """Append ``record`` to the open metrics log and return it; a failed write (a full disk, a
    FIFO whose reader left) is one warning naming the file, the log is closed and None
    returned: nothing more goes to it this run, and training goes on (a metrics line is never
    worth the steps since the last checkpoint)."""
    try:
        file.write(dumps(record) + "\n")
        file.flush()
        return file
    except OSError as e:
        with contextlib.suppress(OSError):  # closed now: the line it still holds would fail again at the close
            file.close()
        logger.warning("polyaccel.moe: the metrics log %s could not be written (%s): no more metrics go to it "
                       "this run; training goes on", file.name, ckpt.describe(e))
        return None


def _already_finished(cfg: FinetuneConfig, rt: Runtime, model_config: Any, checkpoint: Path) -> TrainResult:
    """The result of a run whose checkpoint is already at ``train.max_steps``: nothing trained."""
    done = ckpt.checkpoint_step(checkpoint)
    note = (f"run already finished at step {done} ({checkpoint}); nothing to do; raise train.max_steps "
            "or use a new checkpoint.dir")
    failure = None
    if rt.rank == 0:
        logger.warning("polyaccel.moe: %s", note)
        if cfg.output_dir and (checkpoint / ckpt.MANIFEST).is_file() and not _output_matches(Path(cfg.output_dir),
                                                                                               checkpoint):
            logger.warning("polyaccel.moe: output_dir %s does not hold the final model (the run stopped while "
                           "writing it?): writing it from %s", cfg.output_dir, checkpoint)
            files = _final_files(checkpoint)
            replaced = _foreign_output(cfg, checkpoint)
            foreign = (f"output_dir {cfg.output_dir} holds a saved model ({replaced}) that no checkpoint of this "
                       "run matches (another run's?)") if replaced else None
            try:
                _write_output(cfg, lambda staging: [shutil.copy2(checkpoint / n, staging / n) for n in files],
                              foreign=foreign)
            except Exception as e:
                failure = (f"the final model could not be written to output_dir {cfg.output_dir} from the final "
                           f"checkpoint {checkpoint} ({ckpt.describe(e)}); nothing partial was left in output_dir and "
                           "the checkpoint is untouched. Make output_dir writable (free space), or choose another "
                           "with --set output_dir=..., and rerun the same command: it writes output_dir from that "
                           "checkpoint without training")
    _raise_on_any_rank(failure)
    t = cfg.train
    return TrainResult(
        start_step=done, steps=done, losses=[], step_times=[],
        tokens_per_step=t.micro_batch * t.grad_accum * rt.world_size * t.seq_len, tokens_per_s_per_device=None,
        flops_per_token=train_flops_per_token(model_config, t.seq_len, frozen_base=cfg.lora is not None),
        peak_flops=peak_flops(rt.device, cfg.log.peak_tflops), mfu=None, peak_memory_gib=None,
        world_size=rt.world_size, output_dir=cfg.output_dir, last_checkpoint=str(checkpoint), note=note)


def _load_model(cfg: ModelConfig, model_config: Any, *, dtype: torch.dtype, device: torch.device,
                weights: Path | None, train: TrainConfig | None = None, lora: Any = None,
                world_size: int = 1) -> nn.Module:
    """:func:`build_model`; a failed load of checkpoint weights becomes a
    :class:`~polyaccel.moe.checkpoint.CheckpointError` naming the damaged file or the tensors
    whose shapes differ."""
    source = weights or cfg.path
    try:
        return build_model(cfg, model_config, dtype=dtype, device=device, weights=weights, train=train, lora=lora,
                           world_size=world_size)
    except (ConfigError, MemoryError, torch.OutOfMemoryError):
        raise
    except BackendUnavailable as e:  # this machine's, not the weights' fault
        raise ConfigError(f"model.backend.backend: {e}", key="model.backend.backend") from None
    except Exception as e:
        if source is None:
            raise
        raise ckpt.weights_error(source, e, _model_shapes(cfg, model_config, dtype)) from e


def _model_shapes(cfg: ModelConfig, model_config: Any, dtype: torch.dtype) -> dict[str, tuple[int, ...]] | None:
    """Parameter shapes of the model ``cfg`` builds (on the meta device, from ``model_config``
    alone: not from ``cfg.path``'s weights, whose load is what failed), or None."""
    try:
        model = build_model(dataclasses.replace(cfg, path=None), model_config, dtype=dtype, device=torch.device("meta"))
    except Exception:  # only used to explain another error
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class SaveError(RuntimeError):
    """Training ran, but what it trained could not be written where the config says
    (``output_dir``, or a checkpoint); the message says why and where the trained weights are
    (the final checkpoint, or a fallback folder written instead). ``polyaccel-moe`` exits 4."""


def save_final(model: nn.Module, cfg: FinetuneConfig, rt: Runtime, *, step: int | None = None,
               final_checkpoint: Path | None = None, foreign: str | None = None) -> None:
    """``save_pretrained`` the trained model (and the tokenizer, if there is one) to
    ``cfg.output_dir`` through :func:`_write_output`; collective when distributed (rank 0
    writes). When that fails (a full disk...), nothing partial is left in ``output_dir`` and a
    :class:`SaveError` (on every rank) says where the trained weights are: in
    ``final_checkpoint`` (this run's checkpoint of the final step), else in a fallback folder
    the weights are written to instead (:func:`_rescue`). ``foreign``: ``output_dir`` holds
    a saved model this run did not write, so described (the save warns, naming the files it
    replaces and those it keeps)."""
    write = _model_writer(model)
    failure = None
    if rt.rank == 0:
        try:
            _write_output(cfg, write, foreign=foreign)
        except Exception as e:
            head = (f"training finished{f' (step {step})' if step else ''}, but the final model could not be "
                    f"written to output_dir {cfg.output_dir} ({ckpt.describe(e)}); nothing partial was left there")
            if final_checkpoint is not None:
                failure = (f"{head}. The trained model is safe in the final checkpoint {final_checkpoint}: make "
                           "output_dir writable (free space), or choose another with --set output_dir=..., and "
                           "rerun the same command; it writes output_dir from that checkpoint without training")
            else:
                failure = f"{head}. {_rescue(cfg, write, Path(cfg.output_dir).name)}"
    _raise_on_any_rank(failure)


def _model_writer(model: nn.Module) -> Callable[[Path], Any]:
    """``save_pretrained`` of ``model``'s full weights into a folder, for :func:`_write_output`;
    gathering them is collective when distributed, so every rank calls this."""
    from polyaccel.moe.ep_checkpoint import full_state_dict

    state = full_state_dict(model)
    return lambda staging: model.save_pretrained(staging, state_dict=state)


def _rank0_verdict(failure: str | None) -> str | None:
    """Rank 0's ``failure`` (None: none), on every rank (collective when distributed)."""
    if dist.is_initialized():
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    return failure


def _raise_on_any_rank(failure: str | None) -> None:
    """Rank 0's verdict to every rank (collective when distributed): raise :class:`SaveError`
    with ``failure`` unless it is None."""
    if (failure := _rank0_verdict(failure)) is not None:
        raise SaveError(failure)


def _checkpoint_failed(cfg: FinetuneConfig, model: nn.Module, step: int, error: Exception,
                       last_checkpoint: Path | None, *, final: bool, created: Sequence[Path] = (),
                       writer: bool = True) -> str | None:
    """The :class:`SaveError` message of a checkpoint that could not be written at ``step``
    (collective when distributed: every rank calls it, the ``writer`` (rank 0) acts and gets
    the message, the others None): its partial folder is removed, and then the directories of
    ``created`` (those the save made: ``checkpoint.dir`` and missing parents, deepest first)
    that are still empty; the weights are kept elsewhere: in ``output_dir`` when this was the
    final step, else (or when that fails too) in a fallback folder (:func:`_rescue`)."""
    write = _model_writer(model)
    if not writer:
        return None
    partial = ckpt.step_dir(cfg.checkpoint.dir, step)
    shutil.rmtree(partial.with_name(partial.name + ".tmp"), ignore_errors=True)
    kept = (f"the last intact checkpoint, {last_checkpoint}, is untouched (resume from it)" if last_checkpoint
            else "no earlier checkpoint exists")
    head = (f"step {step}: the checkpoint could not be written to checkpoint.dir {cfg.checkpoint.dir} "
            f"({ckpt.describe(error)}){'' if final else ', so training stopped'}; {kept}")
    try:
        if final and cfg.output_dir:
            try:
                _write_output(cfg, write)
                return f"{head}. The final model was written to output_dir {cfg.output_dir}"
            except Exception as e:
                head += f"; output_dir {cfg.output_dir} could not be written either ({ckpt.describe(e)})"
        return f"{head}. {_rescue(cfg, write, partial.name)}"
    finally:  # after the rescue, which may have gone into one of them (then it stays)
        remove_empty_dirs(created)


def _rescue(cfg: FinetuneConfig, write_model: Callable[[Path], Any], name: str) -> str:
    """Write the trained weights (as ``output_dir`` would have held them) into a new folder
    ``polyaccel-moe-rescue-<name>-<time>-*`` in the first of: ``output_dir``'s parent, the
    temporary directory (``$TMPDIR``), the working directory, that takes them; a failed try
    leaves nothing. Returns the sentence to tell the user where they went (or that none
    could)."""
    # Each candidate is worked out only when tried: finding $TMPDIR (on a full disk) or the
    # working directory (deleted) can fail too, which must not end the rescue.
    candidates: list[Callable[[], Path]] = []
    if cfg.output_dir:
        candidates.append(lambda: Path(cfg.output_dir).parent)
    candidates += [lambda: Path(tempfile.gettempdir()), Path.cwd]
    tried: list[str] = []
    seen: set[Path] = set()
    for candidate in candidates:
        folder = None
        parent: Path | str = "a fallback folder"
        try:
            parent = candidate()
            key = real_path(parent)
            if key in seen or not parent.is_dir():
                continue
            seen.add(key)
            folder = Path(tempfile.mkdtemp(prefix=f"polyaccel-moe-rescue-{name}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                           dir=parent))
            _write_output(cfg, write_model, out=folder, tokenizer_optional=True)
        except Exception as e:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            tried.append(f"{parent}: {ckpt.describe(e)}")
            continue
        return _rescued(folder)
    return (f"No fallback folder could be written either ({'; '.join(tried)}): the trained weights are lost. "
            "Set checkpoint.dir to keep checkpoints a failed save can be redone from")


def _rescued(folder: Path) -> str:
    """The sentence naming the rescue ``folder`` (made by ``mkdtemp``: only its owner may open
    it), and that a reboot deletes it when it is in memory (tmpfs)."""
    text = (f"The trained weights were saved instead to {folder} (what output_dir would hold; load it with "
            "from_pretrained, or move it where you want it). The folder is private to your user (mode 700): "
            f"chmod -R go+rX {folder} if others need it")
    kind = _memory_fs(folder)
    if kind is not None:
        text += (f". It is on a {kind} (in memory): a reboot deletes it, so move it to a disk before that "
                 f"(mv {folder} <a disk folder>)")
    return text


_MOUNTS = Path("/proc/mounts")


def _memory_fs(path: Path) -> str | None:
    """``tmpfs`` or ``ramfs`` when ``path`` is on such an in-memory file system (the mount of
    ``/proc/mounts`` with the longest mount point above it), else None, also where that cannot
    be told (not Linux)."""
    try:
        mounts = _MOUNTS.read_text().splitlines()
        path = real_path(path)
    except (OSError, ValueError):
        return None
    best, kind = -1, None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1]))  # \040: a space
        if path.is_relative_to(point) and len(point.parts) >= best:  # >=: a later mount hides an earlier one
            best, kind = len(point.parts), fields[2]
    return kind if kind in ("tmpfs", "ramfs") else None


_warned_stdout = False


def _print_metrics(line: str) -> None:
    """Print a metrics line; when nobody reads stdout any more (``finetune ... | head``), stop
    printing them (one warning) instead of stopping the training."""
    global _warned_stdout
    try:
        print(line, flush=True)
    except BrokenPipeError:
        stdout_gone()
        if not _warned_stdout:
            _warned_stdout = True
            print("polyaccel.moe: stdout was closed by its reader; metrics lines are no longer printed, "
                  "training goes on", file=sys.stderr)


_STAGING = ".polyaccel-partial"
_MODEL_MARKERS = ("config.json", "adapter_config.json")
"""The files that make a folder load as a model (Transformers) or as adapters (PEFT)."""
_KEPT_NAMES = ("README.md",)
"""Names the final save writes only into a folder without such a file: PEFT's model card. It is
no part of the model (nothing loads it), and a ``README.md`` already in ``output_dir``, the
user's own or an earlier save's card, possibly edited, is kept byte for byte."""
_HF_TRAINER_STATE = re.compile(r"trainer_state\.json|optimizer\.pt|scheduler\.pt|rng_state(_\d+)?\.pth|scaler\.pt")
"""Files a Transformers ``Trainer`` checkpoint (``checkpoint-N``) holds beside the weights: new
weights saved among them would be resumed with the old optimizer and scheduler state."""
_WEIGHT_FILE = re.compile(r"^(model|adapter_model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")
"""The names Transformers and PEFT give weights (one file, numbered shards, their index): an
earlier save's that this save lacks are deleted; any other file (``model.fp16.safetensors``,
``model.orig.safetensors``, a user's) is left alone."""
_RECORD = ".polyaccel-saved.json"
"""The sha256 of each file the final save wrote into its folder besides the weights, and the
size and modification time of each weight file (hashing gigabytes would cost a save minutes;
a rename keeps both): what a later save there checks for the user's edits (:func:`_edited`)."""


def _weights_readable_as_config(folder: Path) -> None:
    """Give the weight files in ``folder`` the permission bits of its config (0666 less the
    umask): safetensors writes them 0600, so a model whose config others can read had weights
    only its owner could."""
    marker = next((folder / n for n in _MODEL_MARKERS if (folder / n).is_file()), None)
    if marker is None:
        return
    mode = stat.S_IMODE(marker.stat().st_mode)
    for p in folder.iterdir():
        if _WEIGHT_FILE.match(p.name) and p.is_file() and not p.is_symlink():
            p.chmod(mode)


def _write_output(cfg: FinetuneConfig, write_model: Callable[[Path], Any], out: Path | None = None, *,
                  tokenizer_optional: bool = False, foreign: str | None = None) -> None:
    """Write the final model into ``out`` (default ``cfg.output_dir``): first whole into a
    staging folder inside it (a kill leaves the folder as it was), then each file moved in
    with ``os.replace``, the config that makes the folder load as a model last, after the
    earlier save's config is removed and its weight files that this save lacks are deleted
    (Ctrl-C, SIGTERM and SIGHUP wait for the last move, :func:`_signals_held`; a SIGKILL between
    the moves leaves a folder that does not load, never new weights beside old ones under the
    old config or old weights under the new one; a rerun may write there again); other files are left alone, and so is a file of a name in :data:`_KEPT_NAMES` (the
    save's own is then dropped, never written over it). A file it writes over that was edited
    since the earlier save (:func:`_edited`) is first renamed ``<name>.bak-<time>`` (a
    warning); the hashes of what it wrote go to :data:`_RECORD`, moved in last. A failed
    write removes the staging folder and the directories it created, then raises. ``tokenizer_optional`` (a rescue): a tokenizer that cannot be loaded
    any more is left out (a warning) instead of failing the write of the weights. ``foreign``
    (the start of a sentence: ``out`` holds a saved model this run did not write): once the
    save is staged, a warning names the files of ``out`` it overwrites (every file the save
    writes: weights, ``config.json``, ``generation_config.json``, the tokenizer's files...),
    the earlier weight files it deletes and the files it keeps."""
    out = Path(cfg.output_dir) if out is None else Path(out)
    created = missing_dirs(out)
    staging = out / _STAGING
    if _not_a_folder(staging):  # never opened (a FIFO would block), never removed (a user's)
        raise FileExistsError(errno.EEXIST, "the name of the save's staging folder is taken by something else; "
                              "remove it", str(staging))
    try:
        cut = {key: _recorded(staging, key) for key in ("files", "weights")}  # a save a kill cut off
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write_model(staging)
        tok_dir = _saved_tokenizer(cfg)
        if tok_dir is not None:
            from polyaccel.moe.data import load_tokenizer

            try:
                tokenizer = load_tokenizer(tok_dir)
            except Exception as e:
                if not tokenizer_optional:
                    raise
                logger.warning("polyaccel.moe: the tokenizer in %s cannot be loaded (%s): the weights are saved "
                               "without it", tok_dir, ckpt.describe(e))
            else:
                tokenizer.save_pretrained(staging)
        _weights_readable_as_config(staging)
        for name in _KEPT_NAMES:
            if os.path.lexists(out / name) and os.path.lexists(staging / name):
                (staging / name).unlink()
        written = sorted(p.name for p in staging.iterdir())
        digests = {n: ckpt._digest(staging / n)[1] for n in written if not _WEIGHT_FILE.match(n)}
        marks = {n: _weight_mark(staging / n) for n in written if _WEIGHT_FILE.match(n)}
        in_the_way = [n for n in [*written, _RECORD] if (out / n).is_dir()]
        if in_the_way:
            raise IsADirectoryError(errno.EISDIR, "a folder has the name of a file the save writes; rename it",
                                    str(out / in_the_way[0]))
        if foreign:
            edited = _foreign_files(out, written, digests, cut["weights"])
        else:
            edited = _edited(out, digests, cut["files"]) + _edited_weights(out, cut["weights"])
        (staging / _RECORD).write_text(json.dumps({"files": digests, "weights": marks}, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_empty_dirs(created)
        raise
    if foreign:
        logger.warning("polyaccel.moe: %s; this run's final model takes its place, and that model's files it "
                       "would write over or delete are kept, renamed <name>.bak-<time> (%s; nothing else there "
                       "is touched). Use another output_dir to keep the two apart", foreign,
                       _names(edited) if edited else "none")
    with _signals_held():  # milliseconds: a Ctrl-C or SIGTERM here would leave no config.json
        _move_in(out, staging, written, edited, foreign=bool(foreign))


def _move_in(out: Path, staging: Path, written: list[str], edited: list[str], foreign: bool = False) -> None:
    """The moves of :func:`_write_output`: the ``edited`` files of ``out`` (with ``foreign``,
    the files of the model another run saved there) renamed aside, the earlier config removed,
    the staged weights moved in, the earlier weights this save lacks deleted, then the other
    staged files, the config and the record."""
    if edited:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = [f"{n} -> {_move_aside(out, n, stamp)}" for n in edited]
        if foreign:
            logger.warning("polyaccel.moe: output_dir %s: the earlier model's files are kept, renamed: %s (rename "
                           "them back into another folder to load that model; delete them when you no longer "
                           "need them)", out, ", ".join(moved))
        else:
            logger.warning("polyaccel.moe: output_dir %s: files this save writes or removes were changed since the "
                           "earlier save wrote them (edited?) and are kept, renamed: %s; this save's files take "
                           "their names (a config.json must match the weights). Copy back the edits you want",
                           out, ", ".join(moved))
    markers = [n for n in _MODEL_MARKERS if n in written]
    weights = [n for n in written if _WEIGHT_FILE.match(n)]
    for name in markers:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    for name in weights:
        os.replace(staging / name, out / name)
    for old in out.iterdir():  # before the new config: never the old weights under it
        if old.name not in written and _WEIGHT_FILE.match(old.name) and old.is_file():
            old.unlink()
    for name in [n for n in written if n not in markers and n not in weights] + markers + [_RECORD]:
        os.replace(staging / name, out / name)
    staging.rmdir()


_HELD_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """While the block runs (in the main thread), Ctrl-C, SIGTERM and SIGHUP wait: each one that
    arrives goes to the handler set before (the CLI's: its line, 130/143/129) once the block
    ends, so a caught signal never cuts the block midway; a second one of a kind goes to it at
    once (the way out of a block that hangs). Off the main thread (Python runs handlers only
    there), and for a signal ignored or handled outside Python: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {n: h for n in _HELD_SIGNALS if (h := signal.getsignal(n)) is not None and h != signal.SIG_IGN}
    arrived: list[int] = []
    released = False

    def release() -> None:
        nonlocal released
        released = True
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def hold(signum: int, frame: Any) -> None:
        if signum in arrived:
            release()
            signal.raise_signal(signum)
        else:
            arrived.append(signum)

    try:
        for signum in previous:
            signal.signal(signum, hold)
        yield
    finally:
        if not released:
            release()
            for signum in arrived:
                signal.raise_signal(signum)


def _edited(out: Path, digests: dict[str, str], cut: dict | None = None) -> list[str]:
    """The files of ``out`` that a save of files of these ``digests`` (name -> sha256) writes
    over and that hold neither what the earlier save wrote there (its :data:`_RECORD`), nor
    what a save cut off between its moves wrote (``cut``: its staged record), nor what this one
    writes: edited by the user (or not written by a save that keeps a record). A link, FIFO,
    device... of such a name is the user's (never read: it could block or never end)."""
    recorded = _recorded(out, "files")
    edited = []
    for name, new in digests.items():
        path = out / name
        if not os.path.lexists(path):
            continue
        try:
            old = ckpt._digest(path)[1] if is_regular(path) else None
        except OSError:
            old = None
        if old is None or old not in (new, recorded.get(name), (cut or {}).get(name)):
            edited.append(name)
    return edited


def _foreign_files(out: Path, written: Sequence[str], digests: dict[str, str], cut: dict | None = None) -> list[str]:
    """The files of ``out`` (a model another run or tool saved there) that a save of ``written``
    would write over or delete: every file of a name it writes and every weight file, except
    files already holding the bytes it writes and weight files that a save of this run cut off
    between its moves put there (``cut``, as in :func:`_edited_weights`). Kept aside whole, the
    earlier model is never lost to a wrong ``output_dir``."""
    names = []
    for p in sorted(out.iterdir()):
        n = p.name
        weight = bool(_WEIGHT_FILE.match(n)) and (p.is_symlink() or p.is_file())
        if n not in written and not weight:
            continue
        try:
            if n in digests and is_regular(p) and ckpt._digest(p)[1] == digests[n]:
                continue
            if weight and not p.is_symlink() and (cut or {}).get(n) == _weight_mark(p):
                continue
        except OSError:
            pass
        names.append(n)
    return names


def _recorded(out: Path, key: str) -> dict:
    """The ``key`` part of ``out``'s :data:`_RECORD` ({} without a readable one: none, not a
    regular file, over 64 MiB, not JSON)."""
    try:
        part = json.loads(read_regular(out / _RECORD, 64 << 20) or b"")[key]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return {}
    return part if isinstance(part, dict) else {}


def _weight_mark(path: Path) -> list[int]:
    """What a weight file is recognised by: [size, modification time in ns] (see :data:`_RECORD`)."""
    st = path.lstat()
    return [st.st_size, st.st_mtime_ns]


def _edited_weights(out: Path, cut: dict | None = None) -> list[str]:
    """The weight files of ``out`` the earlier save recorded (:data:`_RECORD`) that are not what
    it wrote any more (replaced or touched by the user, a link put in their place): a save
    writes over or removes every weight file, so each such one is kept aside. Without a record
    (an older save, another tool) nothing is: the weights there are a model's, not edits. Nor
    is a file a save cut off between its moves put there (``cut``: that save's staged record
    of its weights; a rename keeps size and modification time): that save is being redone."""
    recorded = _recorded(out, "weights")
    edited = []
    for name, mark in recorded.items():
        path = out / name
        if not (isinstance(name, str) and _WEIGHT_FILE.match(name) and os.path.lexists(path)):
            continue
        try:
            now = None if path.is_symlink() else _weight_mark(path)
        except OSError:
            now = None
        if now != mark and (now is None or now != (cut or {}).get(name)):
            edited.append(name)
    return edited


def _move_aside(out: Path, name: str, stamp: str) -> str:
    """Rename ``out/name`` to a free ``<name>.bak-<stamp>[-N]``; the new name."""
    for i in range(1, 1000):
        aside = f"{name}.bak-{stamp}" + (f"-{i}" if i > 1 else "")
        if not os.path.lexists(out / aside):
            os.rename(out / name, out / aside)
            return aside
    raise FileExistsError(f"{out / name}.bak-{stamp}-*: no free name to keep the edited file under")


def _names(names: Sequence[str], limit: int = 8) -> str:
    """``names`` joined for a message, the first ``limit`` and how many there are in all."""
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _final_files(checkpoint: Path) -> dict[str, tuple[int, str]]:
    """The model files of ``checkpoint`` (what ``save_pretrained`` wrote), from its manifest:
    name -> (size, sha256)."""
    files = json.loads((checkpoint / ckpt.MANIFEST).read_text())["files"]
    return {name: (int(e["size"]), e["sha256"]) for name, e in files.items()
            if "/" not in name and name != ckpt.TRAINER_STATE and not re.match(r"^(rng|optimizer)_rank\d+\.pt$", name)}


def _output_matches(out: Path, checkpoint: Path) -> bool:
    """Whether ``out`` holds the weight files of ``checkpoint``, byte for byte, and its config
    (a save a kill cut between its moves has the weights but not yet the config)."""
    files = _final_files(checkpoint)
    weights = {n: v for n, v in files.items() if _WEIGHT_FILE.match(n)}
    if (out / _STAGING).exists() or any(n in files and not (out / n).is_file() for n in _MODEL_MARKERS):
        return False
    if not weights or any(not (out / n).is_file() or (out / n).stat().st_size != size
                          for n, (size, _) in weights.items()):
        return False
    return [sha for _, sha in ckpt._digests([out / n for n in weights])] == [sha for _, sha in weights.values()]


def _foreign_output(cfg: FinetuneConfig, resume_from: Path | None) -> str | None:
    """The weight files of a saved model in ``output_dir`` that this run's checkpoints did not
    write (their names, for a warning), or None: no saved model there, or one whose weight
    files equal, byte for byte, those of a complete checkpoint in ``checkpoint.dir`` (or of
    ``resume_from``): what an earlier run of the same command saved, which this run continues.
    Sizes are compared first; the output's weights are hashed (once) only when some
    checkpoint's sizes match."""
    out = Path(cfg.output_dir)
    try:
        names = sorted(p.name for p in out.iterdir() if _WEIGHT_FILE.match(p.name) and p.is_file())
    except OSError:  # not there yet
        return None
    if not names:
        return None
    candidates = ckpt.complete_checkpoints(cfg.checkpoint.dir)
    if resume_from is not None and (resume_from / ckpt.MANIFEST).is_file() and resume_from not in candidates:
        candidates.append(resume_from)
    digests: list[str] | None = None
    for checkpoint in reversed(candidates):  # the newest first: the likeliest
        try:
            weights = {n: v for n, v in _final_files(checkpoint).items() if _WEIGHT_FILE.match(n)}
            if sorted(weights) != names or any((out / n).stat().st_size != weights[n][0] for n in names):
                continue
            if digests is None:
                digests = [sha for _, sha in ckpt._digests([out / n for n in names])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):  # a bad manifest: not it
            continue
        if digests == [weights[n][1] for n in names]:
            return None
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _progress_bar(cfg: FinetuneConfig, rt: Runtime, start: int):
    if rt.rank != 0 or not cfg.log.progress_bar:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.train.max_steps, initial=start, desc="finetune", unit="step", dynamic_ncols=True)


def _peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    except ImportError:
        return None


# --------------------------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------------------------

def benchmark(cfg: FinetuneConfig, *, steps: int = 10, warmup: int = 3) -> dict[str, Any]:
    """Throughput of ``cfg``'s workload: runs ``warmup + steps`` optimizer steps without
    checkpoints or output and reports the median over the last ``steps`` as one JSON-able
    dict (tokens/s per device, MFU, peak memory, FLOPs per token)."""
    cfg = copy.deepcopy(cfg)
    cfg.output_dir = None
    cfg.train.max_steps = warmup + steps
    cfg.checkpoint.dir = None
    cfg.checkpoint.resume = "none"
    cfg.log.progress_bar = False
    cfg.log.metrics_jsonl = None
    cfg.log.every_steps = cfg.train.max_steps + 1  # no per-step lines
    result = finetune(cfg)
    measured = result.step_times[warmup:] or result.step_times
    step_s = statistics.median(measured)
    tok_s = result.tokens_per_step / step_s / result.world_size
    return {
        "preset": cfg.model.preset, "implementation": cfg.model.implementation, "backend": cfg.model.backend,
        "world_size": result.world_size, "seq_len": cfg.train.seq_len, "micro_batch": cfg.train.micro_batch,
        "grad_accum": cfg.train.grad_accum, "dtype": cfg.train.dtype, "steps": steps, "warmup": warmup,
        "step_time_s": step_s, "tokens_per_s_per_device": tok_s, "flops_per_token": result.flops_per_token,
        "mfu": mfu(tok_s, result.flops_per_token, result.peak_flops), "peak_memory_gib": result.peak_memory_gib,
        "final_loss": result.losses[-1] if result.losses else None, "fast_path": result.fast_path,
    }
