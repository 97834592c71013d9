"""LoRA for polyaccel's MoE models: PEFT's adapters, computed inside our grouped expert path.

The adapters are PEFT's own modules (``peft.get_peft_model`` with ``target_modules`` for the
attention projections and ``target_parameters`` for the fused experts and the router), so
``save_pretrained``, ``PeftModel.from_pretrained``, ``merge_and_unload`` and the Trainer work
unchanged and adapter files interchange with plain PEFT on plain Transformers.

What differs is how a PEFT-wrapped expert parameter is computed. PEFT's ``ParamWrapper``
forms ``W + B·A`` for all experts of a layer on every forward (a parametrization, which also
breaks ``torch.compile``). Our MoE block instead looks through the wrappers
(:func:`unwrap_peft`) and hands the factors to :class:`~polyaccel.moe.layers.Experts`, which
computes ``x·A_e`` with a grouped GEMM over the same sorted token rows and group offsets as
the base GEMM and adds its rank-r product with ``B_e`` into the base GEMM's output in place
(:func:`grouped_lora_linear`; in the backward, the adapter's data gradient into the base
one), so no [N, O] delta is ever written. The frozen base weight gets no weight-gradient GEMM
at all.

PEFT's layout of a 3-D parameter ``[E, out, in]`` adapter (read from ``peft.tuners.lora.layer``):
``lora_A.weight [E * r, in]`` with row ``e * r + j``, ``lora_B.weight [out, r * E]`` with
column ``j * E + e``; the delta of expert ``e`` is ``scaling * B_e @ A_e``.

Shape legend: N sorted token copies, E experts, r rank, K input width, O output width.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyaccel.core import ops

logger = logging.getLogger("polyaccel.moe.lora")

#: PEFT ``target_parameters`` for our models' (and Transformers v5's) fused experts and router
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
ROUTER_PARAMETERS = ("mlp.gate.weight",)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True, slots=True)
class LoraFactors:
    """One adapter on one weight: delta = ``scale * B @ A`` (per group for 3-D factors).

    A [E, r, K] and B [E, O, r] for expert weights [E, O, K]; A [r, K], B [O, r] for a 2-D
    weight [O, K]. Views of PEFT's parameters (differentiable), in the compute dtype.
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float


# ---------------------------------------------------------------------------------------------
# Looking through PEFT's wrappers
# ---------------------------------------------------------------------------------------------


def is_peft_param_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is PEFT's LoRA ``ParamWrapper`` (duck-typed: no PEFT import)."""
    return hasattr(module, "parameter_name") and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def unwrap_peft(module: nn.Module, dtype: torch.dtype | None = None
                ) -> tuple[nn.Module, dict[str, list[LoraFactors]]]:
    """``(base module, {parameter name: factors of the active, unmerged adapters})``.

    ``module`` may be a chain of PEFT ``ParamWrapper``s (one per targeted parameter) around
    our module, or the module itself (no factors). Factors are cast to ``dtype`` when given.
    """
    factors: dict[str, list[LoraFactors]] = {}
    while is_peft_param_wrapper(module):
        if not module.disable_adapters and not module.merged:
            for name in _active(module):
                if name in module.lora_A:
                    factors.setdefault(module.parameter_name, []).append(_factors(module, name, dtype))
        module = module.base_layer
    return module, factors


def _active(wrapper: nn.Module) -> list[str]:
    active = wrapper.active_adapters
    return [active] if isinstance(active, str) else list(active)


def _factors(wrapper: nn.Module, adapter: str, dtype: torch.dtype | None) -> LoraFactors:
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    E, r = wrapper.num_experts, wrapper.r[adapter]
    if E > 1 or getattr(wrapper, "_param_ndim", 2) == 3:  # a 3-D expert stack, even of one expert
        if not wrapper._did_swap_in_out_features:
            raise NotImplementedError("LoRA on expert weights stored [E, in, out] (is_transposed) is not supported")
        a = a.view(E, r, a.shape[-1])
        b = _expert_major(b, E)
    return LoraFactors(a, b, float(wrapper.scaling[adapter]))


