"""Which parts of the fast training path apply to a run: decided once, said once.

The fast path is compiled decoder layers (``BackendConfig(compile="auto")``), FlatAdamW, each
micro-batch's forward + backward replayed as a CUDA graph, and the expert weight gradients
of several micro-batches computed in one pass (the weight-gradient window). Every part is on
by default where it applies; where one cannot apply, :func:`plan` says why and the run takes
the next fastest configuration instead of failing. The finetune loop
(:mod:`polyaccel.moe.train`) and the Trainer integration (:mod:`polyaccel.moe.trainer`)
both ask here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

logger = logging.getLogger(__name__)

WINDOW_MEMORY_SHARE = 0.05
"""The most of the device's memory that the weight-gradient window may keep alive (the
expert activations of the micro-batches it defers)."""

WINDOW_ROWS_PER_EXPERT = 1024
"""Token rows per expert at which one weight-gradient GEMM runs near its peak: below it
(Qwen3-30B's 128 experts see ~256 rows in a 4096-token micro-batch) the window pays for its
memory; above it (Mixtral's 8 experts see ~1024) it only costs memory."""

_SAID: set[str] = set()


@dataclasses.dataclass(frozen=True, slots=True)
class FastPath:
    """The resolved choices: ``cuda_graph`` and ``wgrad_window``, and why any part is off."""

    cuda_graph: bool
    wgrad_window: int
    reasons: tuple[str, ...] = ()


def say_once(message: str) -> None:
    """Log ``message`` at INFO the first time this process sees it."""
    if message not in _SAID:
        _SAID.add(message)
        logger.warning("polyaccel.moe fast path: %s", message)


def graph_blockers(*, device: torch.device, fsdp: bool, optimizer: str, activation_checkpointing: bool,
                   peft: bool = False, param_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Why a graphed micro-step cannot run here (empty: it can)."""
    why = []
    if device.type != "cuda":
        why.append("it needs a CUDA device")
    if param_dtype != torch.bfloat16:
        why.append(f"{str(param_dtype).removeprefix('torch.')} expert weights take the per-expert reference "
                   "GEMMs, which read the group sizes on the host (bf16 uses the grouped GEMM)")
    if fsdp:
        why.append("it does not run under FSDP2 (its collectives and hooks run on the host); "
                   "use parallel.dense=replicate")
    if optimizer == "adamw":
        why.append("it needs FlatAdamW (train.optimizer=flat_adamw or auto): gradients must stay the same tensors")
    if activation_checkpointing:
        why.append("activation checkpointing saves RNG state on the host")
    if peft:
        why.append("PEFT adapters under Trainer are trained eagerly (the finetune CLI and GraphedMicroStep graph them)")
    return why


def kept_bytes_per_micro_batch(model_config: Any, tokens: int) -> int:
    """Bytes one deferred micro-batch keeps alive for the weight-gradient window: per token
    and MoE layer, the routed copies' inputs and output gradients of both expert GEMMs in
    bf16, ``2 * top_k * (3 * intermediate + hidden)``."""
    top_k = getattr(model_config, "num_experts_per_tok", 0) or 0
    inter = (getattr(model_config, "moe_intermediate_size", None)
             or getattr(model_config, "intermediate_size", 0) or 0)
    hidden = getattr(model_config, "hidden_size", 0) or 0
    layers = moe_layer_count(model_config)
    return 2 * top_k * (3 * inter + hidden) * tokens * layers


def moe_layer_count(model_config: Any) -> int:
    """Decoder layers that hold experts (dense ``mlp_only_layers`` and DeepSeek's first dense
    layers excluded)."""
    n = getattr(model_config, "num_hidden_layers", 0) or 0
    dense = set(getattr(model_config, "mlp_only_layers", None) or [])
    dense |= set(range(getattr(model_config, "first_k_dense_replace", 0) or 0))
    step = getattr(model_config, "decoder_sparse_step", 1) or 1
    return sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)


def auto_window(model_config: Any, *, tokens_per_micro_batch: int, grad_accum: int,
                device_bytes: int, share: float = WINDOW_MEMORY_SHARE) -> int:
    """The weight-gradient window: the fewest micro-batches that give each expert's weight
    gradient :data:`WINDOW_ROWS_PER_EXPERT` token rows, at most ``grad_accum``, and only as
    many as keep at most ``share`` of ``device_bytes``."""
    experts = next((getattr(model_config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(model_config, k, None)), 1)
    rows = tokens_per_micro_batch * (getattr(model_config, "num_experts_per_tok", 1) or 1) / experts
    wanted = min(grad_accum, max(1, math.ceil(WINDOW_ROWS_PER_EXPERT / max(rows, 1))))
    per = kept_bytes_per_micro_batch(model_config, tokens_per_micro_batch)
    window = 1
    for w in range(2, wanted + 1):
        if (w - 1) * per <= share * device_bytes:
            window = w
    return window


def plan(*, model_config: Any, device: torch.device, cuda_graph: bool | str, wgrad_window: int | str,
         fsdp: bool, optimizer: str, activation_checkpointing: bool, fused_grad_accumulation: bool,
         tokens_per_micro_batch: int, grad_accum: int, peft: bool = False,
         param_dtype: torch.dtype = torch.bfloat16) -> FastPath:
    """Resolve ``"auto"`` settings of the graphed micro-step and the weight-gradient window.

    Explicit settings are kept (the caller reports unmet requirements of an explicit ``True``
    as errors); each ``"auto"`` part that cannot apply is logged once with the reason.
    """
    reasons: list[str] = []
    graph = cuda_graph
    if cuda_graph == "auto":
        why = graph_blockers(device=device, fsdp=fsdp, optimizer=optimizer,
                             activation_checkpointing=activation_checkpointing, peft=peft,
                             param_dtype=param_dtype)
        graph = not why
        if why and device.type == "cuda":
            reasons.append("CUDA graph per micro-batch off: " + "; ".join(why))
    window = wgrad_window
    if wgrad_window == "auto":
        window = 1
        if device.type != "cuda":
            pass
        elif fsdp:
            reasons.append("weight-gradient window off: FSDP2 reduces gradients per micro-batch")
        elif not fused_grad_accumulation:
            reasons.append("weight-gradient window off: it needs backend.grad_accumulation=fused")
        elif activation_checkpointing:
            reasons.append("weight-gradient window off: activation checkpointing is set to save memory")
        elif peft:
            reasons.append("weight-gradient window off: frozen expert weights have no gradients")
        else:
            total = torch.cuda.get_device_properties(device).total_memory
            window = auto_window(model_config, tokens_per_micro_batch=tokens_per_micro_batch,
                                 grad_accum=grad_accum, device_bytes=total)
    for r in reasons:
        say_once(r)
    return FastPath(cuda_graph=bool(graph), wgrad_window=int(window), reasons=tuple(reasons))
