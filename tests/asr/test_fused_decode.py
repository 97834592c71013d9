"""Whisper's fused decoder step (``WhisperASR.fused_decode``, on by default on CUDA) computes what the plain
step computes. CPU: through core's reference ops, on tiny random models of odd widths, over
greedy steps to the end of the cache. GPU (``pytest -m gpu tests/asr/test_fused_decode.py``):
through the Triton kernels, the same greedy tokens as the plain step (fp32; batches inside and
past the Triton kernels' 16 rows), captured in CUDA graphs, with far fewer kernels per step.
The kernels themselves are checked in ``tests/cuda/test_fused_decode.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from polyaccel.asr.whisper import WhisperASR, WhisperConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(d_model: int, heads: int, ffn: int, layers: int, seed: int) -> WhisperASR:
    cfg = WhisperConfig(num_mel_bins=16, d_model=d_model, encoder_layers=1, encoder_attention_heads=heads,
                        encoder_ffn_dim=ffn, decoder_layers=layers, decoder_attention_heads=heads,
                        decoder_ffn_dim=ffn, vocab_size=131, max_source_positions=1500, max_target_positions=10,
                        decoder_start_token_id=100, eos_token_id=99, no_timestamps_token_id=None)
    torch.manual_seed(seed)
    model = WhisperASR(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # biases and LayerNorm parameters too: every add counts
    return model.eval()


def _greedy(model: WhisperASR, enc: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy steps from the start token to the end of the cache: (logits [B, T, V], tokens [B, T])."""
    model.fused_decode = fused
    B, C = enc.shape[0], model.max_decode_len
    state = model.new_decoder_state(enc, torch.ones(enc.shape[:2], dtype=torch.bool), C)
    tokens = torch.full((B,), model.config.decoder_start_token_id)
    logits, chosen = [], []
    for t in range(C):
        step = model.decode_step(tokens, torch.full((B,), t), state)
        tokens = step.argmax(-1)
        logits.append(step)
        chosen.append(tokens)
    return torch.stack(logits, 1), torch.stack(chosen, 1)


@pytest.mark.parametrize("d_model,heads,ffn,layers,batch", [(36, 3, 88, 2, 3), (40, 5, 72, 1, 1), (24, 2, 48, 3, 2)])
@torch.inference_mode()
def test_fused_step_computes_the_plain_step(d_model, heads, ffn, layers, batch):
    model = _tiny(d_model, heads, ffn, layers, seed=d_model + batch)
    enc = torch.randn(batch, 50, d_model, generator=torch.Generator().manual_seed(layers))
    plain_logits, plain_tokens = _greedy(model, enc, fused=False)
    fused_logits, fused_tokens = _greedy(model, enc, fused=True)
    torch.testing.assert_close(fused_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_tokens, plain_tokens)


def _fused_calls(model: WhisperASR) -> list[int]:
    """Counts the decoder's fused steps (layer 0) from now on."""
    calls, layer = [], model.decoder.layers[0]
    plain = layer.fused_step
    layer.fused_step = lambda *a, **k: (calls.append(1), plain(*a, **k))[1]
    return calls


def test_fused_decode_is_automatic_and_not_combined_with_batch_invariance():
    """Default (None): the fused step on CUDA only (the GPU test below checks that side), so
    off on the CPU and with batch_invariant; True with batch_invariant is refused."""
    model = _tiny(24, 2, 48, 1, seed=0)
    assert model.fused_decode is None
    calls = _fused_calls(model)
    state = model.new_decoder_state(torch.randn(1, 8, 24), torch.ones(1, 8, dtype=torch.bool), 10)
    step = (torch.tensor([100]), torch.tensor([0]), state)
    model.decode_step(*step)
    assert not calls, "the CPU default took the fused step"
    model.fused_decode = True
    model.decode_step(*step)
    assert calls == [1]
    model.batch_invariant = True
    with pytest.raises(ValueError, match="fused_decode and batch_invariant"):
        model.decode_step(*step)
    model.fused_decode = None
    model.decode_step(*step)
    assert calls == [1], "batch_invariant took the fused step"


