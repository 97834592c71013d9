"""Batch invariance: a row's bits do not depend on the batch it runs in.

CPU: the invariant forms (:mod:`polyaccel.asr.batch_invariant`, forced on with ``applies``)
compute the same function as the plain ops, and Whisper (``batch_invariant = True``) computes
the same logits with them. GPU (bf16, random weights at Whisper base and large-v3-turbo
widths): with ``batch_invariant`` every row of the encoder output, of six decoder steps'
logits and of the greedy bookkeeping (timestamp rules included) is bitwise the same at batch
1, 2, 3, ... 128 as at 128, and run to run. The same checks over the plain kernels are printed
beside them (the negative control: on an H200 they differ at most batch sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from polyaccel.asr import batch_invariant as bi
from polyaccel.asr.decoding import GreedyBuffers, TimestampRules, greedy_update
from polyaccel.asr.whisper import WhisperASR, WhisperConfig


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(bi, "applies", lambda t: True)


@pytest.mark.parametrize("rows", [1, 3, 128, 129, 300])
def test_fixed_rows_linear_is_linear(forced, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 24, generator=g)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    got = bi.fixed_rows_linear(x, w, b)
    assert got.shape == (rows, 1, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.fixed_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stride,frames", [(1, 3000), (2, 3000), (2, 7), (1, 1)])
def test_conv1d_as_gemm_is_conv1d(forced, stride, frames):
    g = torch.Generator().manual_seed(frames)
    x = torch.randn(2, 6, frames, generator=g)
    w, b = torch.randn(5, 6, 3, generator=g), torch.randn(5, generator=g)
    got = bi.conv1d_as_gemm(x.transpose(1, 2), w, b, stride=stride)
    want = F.conv1d(x, w, b, stride=stride, padding=1).transpose(1, 2)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _model(cfg: WhisperConfig, device: str, dtype: torch.dtype, seed: int = 0) -> WhisperASR:
    torch.manual_seed(seed)
    m = WhisperASR(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
    return m.to(device, dtype).eval()


TINY = WhisperConfig(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=120,
                     max_source_positions=1500, max_target_positions=24, decoder_start_token_id=100,
                     eos_token_id=99, no_timestamps_token_id=None)


def _decode(m: WhisperASR, enc: torch.Tensor, steps: int = 6) -> torch.Tensor:
    """``steps`` greedy decoder steps from the start token: logits [B, steps, V]."""
    B = enc.shape[0]
    state = m.new_decoder_state(enc, torch.ones(enc.shape[:2], dtype=torch.bool, device=enc.device), 24)
    tok = torch.full((B,), m.config.decoder_start_token_id, device=enc.device)
    out = []
    for t in range(steps):
        logits = m.decode_step(tok, torch.full((B,), t, device=enc.device), state)
        out.append(logits)
        tok = logits.argmax(-1)
    return torch.stack(out, 1)


@torch.inference_mode()
def test_whisper_with_invariant_forms_computes_the_same(monkeypatch):
    m = _model(TINY, "cpu", torch.float32)
    feats = torch.randn(3, 16, 3000, generator=torch.Generator().manual_seed(1))
    enc = m.encode(feats, torch.full((3,), 3000))[0]
    logits = _decode(m, enc)
    monkeypatch.setattr(bi, "applies", lambda t: True)
    m.batch_invariant = True
    enc2 = m.encode(feats, torch.full((3,), 3000))[0]
    torch.testing.assert_close(enc2, enc, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_decode(m, enc2), logits, rtol=1e-4, atol=1e-4)


# ---- on the GPU ------------------------------------------------------------------------------

BATCHES = (1, 2, 3, 4, 5, 8, 16, 31, 32, 64, 100, 128)
WIDTHS = {
    "base": dict(num_mel_bins=80, d_model=512, encoder_layers=2, encoder_attention_heads=8, encoder_ffn_dim=2048,
                 decoder_layers=2, decoder_attention_heads=8, decoder_ffn_dim=2048, vocab_size=51865),
    "turbo": dict(num_mel_bins=128, d_model=1280, encoder_layers=2, encoder_attention_heads=20,
                  encoder_ffn_dim=5120, decoder_layers=2, decoder_attention_heads=20, decoder_ffn_dim=5120,
                  vocab_size=51866),
}


def _rows_differing(fn, full: torch.Tensor) -> dict[int, int]:
    """Rows of ``fn(full[:b])`` that are not bitwise ``fn(full)[:b]``, per batch size b."""
    ref = fn(full)
    out = {}
    for b in BATCHES:
        got = fn(full[:b].contiguous())
        out[b] = int((got != ref[:b]).reshape(b, -1).any(1).sum())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("width", sorted(WIDTHS))
@torch.inference_mode()
def test_bf16_rows_bitwise_equal_at_every_batch_size(width):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = WhisperConfig(**WIDTHS[width], max_target_positions=448, decoder_start_token_id=50257,
                        eos_token_id=50256, no_timestamps_token_id=50362)
    m = _model(cfg, "cuda", torch.bfloat16)
    audio = [np.random.default_rng(i).standard_normal(16000 * (5 + i % 25)).astype(np.float32) * 0.1
             for i in range(128)]
    feats, lens = m.compute_features(audio)
    enc = m.encode(feats, lens)[0]

    def encoder(f: torch.Tensor) -> torch.Tensor:
        return m.encode(f, lens[:f.shape[0]])[0]

    checks = {"encoder": (encoder, feats), "decoder": (lambda e: _decode(m, e), enc)}
    plain = {name: _rows_differing(fn, x) for name, (fn, x) in checks.items()}  # the negative control
    m.batch_invariant = True
    got = {name: _rows_differing(fn, x) for name, (fn, x) in checks.items()}
    print(f"{width}: rows differing from batch 128, plain ops {plain}; invariant forms {got}")
    assert got == {name: dict.fromkeys(BATCHES, 0) for name in checks}


@pytest.mark.gpu
@torch.inference_mode()
def test_greedy_update_with_timestamp_rules_bitwise_equal_at_every_batch_size():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    V, T = 51865, 16
    rules = TimestampRules(begin=50364, no_timestamps=50363, eos=50256, max_initial_index=50)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(128, V, device="cuda", generator=g) * 4
    history = torch.randint(0, V, (128, T), device="cuda", generator=g)

    def run(rows: torch.Tensor) -> torch.Tensor:
        B = rows.shape[0]
        buf = GreedyBuffers.allocate(B, T, "cuda")
        buf.reset(B, 50256)
        buf.out.copy_(history[:B])
        buf.step.fill_(5)
        greedy_update(rows, torch.zeros(V, device="cuda"), buf, 50256, rules)
        return torch.cat([buf.out.float(), buf.logprob_sum[:, None]], 1)

    assert _rows_differing(run, logits) == dict.fromkeys(BATCHES, 0)
