"""FP8 encoder GEMMs (``polyaccel.asr.fp8``): e4m3 with row-wise scales against the bf16/fp32
linear they replace, the encoder swap, what it refuses, and token agreement on real speech."""

from __future__ import annotations

import glob

import pytest
import torch
from torch import nn

from polyaccel.asr import fp8
from polyaccel.asr.whisper import WhisperASR, WhisperConfig, WhisperEncoderLayer

needs_cpu_fp8 = pytest.mark.skipif(not fp8.fp8_supported("cpu")[0], reason="torch._scaled_mm e4m3 not on this CPU build")


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_cpu_fp8
@pytest.mark.parametrize("rows", [1500, 32, 7])  # 1500 and 7: not multiples of 16 (padded)
def test_fp8_linear_matches_the_linear_it_replaces(rows):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(48, generator=gen))
    x = torch.randn(2, rows, 64, generator=gen).to(torch.bfloat16)
    want = nn.functional.linear(x.float(), linear.weight, linear.bias)
    got = fp8.Fp8Linear(linear)(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
    assert _rel_err(got, want) < 0.06  # e4m3 keeps 3 mantissa bits: a few percent per product


@needs_cpu_fp8
def test_row_wise_scales_keep_small_rows_precise():
    """One token 1e5 times louder than the rest (e4m3 spans ~2^-9..448): with a scale per row the other rows keep their
    precision (with one scale for the whole tensor they would be flushed towards zero)."""
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(32, 32, bias=False)
    x = torch.randn(16, 32, generator=gen)
    x[3] *= 1e5
    got = fp8.Fp8Linear(linear)(x)
    want = linear(x)
    quiet = [i for i in range(16) if i != 3]
    assert _rel_err(got[quiet], want[quiet]) < 0.06
    # the control: one per-tensor scale loses the quiet rows
    scale = x.abs().amax() / fp8.E4M3_MAX
    coarse = ((x / scale).to(torch.float8_e4m3fn).float() * scale) @ linear.weight.t()
    assert _rel_err(coarse[quiet], want[quiet].detach()) > 0.2


def _small_whisper() -> WhisperASR:
    cfg = WhisperConfig(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=100,
                        max_source_positions=1500, max_target_positions=20, decoder_start_token_id=97,
                        eos_token_id=98, no_timestamps_token_id=None)
    torch.manual_seed(0)
    return WhisperASR(cfg).eval().requires_grad_(False)


@needs_cpu_fp8
def test_fp8_encoder_swaps_the_encoder_linears_only_and_stays_close():
    model = _small_whisper()
    feats = torch.randn(2, 16, 3000)
    lengths = torch.full((2,), 3000)
    want, _ = model.encode(feats, lengths)
    assert fp8.fp8_encoder(model) == 2 * 6  # q, k, v, out, fc1, fc2 per encoder layer
    assert not any(isinstance(m, nn.Linear) for m in model.encoder.modules())
    assert sum(isinstance(m, nn.Linear) for m in model.decoder.modules()) == 2 * 10  # untouched
    got, _ = model.encode(feats, lengths)
    assert _rel_err(got, want) < 0.05


@needs_cpu_fp8
def test_fp8_encoder_layers_quantize_in_the_norms_and_the_gelu(monkeypatch):
    """Each FP8 encoder layer quantizes four times: both LayerNorms and the GELU write e4m3
    rows themselves (q, k and v share the first), only the attention output is quantized on
    its own (each linear quantizing its own input would be six times, no prologue)."""
    from polyaccel.core import ops

    model = _small_whisper()
    fp8.fp8_encoder(model)
    seen, real = [], ops.rows_to_fp8
    monkeypatch.setattr(ops, "rows_to_fp8", lambda x, prologue="none", *a, **k: seen.append(prologue) or real(x, prologue, *a, **k))
    model.encoder.layers[0](torch.randn(2, 9, 32))
    assert seen == ["layer_norm", "none", "layer_norm", "gelu"]


def _decode(model: WhisperASR, enc: torch.Tensor, steps: int = 5, state=None) -> list[torch.Tensor]:
    """Logits of ``steps`` decoder steps from ``enc`` (a fresh state unless given), fed the
    same tokens whatever the logits."""
    B = enc.shape[0]
    state = state or model.new_decoder_state(enc, torch.ones(B, enc.shape[1], dtype=torch.bool), 8)
    tokens = torch.randint(0, 97, (steps, B), generator=torch.Generator().manual_seed(steps))
    return [model.decode_step(tokens[t], torch.full((B,), t), state) for t in range(steps)]


@needs_cpu_fp8
@pytest.mark.parametrize("fused", [False, True])  # the plain step; the fused step's ops (reference on CPU)
def test_fp8_cross_kv_is_e4m3_rows_and_decodes_like_their_dequantized_values(fused):
    """``fp8_encoder`` keeps the cross-attention K/V as e4m3 rows with a scale per (layer, row,
    head, frame), and a decoder step reads exactly what they stand for: the same logits as a
    bf16-free state holding ``values * scale``; close to the unquantized K/V's logits."""
    from polyaccel.asr.interface import DecoderState

    model = _small_whisper()
    model.fused_decode = fused
    enc = torch.randn(3, 1500, 32) * torch.linspace(0.1, 10, 1500)[:, None]  # loud and quiet frames
    mask = torch.ones(3, 1500, dtype=torch.bool)
    plain = _decode(model, enc)
    fp8.fp8_encoder(model)
    state = model.new_decoder_state(enc, mask, 8)
    assert state.cross_k.dtype == state.cross_v.dtype == torch.float8_e4m3fn
    assert state.cross_scale.shape == (2, 2, 3, 4, 1500) and state.self_k.dtype == torch.float32
    assert len(state.tensors()) == 6  # graph inputs: the scales travel with the state
    k = state.cross_k.float() * state.cross_scale[0, ..., None]
    v = state.cross_v.float() * state.cross_scale[1, ..., None]
    ref = DecoderState.start(k, v, mask, 8)
    got, want = _decode(model, enc, state=state), _decode(model, enc, state=ref)
    for g, w, p in zip(got, want, plain, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert _rel_err(g, p) < 0.15  # e4m3: 3 mantissa bits per key and value element
    # the control: scales off by 1% move the logits past that tolerance
    state.cross_scale[1] *= 1.01
    off = _decode(model, enc, state=state)
    assert max(float((o - w).abs().max()) for o, w in zip(off, want)) > 1e-3


@needs_cpu_fp8
def test_fp8_cross_kv_off_and_states_that_do_not_fit():
    model = _small_whisper()
    fp8.fp8_encoder(model, cross_kv=False)
    enc, mask = torch.randn(2, 1500, 32), torch.ones(2, 1500, dtype=torch.bool)
    state = model.new_decoder_state(enc, mask, 8)
    assert state.cross_k.dtype == torch.float32 and state.cross_scale is None
    bytes_bf16 = model.decode_state_bytes(4)
    model.fp8_cross_kv = True
    assert model.decode_state_bytes(4) < 0.65 * bytes_bf16  # the cross K/V are most of the state
    with pytest.raises(ValueError, match="cross_scale"):  # a captured graph's state made for bf16 K/V
        model.new_decoder_state(enc, mask, 8, out=state)
    fp8_state = model.new_decoder_state(enc, mask, 8)
    model.fp8_cross_kv = False
    with pytest.raises(ValueError, match="cross_scale"):
        model.new_decoder_state(enc, mask, 8, out=fp8_state)
    # a state written into keeps its memory and equals a fresh one
    model.fp8_cross_kv = True
    enc2 = torch.randn(2, 1500, 32)
    again = model.new_decoder_state(enc2, mask, 8, out=fp8_state)
    fresh = model.new_decoder_state(enc2, mask, 8)
    assert again is fp8_state and all(torch.equal(a.float(), b.float()) for a, b in zip(again.tensors(), fresh.tensors()))


@needs_cpu_fp8
def test_fp8_encoder_refuses_what_it_cannot_run():
    from polyaccel.asr import conformer_config
    from polyaccel.asr.conformer import ConformerAED

    with pytest.raises(ValueError, match="Whisper"):
        fp8.fp8_encoder(ConformerAED(conformer_config.tiny()))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.Fp8Linear(nn.Linear(40, 24))


@needs_cpu_fp8
@pytest.mark.slow
def test_tiny_en_fp8_encoder_on_real_speech():
    """Real weights and speech: FP8 encoder tokens agree with bf16's on most clips and the WER
    stays in the same range (measured agreement over a larger corpus: docs/asr_whisper.md)."""
    import soundfile as sf

    from polyaccel.asr import samples, weights
    from polyaccel.asr.runner import ASRRunner

    folder = samples.librivox_dir()
    if folder is None:
        pytest.skip(samples.INSTALL_HINT)
    try:
        path = weights.resolve_model("whisper-tiny.en")
    except (ImportError, FileNotFoundError, ValueError) as e:
        pytest.skip(str(e))
    audio = [sf.read(f, dtype="float32")[0] for f in sorted(glob.glob(f"{folder}/*.wav"))]
    model = WhisperASR.from_pretrained(path, dtype=torch.bfloat16)
    # one batch of exactly the five clips: padding rows would cost a bf16 encoder pass each
    # (seconds apiece on CPUs without bf16 instructions) and compare nothing
    bf16 = ASRRunner(model, backend="cpu", batch_buckets=(5,)).recognize(audio)
    fp8.fp8_encoder(model)
    got = ASRRunner(model, backend="cpu", batch_buckets=(5,)).recognize(audio)
    from polyaccel.asr.text import wer

    assert sum(a.tokens == b.tokens for a, b in zip(bf16, got, strict=True)) >= 3
    assert min(len(h.tokens) for h in got) > 5  # real transcripts
    assert wer([h.text for h in bf16], [h.text for h in got]) < 0.1  # a word or two of 71 differ


@needs_cpu_fp8
@pytest.mark.slow
def test_cli_fp8_encoder_says_so_in_each_record(tmp_path):
    """``transcribe --fp8-encoder``: every record carries ``"encoder_gemms": "fp8"`` (its tokens
    are not bf16's), records without the flag carry nothing; ``--ray`` with it is refused."""
    import json

    from polyaccel.asr import cli, samples

    folder = samples.librivox_dir()
    if folder is None:
        pytest.skip(samples.INSTALL_HINT)
    wav = str(sorted(folder.glob("*.wav"))[1])  # 3 s
    for flag, want in ((["--fp8-encoder"], "fp8"), ([], None)):
        out = tmp_path / f"out{len(flag)}.jsonl"
        rc = cli.main(["transcribe", wav, "-o", str(out), "--dtype", "bfloat16", "-q", *flag])
        (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
        assert rc == 0 and rec["error"] is None and rec["text"]
        assert rec.get("encoder_gemms") == want
    assert cli.main(["transcribe", wav, "-o", str(tmp_path / "r.jsonl"), "--fp8-encoder", "--ray"]) == 2


def _turbo_layers():
    """A large-v3-turbo-sized encoder layer in bf16, its FP8 twin, 64 x 1500 rows of input."""
    if not torch.cuda.is_available() or not fp8.fp8_supported("cuda")[0]:
        pytest.skip("needs an FP8-capable GPU")
    import copy

    from polyaccel.core import select_backend

    select_backend("cuda")  # registers the kernels
    torch.manual_seed(0)
    cfg = WhisperConfig(d_model=1280, encoder_attention_heads=20, encoder_ffn_dim=5120)
    with torch.device("cuda"):
        layer = WhisperEncoderLayer(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    twin = copy.deepcopy(layer)
    for child in list(twin.modules()):
        for attr, linear in list(child.named_children()):
            if isinstance(linear, nn.Linear):
                setattr(child, attr, fp8.Fp8Linear(linear))
    twin.__class__ = fp8.Fp8WhisperEncoderLayer
    return layer, twin, torch.randn(64, 1500, 1280, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1500, 7])  # not multiples of 16
def test_fp8_linear_on_cuda_matches_the_bf16_linear(rows):
    layer, twin, x = _turbo_layers()
    x = x[:, :rows]
    assert _rel_err(twin.fc1(x), layer.fc1(x)) < 0.06
    assert twin.fc1(x.half()).dtype == torch.float16  # CUDA writes bf16; cast back for fp16 models


@pytest.mark.gpu
def test_fp8_encoder_layer_on_cuda_stays_close_and_is_faster_than_bf16():
    """The whole layer (each LayerNorm and the GELU writing e4m3 in one pass): close to bf16's
    output, and faster, or the FP8 GEMMs would not pay for quantizing their inputs."""
    layer, twin, x = _turbo_layers()

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    with torch.inference_mode():
        assert _rel_err(twin(x) - x, layer(x) - x) < 0.06  # the layer's update, not the residual it carries
        bf16_ms, fp8_ms = timed(lambda: layer(x)), timed(lambda: twin(x))
    print(f"encoder layer, 64 x 1500 rows: bf16 {bf16_ms / 10:.3f} ms, fp8 {fp8_ms / 10:.3f} ms")
    assert fp8_ms < bf16_ms, (fp8_ms, bf16_ms)
