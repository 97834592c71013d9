"""``polyaccel.moe.AutoModelForCausalLM``: Transformers' auto class, with polyaccel's MoE layers
for the architectures we implement.

Change one import and keep the rest of the script::

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 backend=BackendConfig(gate="learned"))

Supported ``model_type``s (see :data:`polyaccel.moe.models.MODEL_TYPES`) get our model
classes, which keep Transformers' class names, parameter names and checkpoint format; any
other architecture loads as plain Transformers with a log line saying why, plus whatever
``BackendConfig`` choices apply to it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel

from polyaccel.moe.config import BackendConfig, compiles_layers
from polyaccel.moe.models import MODEL_TYPES, causal_lm_class

logger = logging.getLogger("polyaccel.moe")

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder",
               "token", "trust_remote_code", "code_revision", "_commit_hash")
# Loading options that are also config attributes; the model loader must still see them.
_LOADER_KWARGS = ("dtype", "torch_dtype", "quantization_config")


class AutoModelForCausalLM(transformers.AutoModelForCausalLM):
    """Drop-in for ``transformers.AutoModelForCausalLM`` returning polyaccel MoE models.

    ``from_pretrained`` / ``from_config`` take Transformers' arguments plus:

    - ``backend``: a :class:`BackendConfig` (default ``BackendConfig()``: grouped GEMM
      experts, learned router, fused loss, SDPA attention, backend ``"auto"``).
    - ``parallel``: a :class:`polyaccel.core.ParallelPlan`, or ``device_mesh``: the
      :class:`polyaccel.core.ParallelMeshes` it builds (or just its MoE mesh
      ``("ep_shard", "ep")``). With ``ep > 1`` (under torchrun / Ray Train, process group up)
      the meshes are built, each rank reads only its own experts from the checkpoint, and the
      model comes back sharded: experts over the MoE mesh, the rest FSDP2 over dp (see
      :mod:`polyaccel.moe.expert_parallel`). With ``ep == 1`` they are only recorded on the
      model (shard it with FSDP2 after loading).
    """

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *model_args: Any,
                        backend: BackendConfig | None = None, device_mesh: Any = None,
                        parallel: Any = None, **kwargs: Any) -> PreTrainedModel:
        backend = _check_backend(backend)
        _check_local_index(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        config, kwargs = _resolve_config(pretrained_model_name_or_path, kwargs)
        model_class, reason = _pick_class(config)
        if model_class is None:
            logger.warning("polyaccel.moe: using plain Transformers for model_type=%r: %s",
                           config.model_type, reason)
            _prepare_fallback_kwargs(kwargs, backend)
            if device_mesh is not None:
                kwargs["device_mesh"] = device_mesh
            model = transformers.AutoModelForCausalLM.from_pretrained(
                pretrained_model_name_or_path, *model_args, config=config, **kwargs)
            if isinstance(model, tuple):  # output_loading_info=True: (model, info)
                return _apply_to_fallback(model[0], backend), *model[1:]
            return _apply_to_fallback(model, backend)
        ep_setup = _expert_parallel_setup(device_mesh, parallel)
        _drop_ignored_kwargs(kwargs)
        if ep_setup is not None:  # ---- expert parallelism: polyaccel.moe.ep_checkpoint
            from polyaccel.moe.ep_checkpoint import load_expert_parallel

            plan, meshes = ep_setup
            unexpected: list[str] = []
            model = load_expert_parallel(model_class, pretrained_model_name_or_path, config, plan, meshes,
                                         dtype=_dtype(kwargs, config), device=_rank_device(), backend=backend,
                                         unexpected=unexpected)
            model.device_mesh, model.parallel_plan = meshes, plan
            if kwargs.get("output_loading_info"):  # as Transformers returns it (a missing weight raised)
                return model, {"missing_keys": [], "unexpected_keys": unexpected, "mismatched_keys": [],
                               "error_msgs": []}
            return model
        model = model_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
        if isinstance(model, tuple):  # output_loading_info=True: (model, info)
            return _finish(model[0], backend, device_mesh, parallel), *model[1:]
        return _finish(model, backend, device_mesh, parallel)

    @classmethod
    def from_config(cls, config: PreTrainedConfig, backend: BackendConfig | None = None,
                    device_mesh: Any = None, parallel: Any = None, **kwargs: Any) -> PreTrainedModel:
        backend = _check_backend(backend)
        model_class, reason = _pick_class(config)
        if model_class is None:
            logger.warning("polyaccel.moe: using plain Transformers for model_type=%r: %s",
                           config.model_type, reason)
            _prepare_fallback_kwargs(kwargs, backend)
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
            return _apply_to_fallback(model, backend)
        ep_setup = _expert_parallel_setup(device_mesh, parallel)
        _drop_ignored_kwargs(kwargs)
        model = model_class._from_config(config, **kwargs)
        if ep_setup is not None:  # ---- expert parallelism: same seed on every rank, then shard
            from polyaccel.moe.parallelize import apply_fsdp

            plan, meshes = ep_setup
            model = _finish(model.to(_rank_device()), backend, meshes, plan)
            param_dtype = next(model.parameters()).dtype
            return apply_fsdp(model, plan, meshes, param_dtype=param_dtype, reduce_dtype=torch.float32)
        return _finish(model, backend, device_mesh, parallel)


def _check_backend(backend: BackendConfig | None) -> BackendConfig:
    if backend is None:
        return BackendConfig()
    if not isinstance(backend, BackendConfig):
        raise TypeError(f"backend must be a polyaccel.moe.BackendConfig, not {type(backend).__name__}")
    return backend


def _check_local_index(path: Any, subfolder: str) -> None:
    """Refuse a local checkpoint whose weight index names shards outside its folder (an
    absolute path or ``..``: Transformers would read any safetensors file on the machine)."""
    from polyaccel.moe.ep_checkpoint import index_escape

    if isinstance(path, str | os.PathLike) and (why := index_escape(Path(path, subfolder))) is not None:
        raise ValueError(why)


def _expert_parallel_setup(device_mesh: Any, parallel: Any) -> tuple[Any, Any] | None:
    """(plan, meshes) when ``parallel``/``device_mesh`` ask for ``ep > 1``, else None.

    ``device_mesh`` may be a ``ParallelMeshes`` or a MoE mesh with dims ``("ep_shard", "ep")``
    (the data-parallel mesh is then all ranks). Raises ``RuntimeError`` without a process group.
    """
    from polyaccel.core.parallel import ParallelMeshes, ParallelPlan

    names = getattr(getattr(device_mesh, "moe", device_mesh), "mesh_dim_names", None) or ()
    ep = getattr(parallel, "ep", 1) if parallel is not None else 1
    if "ep" in names:
        ep = max(ep, getattr(device_mesh, "moe", device_mesh)["ep"].size())
    if ep <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(f"expert parallelism (ep={ep}) needs torch.distributed initialised: run under torchrun "
                           "or Ray Train (or call torch.distributed.init_process_group first)")
    world = dist.get_world_size()
    if isinstance(parallel, ParallelPlan):
        plan = parallel
    else:
        plan = ParallelPlan(dp=world, ep=ep)
    plan.validate(world)
    if isinstance(device_mesh, ParallelMeshes):
        meshes = device_mesh
    elif device_mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh

        dp = init_device_mesh(device_mesh.device_type, (world,), mesh_dim_names=("dp_shard",))
        meshes = ParallelMeshes(dp=dp, moe=device_mesh)
    else:
        meshes = plan.build(world, _rank_device().type)
    return plan, meshes


def _rank_device() -> torch.device:
    """This rank's device: the current CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _dtype(kwargs: dict[str, Any], config: PreTrainedConfig) -> torch.dtype:
    """The dtype Transformers v5's loader would use: ``dtype=`` (or ``torch_dtype=``), by default
    ``"auto"``: the checkpoint config's dtype, else fp32."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype")) or "auto"
    if dtype == "auto":
        dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype or torch.float32


def _resolve_config(path: Any, kwargs: dict[str, Any]) -> tuple[PreTrainedConfig, dict[str, Any]]:
    """Load the config as Transformers' auto class does; return it and the remaining kwargs."""
    kwargs = dict(kwargs)
    config = kwargs.pop("config", None)
    if isinstance(config, PreTrainedConfig):
        return config, kwargs
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    loader = {k: kwargs.pop(k) for k in _LOADER_KWARGS if k in kwargs}
    config, rest = AutoConfig.from_pretrained(config if config is not None else path,
                                              return_unused_kwargs=True, **kwargs)
    rest.update({k: v for k, v in hub.items() if k not in ("code_revision", "_commit_hash")})
    rest.update(loader)
    return config, rest


