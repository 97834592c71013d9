"""FP8 (e4m3) encoder GEMMs, an opt-in speed/accuracy trade: ``fp8_encoder(model)``.

Each linear layer of the encoder (attention projections and the MLP) keeps its weight in
``float8_e4m3fn`` with one fp32 scale per output row, and quantizes its input per row (per
token) at run time; ``torch._scaled_mm`` multiplies them with fp32 accumulation and writes
the model's dtype. Row-wise scales on both sides keep a single large activation or weight row
from flattening the others' precision. The conv front end, LayerNorms, attention itself and
the whole decoder stay in the model's dtype. bf16 stays the exact default; tokens with FP8
differ from bf16 on some inputs (measured agreement: docs/asr_whisper.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_ALIGN = 16  # _scaled_mm wants every dimension a multiple of 16


def _rowwise_fp8(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale as e4m3, scale [M, 1] fp32) with each row's amax mapped to the e4m3 maximum."""
    scale = x_MK.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x_MK.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with W and x in e4m3 (row-wise scales), output in ``x``'s dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % _ALIGN or out_features % _ALIGN:
            raise ValueError(f"FP8 GEMMs need dimensions that are multiples of {_ALIGN}; "
                             f"this layer is {in_features} -> {out_features}")
        w_fp8, w_scale = _rowwise_fp8(linear.weight.detach())
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8", w_fp8)
        self.register_buffer("weight_scale", w_scale.reshape(1, -1))  # [1, N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_MK = x.reshape(-1, self.in_features)
        M = x_MK.shape[0]
        pad = -M % _ALIGN
        if pad:
            x_MK = F.pad(x_MK, (0, 0, 0, pad))
        x_fp8, x_scale = _rowwise_fp8(x_MK)
        # CUDA's row-wise-scaled kernels write bf16 only; cast after (fp16 / fp32 models)
        out_dtype = x.dtype if x.device.type == "cpu" else torch.bfloat16
        y = torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                             out_dtype=out_dtype)
        y = (y[:M] if pad else y).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``torch._scaled_mm`` runs e4m3 with row-wise scales on ``device``, why not)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return False, f"FP8 GEMMs need an sm_89+ GPU (Ada, Hopper or newer); this one is sm_{major}{minor}"
    try:
        a = torch.zeros(_ALIGN, _ALIGN, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(_ALIGN, 1, device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        return False, f"torch._scaled_mm with row-wise e4m3 does not run on {device}: {e}"
    return True, ""


def fp8_encoder(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` inside ``model.encoder`` for an :class:`Fp8Linear` (weights
    quantized once, in place); returns how many. Raises ``ValueError`` where the device cannot
    run FP8 GEMMs or a layer's shape does not fit them."""
    from polyaccel.asr.whisper import WhisperASR

    if not isinstance(model, WhisperASR):
        raise ValueError(f"FP8 encoder GEMMs are built for Whisper; {type(model).__name__} reads its "
                         "encoder weights directly")
    ok, why = fp8_supported(next(model.parameters()).device)
    if not ok:
        raise ValueError(why)
    targets = [(parent, name, child) for parent in model.encoder.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, Fp8Linear(child))
    return len(targets)