# ---- on the GPU ------------------------------------------------------------------------------

def _cuda_whisper(dtype: torch.dtype) -> WhisperASR:
    cfg = WhisperConfig(num_mel_bins=80, d_model=256, encoder_layers=2, encoder_attention_heads=4,
                        encoder_ffn_dim=512, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=512,
                        vocab_size=512, decoder_start_token_id=500, eos_token_id=501, no_timestamps_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WhisperASR(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.decode_text = lambda ids: " ".join(map(str, ids))
    return model.to(dtype).eval().requires_grad_(False)


def _audio(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n)
    return [(0.3 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in rng.uniform(1, 29, n)]


def _tokens(model: WhisperASR, audio: list[np.ndarray], fused: bool, graphs: bool, buckets=(1, 2, 4, 8, 32)):
    from polyaccel.asr.runner import ASRRunner

    model.fused_decode = fused
    try:
        runner = ASRRunner(model, backend="cuda", batch_buckets=buckets, max_new_tokens=20, use_graphs=graphs)
        return [h.tokens for h in runner.recognize(audio)]
    finally:
        model.fused_decode = None


@pytest.mark.gpu
def test_fused_step_on_cuda_gives_the_plain_tokens_in_cuda_graphs():
    """fp32 (where the two paths round alike): the fused step captured in CUDA graphs gives
    the plain eager step's tokens at batch 1, 2, 5 (Triton kernels) and 20 (cuBLAS)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from polyaccel.core import select_backend

    select_backend("cuda")  # registers the kernels
    model = _cuda_whisper(torch.float32)
    calls = _fused_calls(model)
    _tokens(model, _audio(1), fused=None, graphs=False)
    assert calls, "the default did not take the fused step on CUDA"
    for b in (1, 2, 5, 20):
        audio = _audio(b)
        want = _tokens(model, audio, fused=False, graphs=False, buckets=(b,))
        assert _tokens(model, audio, fused=True, graphs=True) == want, b


@pytest.mark.gpu
def test_bf16_fused_step_captures_and_launches_fewer_kernels():
    """bf16: the fused step replayed from a CUDA graph gives its eager tokens; in a process of
    its own (count_decode_kernels.py: the profiler must not touch later captures here), its
    logits stay close to the plain step's and one step at batch 1 launches far fewer kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from polyaccel.core import select_backend

    select_backend("cuda")
    model = _cuda_whisper(torch.bfloat16)
    audio = _audio(3)
    assert _tokens(model, audio, fused=True, graphs=True) == _tokens(model, audio, fused=True, graphs=False,
                                                                      buckets=(3,))
    script = Path(__file__).with_name("count_decode_kernels.py")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    counts = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"CUDA kernels per decode_step (2 layers, batch 1): {counts}")
    assert counts["logits_close"], counts
    assert counts["fused"] < counts["plain"] * 0.6, counts


@pytest.mark.gpu
def test_dependent_launch_gives_the_same_tokens(monkeypatch):
    """With programmatic dependent launch on (each kernel starts beside the one before and
    waits for it before touching memory), the fused step in CUDA graphs gives exactly the
    tokens it gives without, at several batch sizes (bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from polyaccel.core import select_backend
    from polyaccel.cuda import _triton

    select_backend("cuda")
    model = _cuda_whisper(torch.bfloat16)
    audios = {b: _audio(b) for b in (1, 2, 5)}
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", False)
    want = {b: _tokens(model, a, fused=True, graphs=True) for b, a in audios.items()}
    monkeypatch.setattr(_triton, "DEPENDENT_LAUNCH", True)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert _triton.dependent_launch(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    for b, audio in audios.items():
        assert _tokens(model, audio, fused=True, graphs=True) == want[b], b