def _pick_class(config: PreTrainedConfig) -> tuple[type[PreTrainedModel] | None, str]:
    model_class = causal_lm_class(config.model_type)
    if model_class is None:
        return None, (f"no polyaccel implementation of model_type={config.model_type!r} "
                      f"(supported: {', '.join(MODEL_TYPES)})")
    reason = model_class.unsupported_reason(config)
    if reason is not None:
        return None, reason
    return model_class, ""


def _drop_ignored_kwargs(kwargs: dict[str, Any]) -> None:
    attn = kwargs.pop("attn_implementation", None)
    if attn not in (None, "sdpa"):
        logger.warning("polyaccel.moe: attn_implementation=%r ignored; choose attention with "
                       "BackendConfig(attn=...)", attn)
    experts = kwargs.pop("experts_implementation", None)
    if experts is not None:
        logger.warning("polyaccel.moe: experts_implementation=%r ignored; choose experts with "
                       "BackendConfig(experts=...)", experts)


def _finish(model: Any, backend: BackendConfig, device_mesh: Any, parallel: Any) -> PreTrainedModel:
    model.apply_backend(backend)
    model.device_mesh, model.parallel_plan = device_mesh, parallel
    logger.info("polyaccel.moe: %s with %s", type(model).__name__, backend)
    return model


