"""FP8 (e4m3) encoder GEMMs, an opt-in speed/accuracy trade: ``fp8_encoder(model)``.

Each linear layer of the encoder (attention projections and the MLP) keeps its weight in
``float8_e4m3fn`` with one fp32 scale per output row, and quantizes its input per row (per
token) at run time; ``torch._scaled_mm`` multiplies them with fp32 accumulation and writes
the model's dtype. Row-wise scales on both sides keep a single large activation or weight row
from flattening the others' precision. The decoder keeps the cross-attention K/V in e4m3 too
(a scale per frame and head), which halves what each decoder step reads. The conv front end,
LayerNorms, attention itself and the rest of the decoder stay in the model's dtype. bf16 stays the exact default; tokens with FP8
differ from bf16 on some inputs (measured agreement: docs/asr_whisper.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from polyaccel.asr.whisper import WhisperASR, WhisperEncoderLayer
from polyaccel.core import ops
from polyaccel.core.ops import E4M3_MAX

__all__ = ["E4M3_MAX", "Fp8Linear", "Fp8Rows", "Fp8WhisperEncoderLayer", "fp8_encoder", "fp8_supported"]
_ALIGN = 16  # _scaled_mm wants K and N multiples of 16


class Fp8Rows(NamedTuple):
    """An FP8 GEMM's input already in e4m3 (``ops.rows_to_fp8``): values [M, K], scales [M, 1]."""

    values: torch.Tensor
    scale: torch.Tensor


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with W and x in e4m3 (row-wise scales), output in ``x``'s dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if in_features % _ALIGN or out_features % _ALIGN:
            raise ValueError(f"FP8 GEMMs need dimensions that are multiples of {_ALIGN}; "
                             f"this layer is {in_features} -> {out_features}")
        w_fp8, w_scale = ops.rows_to_fp8.reference(linear.weight.detach())
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8", w_fp8)
        self.register_buffer("weight_scale", w_scale.reshape(1, -1))  # [1, N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor | Fp8Rows, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x`` [..., K] -> [..., N] in ``x.dtype`` (each row quantized here), or rows already
        quantized (:class:`Fp8Rows`) -> [M, N] in ``out_dtype`` (default bf16)."""
        if isinstance(x, Fp8Rows):
            (x_fp8, x_scale), lead, dtype = x, x.values.shape[:1], out_dtype or torch.bfloat16
        else:
            (x_fp8, x_scale), lead, dtype = ops.rows_to_fp8(x), x.shape[:-1], out_dtype or x.dtype
        # CUDA's row-wise-scaled kernels write bf16 only; cast after (fp16 / fp32 models)
        mm_dtype = dtype if x_fp8.device.type == "cpu" else torch.bfloat16
        bias = None if self.bias is None else self.bias.to(mm_dtype)
        y = torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                             bias=bias, out_dtype=mm_dtype)
        return y.to(dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


class Fp8WhisperEncoderLayer(WhisperEncoderLayer):
    """A Whisper encoder layer whose linear layers are :class:`Fp8Linear`: each LayerNorm and
    the GELU write e4m3 rows and their scales in one op (``ops.rows_to_fp8``), so q, k and v
    share one quantized input and only the attention output is quantized on its own."""

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        attn, ln1, ln2 = self.self_attn, self.self_attn_layer_norm, self.final_layer_norm
        h = Fp8Rows(*ops.rows_to_fp8(x_BSD, "layer_norm", ln1.weight, ln1.bias, ln1.eps))
        q, k, v = (attn._heads(proj(h, x_BSD.dtype).view(B, S, D)) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        x_BSD = x_BSD + attn.attend(q, k, v)
        h = Fp8Rows(*ops.rows_to_fp8(x_BSD, "layer_norm", ln2.weight, ln2.bias, ln2.eps))
        g = Fp8Rows(*ops.rows_to_fp8(self.fc1(h, x_BSD.dtype), "gelu"))
        return x_BSD + self.fc2(g, x_BSD.dtype).view(B, S, D)


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


def fp8_encoder(model: nn.Module, cross_kv: bool = True) -> int:
    """Swap every ``nn.Linear`` inside ``model.encoder`` for an :class:`Fp8Linear` (weights
    quantized once, in place); returns how many. With ``cross_kv`` the decoder also keeps the
    cross-attention K/V (the encoder output's projections) as e4m3 rows, one scale per frame and
    head (``WhisperASR.fp8_cross_kv``): half the bytes each decoder step reads. Raises
    ``ValueError`` where the device cannot run FP8 GEMMs or a layer's shape does not fit them.
    Call before graphs are captured."""
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
    for layer in model.encoder.layers:
        layer.__class__ = Fp8WhisperEncoderLayer  # the same module and state dict, the FP8 forward
    model.fp8_cross_kv = cross_kv
    return len(targets)
