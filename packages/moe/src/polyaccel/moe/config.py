"""``BackendConfig``: which implementation each part of a polyaccel MoE model uses.

Precedence: an explicit ``BackendConfig(...)`` passed to ``from_pretrained``/``from_config``
wins over the defaults below; the checkpoint's ``config.json`` never stores these choices, so
a saved model stays a plain Hugging Face checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib.util

ATTN = ("auto", "sdpa", "flash", "cudnn", "fa4", "te")
LINEAR = ("torch", "te")
RMS_NORM = ("torch", "fused")
EXPERTS = ("eager", "grouped_mm")
GATE = ("learned", "balanced")
LOSS = ("standard", "fused")
GRAD_ACCUMULATION = ("autograd", "fused")
DISPATCHER = ("auto", "nccl_a2a", "allgather", "symm_mem", "deepep")  # see polyaccel.moe.dispatchers


@dataclasses.dataclass(kw_only=True, slots=True)
class BackendConfig:
    """Kernel and layer choices for a polyaccel MoE model (all default to the fast path).

    Attributes:
        attn: ``"auto"`` (the default: where the hardware backend has its own causal-attention
            kernel, FlashAttention-4 on CUDA when ``polyaccel-backend-cuda[fa4]`` is installed,
            the faster of it and SDPA for each attention shape, timed once per process at the
            first forward of that shape (:mod:`polyaccel.moe.attention_choice`); otherwise, and
            with a padding mask, a KV cache or a sliding window, ``"sdpa"``), ``"sdpa"`` (PyTorch
            picks), ``"flash"`` / ``"cudnn"`` (force that SDPA backend on CUDA; ignored on other
            devices), ``"fa4"`` (FlashAttention-4 wherever plain causal attention applies; needs
            ``flash-attn-4``), ``"te"`` (TransformerEngine attention; needs ``transformer_engine``).
        linear: ``"torch"`` (``nn.Linear``) or ``"te"`` (TransformerEngine ``Linear`` for the
            attention projections; needs ``transformer_engine``).
        rms_norm: ``"torch"`` (eager, bit-compatible with Transformers) or ``"fused"`` (the
            ``polyaccel.core.ops.rms_norm`` op, which backends replace with a fused kernel).
        experts: ``"grouped_mm"`` (tokens sorted by expert, two grouped GEMMs, no host sync) or
            ``"eager"`` (one GEMM pair per expert, a reference).
        gate: ``"learned"`` (the checkpoint's router) or ``"balanced"`` (benchmark gate: every
            expert gets exactly ``T * k / E`` tokens, weights ``1/k``).
        gate_noise: with ``gate="balanced"``, in ``[0, 1]``: how far routing departs from the
            perfectly balanced assignment (deterministic in the input, so recompute under
            activation checkpointing routes identically).
        loss: ``"fused"`` (chunked linear cross-entropy: full-vocabulary fp32 logits never
            exist; ``logits`` is ``None`` in the output when labels are given) or
            ``"standard"`` (logits, then cross-entropy, exactly as Transformers).
        loss_chunk_size: rows of the ``[rows, vocab]`` fp32 logits block the fused loss holds.
        grad_accumulation: ``"fused"`` (expert weight gradients are added into ``.grad`` inside
            the weight-gradient grouped GEMM, :mod:`polyaccel.moe.grouped_linear`, and the token
            embedding's rows into its ``.grad`` in place, :mod:`polyaccel.moe.fused_embedding`;
            applies to single-process jobs with plain parameters only; under DDP, FSDP2 or expert
            parallelism it falls back by itself) or ``"autograd"`` (autograd returns them and adds
            them; needed for ``torch.autograd.grad`` with respect to those weights).
        dispatcher: how token copies reach their experts under expert parallelism (ignored at
            ep=1): ``"auto"`` (``symm_mem`` on CUDA with NVSHMEM, else ``nccl_a2a``),
            ``"nccl_a2a"`` (``all_to_all_single``; any torch.distributed backend),
            ``"allgather"`` (all-gather tokens, reduce-scatter outputs; a baseline),
            ``"symm_mem"`` (NVSHMEM ``all_to_all_vdev_2d``, no host sync; CUDA only),
            ``"deepep"`` (DeepEP / UCCL-EP ``deep_ep.Buffer``; needs ``deep_ep``).
        compile: ``torch.compile`` each decoder layer: ``"auto"`` (the default) does on the
            CUDA backend and not elsewhere (CPU compilation costs more than it saves in
            short runs); ``True`` / ``False`` force it.
        backend: the polyaccel hardware backend (``"auto"``, ``"cpu"``, ``"cuda"``, ...);
            selecting it registers its kernels for the core ops the model calls.
    """

    attn: str = "auto"
    linear: str = "torch"
    rms_norm: str = "torch"
    experts: str = "grouped_mm"
    gate: str = "learned"
    gate_noise: float = 0.0
    loss: str = "fused"
    loss_chunk_size: int = 1024
    grad_accumulation: str = "fused"
    dispatcher: str = "auto"
    compile: bool | str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("attn", ATTN), ("linear", LINEAR), ("rms_norm", RMS_NORM),
                              ("experts", EXPERTS), ("gate", GATE), ("loss", LOSS),
                              ("grad_accumulation", GRAD_ACCUMULATION),
                              ("dispatcher", DISPATCHER)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"BackendConfig.{name}={value!r} is not supported; choose one of "
                                 f"{', '.join(map(repr, allowed))}")
        if not isinstance(self.gate_noise, (int, float)) or not 0.0 <= self.gate_noise <= 1.0:
            raise ValueError(f"BackendConfig.gate_noise={self.gate_noise!r} must be a number in [0, 1]")
        if self.gate_noise and self.gate != "balanced":
            raise ValueError("BackendConfig.gate_noise only applies to gate='balanced'")
        if not isinstance(self.loss_chunk_size, int) or self.loss_chunk_size < 1:
            raise ValueError(f"BackendConfig.loss_chunk_size={self.loss_chunk_size!r} must be a positive int")
        if not isinstance(self.compile, bool) and self.compile != "auto":
            raise ValueError(f"BackendConfig.compile={self.compile!r} must be 'auto', True or False")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"BackendConfig.backend={self.backend!r} must be a backend name such as 'auto'")
        if self.dispatcher == "deepep":
            require_deep_ep()
        if self.attn == "fa4":
            require_flash_attn_4()
        if "te" in (self.attn, self.linear):
            require_transformer_engine(f"BackendConfig(attn={self.attn!r}, linear={self.linear!r})")


def compiles_layers(backend: BackendConfig, hardware: str) -> bool:
    """Whether ``backend`` compiles the decoder layers on the polyaccel hardware backend
    named ``hardware`` (``"cuda"``, ``"cpu"``...): ``compile="auto"`` means on CUDA only."""
    return backend.compile is True or (backend.compile == "auto" and hardware == "cuda")


def require_deep_ep() -> None:
    """Raise ``ImportError`` naming what to install when DeepEP (``deep_ep``) is missing."""
    if importlib.util.find_spec("deep_ep") is None:
        raise ImportError("BackendConfig(dispatcher='deepep') needs DeepEP (module 'deep_ep'), which is not "
                          "installed: build https://github.com/deepseek-ai/DeepEP (NVSHMEM, Hopper GPUs) or "
                          "install UCCL-EP (same deep_ep.Buffer API); or use dispatcher='nccl_a2a'")


def require_flash_attn_4() -> None:
    """Raise ``ImportError`` naming what to install when FlashAttention-4 is missing."""
    try:
        found = importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImportError("BackendConfig(attn='fa4') needs FlashAttention-4 (module 'flash_attn.cute'), which is "
                          "not installed: pip install 'polyaccel-backend-cuda[fa4]' (Hopper or Blackwell GPUs); "
                          "or use attn='auto'")


def require_transformer_engine(what: str) -> None:
    """Raise ``ImportError`` naming what to install when TransformerEngine is missing."""
    if importlib.util.find_spec("transformer_engine") is None:
        raise ImportError(f"{what} needs NVIDIA TransformerEngine, which is not installed: "
                          "pip install 'transformer-engine[pytorch]' (CUDA only), or use "
                          "attn='auto' / linear='torch'")