def _prepare_fallback_kwargs(kwargs: dict[str, Any], backend: BackendConfig) -> None:
    """Map the BackendConfig choices Transformers understands onto its loading kwargs."""
    if "attn_implementation" not in kwargs and backend.attn in ("auto", "sdpa", "flash", "cudnn", "fa4"):
        kwargs["attn_implementation"] = "sdpa"


def _apply_to_fallback(model: PreTrainedModel, backend: BackendConfig) -> PreTrainedModel:
    """Apply what can be applied to a plain Transformers model; log the rest."""
    from polyaccel.core import select_backend

    hardware = select_backend(backend.backend).name
    applied, skipped = ["attn=sdpa"], []
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None and _has_experts(model):
        try:
            setter(backend.experts)
            applied.append(f"experts={backend.experts}")
        except Exception as e:  # Transformers refuses implementations a model cannot use
            skipped.append(f"experts={backend.experts} ({e})")
    if compiles_layers(backend, hardware):
        model.compile()
        applied.append("compile")
    for name, default in (("gate", "learned"), ("rms_norm", "torch"), ("linear", "torch")):
        if getattr(backend, name) != default:
            skipped.append(f"{name}={getattr(backend, name)}")
    logger.warning("polyaccel.moe: fallback model %s: applied %s; not applicable: %s",
                   type(model).__name__, ", ".join(applied), ", ".join(skipped) or "nothing")
    return model


def _has_experts(model: PreTrainedModel) -> bool:
    return any(hasattr(m, "gate_up_proj") for m in model.modules())