@torch.library.custom_op("polyaccel_lora::expert_major", mutates_args=())
def _expert_major(b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT's expert ``lora_B`` weight [O, r * E] (expert fastest) as a contiguous [E, O, r].

    An opaque op so that its output's layout is fixed: traced as ``permute().contiguous()``,
    inductor (torch 2.11 on CUDA, 2.13 on CPU) is free to drop the copy and hands
    ``_grouped_mm`` an operand with no unit stride ("Invalid strides/sizes").
    """
    return b.view(b.shape[0], -1, num_experts).permute(2, 0, 1).clone(memory_format=torch.contiguous_format)


@_expert_major.register_fake
def _(b: torch.Tensor, num_experts: int) -> torch.Tensor:
    return b.new_empty(num_experts, b.shape[0], b.shape[1] // num_experts)


def _expert_major_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    # grad [E, O, r] -> [O, r, E] -> [O, r * E]
    return grad.permute(1, 2, 0).reshape(grad.shape[1], -1), None


_expert_major.register_autograd(_expert_major_backward)


def merged_weight(weight: torch.Tensor, factors: Sequence[LoraFactors]) -> torch.Tensor:
    """``weight + sum scale * B @ A`` for a small 2-D weight (the router's [E, H])."""
    for f in factors:
        weight = weight + f.scale * (f.B @ f.A).to(weight.dtype)
    return weight


# ---------------------------------------------------------------------------------------------
# Grouped LoRA: scale * (x·A_e)·B_e per expert, never forming W + B·A
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("polyaccel_lora::grouped_wgrad", mutates_args=())
def _grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``ops.grouped_mm_wgrad(dy, x, offsets)`` [E, O, K] as one opaque op: a compiled layer
    (the backward of :class:`_GroupedLoraLinear` is traced with the forward) calls the backend's
    kernel (Triton on CUDA, a host-syncing loop in core's reference) instead of tracing into it,
    which could graph-break and so send a checkpointed layer back to eager."""
    return ops.grouped_mm_wgrad(dy, x, offsets)


@_grouped_wgrad.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return dy.new_empty(offsets.shape[0], dy.shape[1], x.shape[1])


class _GroupedLoraLinear(torch.autograd.Function):
    """y [N, O] = grouped_mm(x, W) + grouped_mm(scale * grouped_mm(x, A), B) as one node: the
    adapter's rank-r product is added into the base GEMM's output in place
    (:func:`_grouped_mm_plus_lowrank`), and in the backward its data gradient into the base
    data gradient, so no [N, O] delta is written, read back and added (four passes over the
    largest tensors of the layer, twice per adapter per micro-batch). ``weight=None``: the
    adapter's delta alone (a further active adapter, added by the caller). The scale is applied
    to the rank-r product: one pass over N x r numbers. ``source[rows]`` given: ``x`` is those
    rows, and the backward keeps the smaller ``source`` instead of ``x``."""

    @staticmethod
    def forward(ctx, x, weight, A, B, offsets, scale, source, rows):  # noqa: ANN001, ANN205
        xa = ops.grouped_mm(x, A, offsets) * scale  # [N, r], scaled
        if weight is None:
            y = ops.grouped_mm(xa, B, offsets)
        else:
            y = _grouped_mm_plus_lowrank(x, weight, xa, B.transpose(1, 2), offsets)
        if source is not None:
            ctx.save_for_backward(source, rows, xa, weight, A, B, offsets)
        else:
            ctx.save_for_backward(x, None, xa, weight, A, B, offsets)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        x, rows, xa, weight, A, B, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        g = ops.grouped_mm(dy, B.transpose(1, 2), offsets) * ctx.scale  # d(x·A) [N, r]
        dx = dW = dA = dB = None
        if ctx.needs_input_grad[0]:
            dx = (ops.grouped_mm(g, A.transpose(1, 2), offsets) if weight is None
                  else _grouped_mm_plus_lowrank(dy, weight.transpose(1, 2), g, A, offsets))
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            x_rows = (x if rows is None else x.index_select(0, rows)).to(dy.dtype)
            if ctx.needs_input_grad[1]:  # a base weight left trainable beside its adapter
                dW = _grouped_wgrad(dy, x_rows, offsets).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                dA = _grouped_wgrad(g, x_rows, offsets)
        if ctx.needs_input_grad[3]:
            dB = _grouped_wgrad(dy, xa, offsets)  # xa already carries the scale
        return dx, dW, dA, dB, None, None, None, None


@torch.library.custom_op("polyaccel_lora::grouped_mm_plus_lowrank", mutates_args=())
def _grouped_mm_plus_lowrank(x: torch.Tensor, weight: torch.Tensor, u: torch.Tensor, factor: torch.Tensor,
                             offsets: torch.Tensor) -> torch.Tensor:
    """``grouped_mm(x, weight) + u_g @ factor_g`` per group: the base GEMM, then
    ``ops.grouped_lowrank_add_`` into its fresh output. One functional op: what a compiled
    layer, or selective recomputation, sees is a GEMM whose output nothing mutates afterwards
    (selective recomputation keeps GEMM outputs and hands them back in the recompute, so an
    in-place add on a kept output would be refused, or applied twice)."""
    y = ops.grouped_mm(x, weight, offsets)
    if not y.is_contiguous():  # a padded (unaligned) width comes back as a view: own the result
        y = y.contiguous()
    return ops.grouped_lowrank_add_(y, u, factor, offsets)


@_grouped_mm_plus_lowrank.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, u: torch.Tensor, factor: torch.Tensor,
      offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def grouped_lora_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, factors: Sequence[LoraFactors],
                        gathered_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A grouped linear with its LoRA adapters: ``grouped_mm(x, weight)`` plus, per expert,
    ``scale * (x·A_e)·B_e``, never forming ``W + B·A`` nor (for the first adapter) the [N, O]
    delta. x [N, K] sorted by group, weight [E, O, K], ``offsets`` int32 [E], factors A [E, r, K]
    and B [E, O, r]; ``gathered_from=(source, rows)``: ``x`` is ``source[rows]``, and the
    backward keeps the [T, K] source instead of the [N, K] copies."""
    if not factors:
        return ops.grouped_mm(x, weight, offsets)
    source, rows = gathered_from if gathered_from is not None else (None, None)
    source = None if source is None else source.detach()
    y = None
    for f in factors:  # the first added into the base output; further active adapters (rare): deltas
        out = _GroupedLoraLinear.apply(x, weight if y is None else None, f.A, f.B, offsets, f.scale, source, rows)
        y = out if y is None else y + out
    return y


def dense_lora(x: torch.Tensor, f: LoraFactors) -> torch.Tensor:
    """``scale * (x @ A.T) @ B.T`` for 2-D factors (one expert of the eager path)."""
    return torch.nn.functional.linear(torch.nn.functional.linear(x, f.A), f.B) * f.scale


# ---------------------------------------------------------------------------------------------
# Setting up a model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class LoraSettings:
    """What gets an adapter (the finetune CLI's ``lora:`` section).

    Attributes:
        r, alpha: rank and scale (``alpha / r`` multiplies ``B @ A``).
        dropout: dropout on the adapters' input; PEFT's parameter adapters (experts, router)
            have none, so it needs ``experts: false`` and ``router: false``.
        target_modules: linear modules by name suffix (default: the attention projections).
        experts: adapters on the fused experts (``mlp.experts.gate_up_proj`` / ``down_proj``).
        router: an adapter on the router weight (``mlp.gate.weight``).
        recompute: ``"none"``, ``"selective"`` (checkpoint each decoder layer but keep the
            outputs of the large GEMMs and attention, recomputing only the cheap parts:
            :func:`selective_recompute_policy`) or ``"auto"`` (the default; :func:`resolve_recompute`:
            none when the estimate without recomputation fits 85% of the device's memory).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(ATTENTION_MODULES))
    experts: bool = True
    router: bool = False
    recompute: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r={self.r!r} must be a positive integer")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not 0 < self.alpha < float("inf"):
            raise ValueError(f"lora.alpha={self.alpha!r} must be a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout!r} must be in [0, 1)")
        if self.dropout and (self.experts or self.router):
            raise ValueError("lora.dropout needs lora.experts: false and lora.router: false (PEFT's adapters on "
                             "parameters have no dropout)")
        if self.recompute not in ("none", "selective", "auto"):
            raise ValueError(f"lora.recompute={self.recompute!r} must be 'none', 'selective' or 'auto'")
        if not (self.target_modules or self.experts or self.router):
            raise ValueError("lora: nothing to adapt (target_modules empty, experts and router false)")

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig`` (task type causal LM)."""
        peft = require_peft()
        params = [*(EXPERT_PARAMETERS if self.experts else ()), *(ROUTER_PARAMETERS if self.router else ())]
        return peft.LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                               target_modules=list(self.target_modules) or None,
                               target_parameters=params or None, task_type="CAUSAL_LM")


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError saying what to install."""
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA needs PEFT: pip install 'polyaccel-moe[lora]' (or 'peft>=0.18'; "
                          "tested with 0.21.2)") from e
    return peft


def apply_lora(model: nn.Module, settings: LoraSettings, *, seq_len: int | None = None, micro_batch: int = 1
               ) -> nn.Module:
    """Wrap ``model`` with PEFT adapters as ``settings`` say; returns the ``PeftModel``.

    The base weights are frozen (no gradients, no optimizer state); adapters are kept in fp32
    (PEFT's ``autocast_adapter_dtype``) and cast to the compute dtype in the expert path.
    ``seq_len`` / ``micro_batch``: the training shape, for ``recompute="auto"``.
    """
    peft = require_peft()
    settings = resolve_recompute_for(model, settings, seq_len, micro_batch)
    model = peft.get_peft_model(model, settings.peft_config())
    compute_linear_lora_in_input_dtype(model)
    if settings.recompute == "selective":
        enable_selective_recompute(model)
    return model


def load_adapter(model: nn.Module, path: str, *, trainable: bool = True, settings: LoraSettings | None = None,
                 seq_len: int | None = None, micro_batch: int = 1) -> nn.Module:
    """Load a PEFT adapter directory (ours or plain PEFT's) onto ``model``; returns the ``PeftModel``.
    ``ValueError`` when the file lacks some of the model's adapter tensors or holds others
    (:func:`check_adapter_keys`)."""
    peft = require_peft()
    if settings is not None:
        settings = resolve_recompute_for(model, settings, seq_len, micro_batch)
    model = peft.PeftModel.from_pretrained(model, path, is_trainable=trainable)
    check_adapter_keys(model, path)
    compute_linear_lora_in_input_dtype(model)
    if settings is not None and settings.recompute == "selective":
        enable_selective_recompute(model)
    return model


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: ``adapter_config.json`` fields that change what the adapters are or compute
_ADAPTER_FIELDS = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters",
                   "use_rslora", "use_dora", "bias", "fan_in_fan_out", "modules_to_save", "layers_to_transform",
                   "layers_pattern", "rank_pattern", "alpha_pattern", "exclude_modules")


def _saved_keys(path: str | Path) -> list[str]:
    """The tensor names in the PEFT adapter folder ``path`` (the safetensors header only, else
    PEFT's own ``weights_only`` load of ``adapter_model.bin``)."""
    file = Path(path) / ADAPTER_WEIGHTS
    if file.is_file():
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    from peft.utils import load_peft_weights

    return list(load_peft_weights(str(path), device="cpu"))


def check_adapter_keys(model: nn.Module, path: str | Path) -> None:
    """Raise ``ValueError`` unless the adapter file in ``path`` holds exactly the adapter
    tensors of ``model`` (a ``PeftModel``): PEFT leaves adapters the file lacks at their fresh
    initialisation and drops tensors the model has no place for, each with at most a warning."""
    peft = require_peft()
    expected = set(peft.get_peft_model_state_dict(model))
    saved = set(_saved_keys(path))
    missing, unexpected = sorted(expected - saved), sorted(saved - expected)
    if missing or unexpected:
        what = [f"{len(missing)} of this model's adapter tensors are missing (first: {missing[0]})"] if missing else []
        what += [f"{len(unexpected)} are for modules this model lacks (first: {unexpected[0]})"] if unexpected else []
        raise ValueError(f"the adapters in {path} are not this model's: {'; '.join(what)}")


def adapter_config_mismatch(path: str | Path, settings: LoraSettings) -> str | None:
    """How ``path``'s ``adapter_config.json`` differs from the adapters ``settings`` describe
    (the first differing field, both values), or None when it matches."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        return f"{file} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(saved, dict):
        return f"{file} is not a JSON object"
    want = settings.peft_config().to_dict()
    for key in _ADAPTER_FIELDS:
        have = saved.get(key, want.get(key))
        if _normalized(have) != _normalized(want.get(key)):
            shown = want.get(key)
            shown = sorted(shown) if isinstance(shown, set | list | tuple) else getattr(shown, "value", shown)
            return f"{file} has {key}={have!r}, this run's lora section gives {shown!r}"
    return None


def _normalized(value: Any) -> Any:
    if isinstance(value, set | list | tuple | dict) and not value:
        return None  # PEFT saves an unset list field as [] or null
    if isinstance(value, set | list | tuple):
        return sorted(map(str, value))
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return float(value)
    return str(getattr(value, "value", value))


def _plain_linear_lora(module: nn.Module) -> bool:
    """PEFT's ``lora.Linear`` with plain LoRA only (no DoRA, no LoRA bias)."""
    if not (hasattr(module, "lora_A") and hasattr(module, "base_layer") and isinstance(module.base_layer, nn.Linear)):
        return False
    return all(not module.use_dora.get(n, False) and getattr(module.lora_B[n], "bias", None) is None
               for n in module.lora_A)


def _linear_lora_forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``base(x) + scale * dropout(x) @ A.T @ B.T`` with the fp32 adapters cast to ``x``'s dtype
    (PEFT casts ``x`` up to fp32 instead: fp32 GEMMs and an fp32 copy of every input)."""
    if args or kwargs or module.disable_adapters or module.merged:
        return type(module).forward(module, x, *args, **kwargs)
    out = module.base_layer(x)
    for name in _active(module):
        if name in module.lora_A:
            f = LoraFactors(module.lora_A[name].weight.to(x.dtype), module.lora_B[name].weight.to(x.dtype),
                            float(module.scaling[name]))
            out = out + dense_lora(module.lora_dropout[name](x), f)
    return out


def compute_linear_lora_in_input_dtype(model: nn.Module) -> int:
    """Make each plain PEFT ``lora.Linear`` of ``model`` (attention projections) compute its
    adapter in the input's dtype (bf16) from its fp32 weights; returns how many. The weights,
    their gradients (fp32, through the cast) and PEFT's saved files are unchanged."""
    n = 0
    for module in model.modules():
        if _plain_linear_lora(module) and not getattr(module, "_polyaccel_lora_forward", False):
            module.forward = types.MethodType(_linear_lora_forward, module)
            module._polyaccel_lora_forward = True
            n += 1
    return n


def resolve_recompute_for(model: nn.Module, settings: LoraSettings, seq_len: int | None,
                          micro_batch: int = 1) -> LoraSettings:
    """:func:`resolve_recompute` for ``model`` as it is: its config, device, weight size and
    whether its layers compile (ours with ``compile`` on this device; anything else is eager)."""
    if settings.recompute != "auto":
        return settings
    config = model.config
    if seq_len is None:
        seq_len = config.max_position_embeddings
        logger.info("lora.recompute=auto: no training sequence length given; sizing for the model's "
                    "max_position_embeddings=%d", seq_len)
    from polyaccel.moe.config import compiles_layers

    param = next(model.parameters())
    backend = getattr(model, "backend_config", None)
    compiled = backend is not None and compiles_layers(backend, param.device.type)
    return resolve_recompute(settings, config, seq_len, micro_batch=micro_batch, device=param.device,
                             weight_bytes=param.element_size(), compiled=compiled)


def resolve_recompute(settings: LoraSettings, config: Any, seq_len: int, *, micro_batch: int = 1,
                      device: torch.device | str | None = None, weight_bytes: int = 2,
                      device_memory_gib: float | None = None, budget: float = 0.85,
                      compiled: bool = True) -> LoraSettings:
    """``settings`` with ``recompute="auto"`` decided: ``"none"`` when
    :func:`estimate_lora_memory` without recomputation is under ``budget`` of the device's
    memory (``device_memory_gib``, else the CUDA device's total), else ``"selective"``. Logs
    which and why. Without a CUDA device (or a given size) it is ``"none"``; a config the
    estimate cannot read gets ``"selective"``."""
    if settings.recompute != "auto":
        return settings
    if device_memory_gib is None:
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            logger.info("lora.recompute=auto -> none: %s is not a CUDA device (no device memory to fit)", device)
            return dataclasses.replace(settings, recompute="none")
        device_memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        need = estimate_lora_memory(config, seq_len, dataclasses.replace(settings, recompute="none"),
                                    micro_batch=micro_batch, weight_bytes=weight_bytes, compiled=compiled)["total"]
    except (AttributeError, TypeError) as e:
        logger.info("lora.recompute=auto -> selective: no memory estimate for this config (%s)", e)
        return dataclasses.replace(settings, recompute="selective")
    limit = budget * device_memory_gib
    choice = "none" if need < limit else "selective"
    logger.info("lora.recompute=auto -> %s: estimated peak without recomputation %.1f GiB %s %.0f%% of %.1f GiB "
                "(seq %d x micro-batch %d)", choice, need, "<" if choice == "none" else ">=", budget * 100,
                device_memory_gib, seq_len, micro_batch)
    return dataclasses.replace(settings, recompute=choice)


def settings_from(section: Any) -> LoraSettings:
    """:class:`LoraSettings` from the finetune config's ``lora:`` section (same field names)."""
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(LoraSettings)}
    modules = fields["target_modules"]
    if isinstance(modules, str) or not all(isinstance(m, str) for m in modules or ()):
        raise ValueError(f"lora.target_modules must be a list of module names, got {modules!r}")
    fields["target_modules"] = list(modules or ())
    return LoraSettings(**fields)


def finetune_setup(model: nn.Module, section: Any, train: Any, resume_from: Any, *, world_size: int = 1,
                   ep: int = 1, graph_asked: bool = False) -> tuple[nn.Module, Any]:
    """The finetune loop's LoRA step: adapters on ``model`` (new, or the checkpoint's when
    resuming) and the train settings that apply to them: the graphed micro-step where the loop
    chose it, except under selective recomputation (its checkpoints save RNG state on the
    host); no weight-gradient window (the base weights have no gradients). Raises
    ``ConfigError`` on what cannot run (``graph_asked``: ``train.cuda_graph`` was ``true``, not
    ``auto``)."""
    from polyaccel.moe.train_config import ConfigError

    try:
        settings = settings_from(section)
        require_peft()
    except (ValueError, ImportError) as e:
        raise ConfigError(f"lora: {e}") from e
    if ep > 1:
        raise ConfigError("lora: expert parallelism (parallel.ep > 1) with LoRA is not supported")
    shape = dict(seq_len=train.seq_len, micro_batch=train.micro_batch)
    settings = resolve_recompute_for(model, settings, shape["seq_len"], shape["micro_batch"])
    if settings.recompute == "selective" and train.cuda_graph:
        if graph_asked:
            raise ConfigError("lora: train.cuda_graph=true does not run with lora.recompute=selective "
                              "(its checkpoints save RNG state on the host); set one of them otherwise")
        logger.warning("polyaccel.moe fast path: CUDA graph per micro-batch off: lora.recompute=selective "
                       "checkpoints save RNG state on the host")
        train = dataclasses.replace(train, cuda_graph=False)
    backend = getattr(model, "backend_config", None)
    if resume_from is not None:
        _check_resumed_adapter(Path(resume_from), settings)
    try:
        if resume_from is not None:
            model = load_adapter(model, str(resume_from), trainable=True, settings=settings, **shape)
        else:
            model = apply_lora(model, settings, **shape)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # PEFT's ValueErrors (no module matched, one it cannot adapt), a damaged adapter file
        why = re.sub(r"^(Target module \w+)\(.*\)( is not supported)", r"\1\2", " ".join(str(e).split()))  # a module's repr
        why = f"{type(e).__name__}: {why[:300]}{' ...' if len(why) > 300 else ''}"
        if resume_from is None:
            if not isinstance(e, ValueError):
                raise
            raise ConfigError(f"lora: PEFT cannot place the adapters ({why}); check lora.target_modules "
                              "(names of linear layers, e.g. q_proj)", key="lora.target_modules") from None
        from polyaccel.moe.checkpoint import CheckpointError

        raise CheckpointError(f"checkpoint.resume: the LoRA adapters in {resume_from} cannot be loaded ({why}); "
                              "resume from another checkpoint, or use a new checkpoint.dir") from None
    if backend is not None and backend.loss == "fused" and hasattr(model.get_output_embeddings(), "lora_A"):
        raise ConfigError("lora.target_modules: adapters on lm_head are never trained with the fused loss (it reads "
                          "lm_head.weight, not the adapters); remove lm_head, or set model.backend.loss=standard",
                          key="lora.target_modules")
    return model, dataclasses.replace(train, wgrad_window=1)


def _check_resumed_adapter(path: Path, settings: LoraSettings) -> None:
    """A LoRA checkpoint's adapter files are safetensors and the adapters of this run's ``lora``
    section; a :class:`~polyaccel.moe.checkpoint.CheckpointError` otherwise."""
    from polyaccel.moe.checkpoint import CheckpointError

    why = None if (path / ADAPTER_WEIGHTS).is_file() else (
        f"{path / ADAPTER_WEIGHTS} is missing (weights are read from safetensors only, never from a pickled "
        "adapter_model.bin)")
    why = why or adapter_config_mismatch(path, settings)
    if why is not None:
        raise CheckpointError(f"checkpoint.resume: the LoRA adapters in {path} cannot be loaded ({why}); resume from "
                              "another checkpoint, or use a new checkpoint.dir")


# ---------------------------------------------------------------------------------------------
# Selective recomputation
# ---------------------------------------------------------------------------------------------

#: ops whose outputs selective recomputation keeps (when their reduction dim is large)
_GEMM_OPS = ("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "grouped_mm_plus_lowrank")
_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                  "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu")


def _op_name(op: Any) -> str:
    return getattr(getattr(op, "overloadpacket", op), "__name__", str(op))


def selective_recompute_policy(cheap_k: int) -> Callable[..., Any]:
    """A checkpoint policy: keep attention outputs and GEMM outputs whose reduction dim is
    above ``cheap_k`` (the LoRA rank); recompute everything else in the backward: norms,
    RoPE, SwiGLU, casts, routing, token gathers and the rank-r ``·B`` LoRA GEMMs."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = _op_name(op)
        if name in _ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if name in _GEMM_OPS and (args[1] if name == "addmm" else args[0]).shape[-1] > cheap_k:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context(cheap_k: int) -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_recompute_policy(cheap_k))


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any]) -> Callable[..., Any]:
    """``forward`` under a non-reentrant checkpoint with ``context_fn``, as a plain function.

    A plain function, not ``functools.partial(checkpoint, ...)``: ``checkpoint`` is
    ``torch._disable_dynamo``-decorated, so a compiled layer whose ``forward`` *is* that call
    enters a dynamo-disabled frame first and nothing of the layer gets compiled. From this
    function's frame dynamo traces the call as its checkpoint higher-order op and the
    partitioner applies the policy.
    """
    from torch.utils.checkpoint import checkpoint

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed_forward


def enable_selective_recompute(model: nn.Module) -> None:
    """Checkpoint every decoder layer (non-reentrant) with :func:`selective_recompute_policy`
    at the model's largest LoRA rank.

    The checkpoint goes inside each layer's ``forward`` (not around the module call as
    ``gradient_checkpointing_enable`` does), so a compiled layer (``BackendConfig(compile=True)``)
    traces it and its partitioner follows the policy.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    ranks = [r for m in model.modules() if isinstance(getattr(m, "r", None), dict) for r in m.r.values()]
    context_fn = functools.partial(_selective_context, max(ranks, default=16))
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and not getattr(layer, "_polyaccel_selective", False):
            layer.forward = _checkpointed(layer.forward, context_fn)
            layer._polyaccel_selective = True
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


# ---------------------------------------------------------------------------------------------
# Memory estimate
# ---------------------------------------------------------------------------------------------


def _experts_shape(config: Any) -> tuple[int, int]:
    """(routed experts, expert FFN width) of a Qwen3-MoE, OLMoE or Mixtral config; raises
    AttributeError for others (DeepSeek-V3's latent attention and shared experts are not in
    the estimates below)."""
    if getattr(config, "kv_lora_rank", None):
        raise AttributeError(f"{type(config).__name__}: latent attention is not in the LoRA memory estimate")
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    width = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", None)
    if not experts or not width:
        raise AttributeError(f"{type(config).__name__} names no expert count or expert FFN width")
    return experts, width


def lora_param_count(config: Any, settings: LoraSettings) -> int:
    """Adapter parameters of a Qwen3-MoE, OLMoE or Mixtral ``config`` under ``settings``."""
    H, L, r = config.hidden_size, config.num_hidden_layers, settings.r
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    widths = {"q_proj": (H, config.num_attention_heads * D), "k_proj": (H, config.num_key_value_heads * D),
              "v_proj": (H, config.num_key_value_heads * D), "o_proj": (config.num_attention_heads * D, H)}
    per_layer = sum(r * (i + o) for name, (i, o) in widths.items() if name in settings.target_modules)
    E, inter = _experts_shape(config)
    if settings.experts:
        per_layer += r * E * (H + 2 * inter) + r * E * (inter + H)
    if settings.router:
        per_layer += r * (H + E)
    return L * per_layer


def estimate_lora_memory(config: Any, seq_len: int, settings: LoraSettings, *, micro_batch: int = 1,
                         weight_bytes: int = 2, adapter_bytes: int = 4, loss_chunk: int = 1024,
                         compiled: bool = True) -> dict[str, float]:
    """Peak training memory in GiB of LoRA on a Qwen3-MoE, OLMoE or Mixtral model, one micro-batch live.

    Parts: frozen weights (``weight_bytes`` each, no fp32 copy), adapters with their
    gradients and AdamW state (``adapter_bytes`` each, two fp32 moments), saved activations of
    every layer (with ``settings.recompute``), one layer's full activations being recomputed /
    back-propagated, and the fused loss's chunk of fp32 logits. Activations are bf16 except
    where noted; the per-layer terms follow the code paths of ``layers.py`` and this module.
    ``compiled``: layers compiled (``BackendConfig(compile=...)``, on by default on CUDA), whose
    partitioner recomputes the cheap elementwise work itself and saves about the GEMM outputs
    plus the gathered expert inputs (H200, Qwen3-30B-A3B shapes, seq 4096: 0.54 GiB a layer
    measured, of which 0.11 are the sorted expert input copies kept for the adapters' dA; 0.51
    estimated; the eager estimate, 1.09, stays for uncompiled layers).
    """
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    NH, NKV = config.num_attention_heads, config.num_key_value_heads
    (E, inter), k = _experts_shape(config), config.num_experts_per_tok
    T, r, b = micro_batch * seq_len, settings.r, 2
    n_params = sum(p for p in _base_param_counts(config))
    adapters = lora_param_count(config, settings)
    attn_lora = any(m in settings.target_modules for m in ATTENTION_MODULES)
    # GEMM and attention outputs (kept under selective recomputation)
    gemm = T * (NH * D + 2 * NKV * D + H) * b + T * NH * D * b + T * E * b  # q k v o, sdpa out, router
    gemm += T * k * (2 * inter + H) * b  # expert GEMMs
    gemm += (T * 4 * r * 4 if attn_lora else 0) + (T * k * 2 * r * b if settings.experts else 0)  # x·A
    gathered = T * k * (H + inter) * b  # the experts' gathered inputs and SwiGLU outputs
    if compiled:  # inductor's partitioner recomputes the rest of the elementwise work
        cheap = gathered
    else:  # what eager autograd saves besides: norm inputs in fp32, RoPE'd q/k, router
        # probabilities, fp32 input copies of PEFT's attention adapters, LoRA ·B outputs
        cheap = 2 * T * H * (4 + b) + T * NH * D * (4 + 2 * b) + T * NKV * D * (4 + 2 * b)
        cheap += gathered + T * E * 4 * 2
        if attn_lora:
            cheap += T * (3 * H + NH * D) * 4
        if settings.experts:
            cheap += T * k * (2 * inter + H) * b
    full_layer = gemm + cheap
    saved_layer = T * H * b + gemm if settings.recompute == "selective" else full_layer
    gib = 2**30
    parts = {
        "weights": n_params * weight_bytes / gib,
        "adapters_grads_adam": adapters * adapter_bytes * 4 / gib,
        "adapter_casts": adapters * b / gib,  # compute-dtype copies of the factors, kept for backward
        "activations": L * saved_layer / gib,
        "layer_in_backward": full_layer / gib,
        "loss_chunk": min(T, loss_chunk) * V * 4 * 2 / gib,
    }
    parts["total"] = sum(parts.values())
    return parts


def _base_param_counts(config: Any) -> list[int]:
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    D = getattr(config, "head_dim", None) or H // config.num_attention_heads
    NH, NKV = config.num_attention_heads, config.num_key_value_heads
    E, inter = _experts_shape(config)
    qk_norms = {"qwen3_moe": 2 * D, "olmoe": (NH + NKV) * D}.get(getattr(config, "model_type", ""), 0)
    attn = H * NH * D * 2 + H * NKV * D * 2 + qk_norms + 2 * H
    moe = E * 3 * H * inter + E * H
    head = V * H * (1 if getattr(config, "tie_word_embeddings", False) else 2) + H
    return [L * (attn + moe), head]


__all__ = [
    "LoraFactors", "LoraSettings", "apply_lora", "dense_lora", "estimate_lora_memory", "finetune_setup",
    "grouped_lora_linear",
    "is_peft_param_wrapper", "load_adapter", "lora_param_count", "merged_weight", "resolve_recompute", "selective_recompute_policy",
    "unwrap_peft",
]
