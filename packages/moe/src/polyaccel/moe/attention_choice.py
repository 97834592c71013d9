"""``BackendConfig(attn="auto")``: the faster causal-attention kernel for each shape, timed once.

Where the hardware backend registers a flash kernel for core's ``causal_attention`` op (the
CUDA backend does where FlashAttention-4 is installed), neither it nor PyTorch's SDPA wins on
every shape: on an H200 FlashAttention-4 is faster for the GQA shapes of Qwen3-MoE and Mixtral
and slower in the backward for some MHA ones (``tools/bench_attention.py``). So the first
forward with a new attention shape times both, forward + backward on random inputs of that
shape, and keeps the faster for the rest of the process. A kernel that fails there is not used.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from polyaccel.core import ops
from polyaccel.core.kernels import registry

logger = logging.getLogger(__name__)

_CHOSEN: dict[tuple, str] = {}
TIMED_CALLS = 10
"""Forward + backward calls timed per candidate (after two untimed ones: compilation, caches)."""


def flash_registered(device: torch.device) -> bool:
    """Whether a backend registered its own ``causal_attention`` kernel for ``device``'s type."""
    return device.type in registry.implementations("causal_attention")


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """What ``attn="sdpa"`` runs, on the same [B, S, H, D] inputs: core's reference."""
    return ops.causal_attention.reference(q, k, v, scale)


def device_time_ms(run: Callable[[], Any], calls: int) -> float:
    """Milliseconds of CUDA device time per call of ``run()``, ``calls`` calls back to back.

    The device first sleeps long enough for the host to queue every call, so the host's own
    time per call (large for kernels launched from Python, gone once a step is replayed as a
    CUDA graph) is not counted."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int((2 * calls * host_ms + 5) * 2e6))  # cycles: at most ~2 GHz
    start.record()
    for _ in range(calls):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _time_ms(fn, q, k, v, dout, calls: int) -> float:  # noqa: ANN001
    """Milliseconds per forward + backward of ``fn``, after two untimed calls: device time on
    CUDA (:func:`device_time_ms`), wall-clock time elsewhere."""
    def run() -> None:
        torch.autograd.grad(fn(q, k, v, None), (q, k, v), dout)

    for _ in range(2):
        run()
    if q.is_cuda:
        return device_time_ms(run, calls)
    t0 = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - t0) * 1e3 / calls


@torch.compiler.disable
def choose(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, v_dim: int, dtype: torch.dtype,
           device: torch.device) -> str:
    """``"fa4"`` or ``"sdpa"``: the faster for causal attention of this shape, timed on the first
    call per shape (never inside a CUDA graph capture: then ``"sdpa"``, not remembered).
    Sequence lengths share a choice per power-of-two bucket (timed at the first length seen
    in it), so data of varying lengths is not timed again at every new length."""
    key = (batch, 1 << max(seq - 1, 0).bit_length(), heads, kv_heads, head_dim, v_dim, dtype, device)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if not flash_registered(device):
        _CHOSEN[key] = "sdpa"
        return "sdpa"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "sdpa"
    _CHOSEN[key] = choice = _measure((batch, seq, *key[2:]))
    return choice


def _measure(key: tuple) -> str:
    batch, seq, heads, kv_heads, head_dim, v_dim, dtype, device = key
    gen = torch.Generator(device=device).manual_seed(0)
    shape = f"batch {batch}, seq {seq}, {heads}/{kv_heads} heads of {head_dim}/{v_dim}"
    with torch.inference_mode(False), torch.enable_grad(), torch.device(device):  # also under inference_mode
        q = torch.randn(batch, seq, heads, head_dim, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(batch, seq, kv_heads, head_dim, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(batch, seq, kv_heads, v_dim, dtype=dtype, generator=gen).requires_grad_()
        dout = torch.randn(batch, seq, heads, v_dim, dtype=dtype, generator=gen)
        try:
            flash_ms = _time_ms(ops.causal_attention, q, k, v, dout, TIMED_CALLS)
        except Exception as e:  # noqa: BLE001  (a kernel that cannot run this shape is not chosen)
            logger.warning("polyaccel.moe attention (%s): the backend's flash kernel failed (%s: %s); using SDPA",
                           shape, type(e).__name__, str(e)[:300])
            return "sdpa"
        sdpa_ms = _time_ms(sdpa_attention, q, k, v, dout, TIMED_CALLS)
    choice = "fa4" if flash_ms < sdpa_ms else "sdpa"
    logger.warning("polyaccel.moe attention (%s): %s (forward + backward %.3f ms; %s %.3f ms)", shape,
                   "flash-attn-4" if choice == "fa4" else "SDPA", min(flash_ms, sdpa_ms),
                   "SDPA" if choice == "fa4" else "flash-attn-4", max(flash_ms, sdpa_ms))
    return choice


def chosen() -> dict[tuple, str]:
    """The choices made so far in this process (a copy)."""
    return dict(_CHOSEN)
