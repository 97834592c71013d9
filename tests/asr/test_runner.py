"""The static-cache decoder step and the runner on a small random Whisper: cached decoding
equals full recomputation, rows never influence each other, the runner's greedy equals a
naive greedy over the teacher-forced forward, and the graphs compile per bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyaccel.asr.decoding import LogitsRules, greedy_decode
from polyaccel.asr.runner import ASRRunner
from polyaccel.asr.whisper import WhisperASR, WhisperConfig
from polyaccel.core import GraphCache, select_backend

START, EOS, NO_TS, VOCAB = 90, 91, 92, 96


pytestmark = pytest.mark.usefixtures("one_thread")


def small_config(**kw) -> WhisperConfig:
    base = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, vocab_size=VOCAB,
                max_source_positions=1500, max_target_positions=20, decoder_start_token_id=START,
                eos_token_id=EOS, no_timestamps_token_id=NO_TS, suppress_tokens=(NO_TS, 93, 94),
                begin_suppress_tokens=(EOS, 0))
    return WhisperConfig(**{**base, **kw})


class TextFreeWhisper(WhisperASR):
    """A random Whisper without a tokenizer: text is the ids, space-separated."""

    def decode_text(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def model() -> TextFreeWhisper:
    torch.manual_seed(0)
    m = TextFreeWhisper(small_config()).eval().requires_grad_(False)
    with torch.no_grad():  # larger decoder weights: varied, well-separated greedy choices
        for mod in m.decoder.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0, 2.0 / mod.in_features ** 0.5)
        m.decoder.embed_tokens.weight.normal_(0, 0.3)
        m.decoder.embed_positions.weight.normal_(0, 0.3)
        m.encoder.embed_positions.weight.normal_(0, 0.5)
        # EOS wins wherever token 64 would: some sequences end, others run to the limit
        m.decoder.embed_tokens.weight[EOS] = 1.05 * m.decoder.embed_tokens.weight[64]
    return m


def _random_audio(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [(0.2 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in rng.uniform(0.5, 8.0, n)]


def test_cached_step_equals_full_recompute(model):
    torch.manual_seed(1)
    B, T = 3, 9
    feats = torch.randn(B, 16, 3000)
    ids = torch.randint(0, VOCAB, (B, T))
    with torch.inference_mode():
        full = model(feats, ids)  # [B, T, V]
        enc, mask = model.encode(feats, torch.full((B,), 3000))
        state = model.new_decoder_state(enc, mask, model.max_decode_len)
        steps = torch.stack([model.decode_step(ids[:, t], torch.full((B,), t), state) for t in range(T)], 1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    # the cache was written at positions 0..T-1 only, and holds the keys: layer 0's are
    # k_proj(LN(embed(token) + embed(position))), computed here without the cache
    assert state.self_k[:, :, :, T:].abs().max() == 0
    assert (state.self_k[:, :, :, :T].abs().sum(-1) > 0).all()
    dec, layer0 = model.decoder, model.decoder.layers[0]
    with torch.inference_mode():
        x = dec.embed_tokens(ids) + dec.embed_positions(torch.arange(T))
        k0, _ = layer0.self_attn.key_value(layer0.self_attn_layer_norm(x))
    torch.testing.assert_close(state.self_k[0, :, :, :T], k0, rtol=1e-5, atol=1e-5)


def test_rows_at_different_positions_are_independent(model):
    """Each row attends only to its own cache up to its own position."""
    torch.manual_seed(2)
    B, T = 4, 6
    feats = torch.randn(B, 16, 3000)
    ids = torch.randint(0, VOCAB, (B, T))
    with torch.inference_mode():
        enc, mask = model.encode(feats, torch.full((B,), 3000))
        full = model(feats, ids)
        state = model.new_decoder_state(enc, mask, model.max_decode_len)
        # row b feeds its tokens staggered: row b starts b steps late (positions differ per row)
        got = torch.zeros(B, T, VOCAB)
        for s in range(T + B):
            pos = torch.clamp(torch.arange(B) * -1 + s, 0, T - 1)
            tok = ids[torch.arange(B), pos]
            active = (torch.arange(B) <= s) & (s - torch.arange(B) < T)
            logits = model.decode_step(tok, pos, state)
            got[active, pos[active]] = logits[active]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def _naive_greedy(model, audio, max_new):
    """Greedy by full recomputation over the growing sequence, one utterance at a time."""
    out = []
    rules = LogitsRules(model.suppress_ids(), model.begin_suppress_ids())
    for a in audio:
        feats, _ = model.compute_features([a])
        enc = model.encoder(feats)
        ids = torch.tensor([model.prompt_ids()])
        gen = []
        for t in range(max_new):
            logits = rules.apply(model.decoder_logits(enc, ids)[:, -1], first_step=(t == 0))
            nxt = int(logits.argmax(-1))
            if nxt == EOS:
                break
            gen.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        out.append(gen)
    return out


def test_runner_equals_naive_greedy_at_every_batch_size(model):
    audio = _random_audio(np.random.default_rng(3), 5)
    runner = ASRRunner(model, backend="cpu", batch_buckets=(1, 2, 4, 8), check_every=3)
    assert runner.max_new_tokens == 20 - 2
    with torch.inference_mode():
        ref = _naive_greedy(model, audio, runner.max_new_tokens)
    assert any(len(r) < runner.max_new_tokens for r in ref), "no sequence ended: the test lost its edge"
    assert all(r and r[0] not in (EOS, 0) for r in ref)  # begin-suppress applied at the first step
    assert not any(t in (93, 94) for r in ref for t in r)
    for batch in (1, 2, 3, 5):
        hyps = []
        for i in range(0, 5, batch):
            hyps += runner.recognize(audio[i:i + batch])
        assert [h.tokens for h in hyps] == ref, f"batch {batch}"
        assert [h.text for h in hyps] == [" ".join(map(str, r)) for r in ref]
    eager = ASRRunner(model, backend="cpu", batch_buckets=(8,), use_graphs=False).recognize(audio)
    assert [h.tokens for h in eager] == ref
    short = ASRRunner(model, backend=select_backend("cpu"), batch_buckets=(8,), max_new_tokens=3).recognize(audio)
    assert [h.tokens for h in short] == [r[:3] for r in ref]


class _RefusingBackend(type(select_backend("cpu"))):
    """The CPU reference, except that "capturing" the fused greedy step fails as a CUDA capture
    of a non-capturable op does; counts the graphs it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.compiled: list[str] = []

    def compile_graph(self, fn, example_inputs, *, name="graph"):
        if name.startswith("greedy_step"):
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")
        self.compiled.append(name)
        return super().compile_graph(fn, example_inputs, name=name)


def test_a_refused_capture_decodes_eagerly_not_fails(model, caplog):
    """The H200 run of ``transcribe --timestamps``: one refused capture left the bucket's decode
    graph bound to buffers the next batch re-allocated, so every later batch failed with
    "compiled over other input tensors". Now the bucket falls back to eager decoding (logged
    once) with the same tokens, batch after batch."""
    backend = _RefusingBackend()
    warnings = _three_batches_as_eager(model, backend, caplog, seed=4)
    assert sum("decoding batch bucket" in m for m in warnings) == 1
    assert backend.compiled.count("decode_step{'batch': 4}") == 1


def _three_batches_as_eager(model, backend, caplog, seed: int) -> list[str]:
    """Three batches through ``backend``'s graphs give the eager runner's tokens each time;
    returns the runner's warnings."""
    import logging

    audio = _random_audio(np.random.default_rng(seed), 3)
    want = [h.tokens for h in ASRRunner(model, backend="cpu", batch_buckets=(4,), use_graphs=False).recognize(audio)]
    runner = ASRRunner(model, backend=backend, batch_buckets=(4,))
    caplog.set_level(logging.WARNING, logger="polyaccel.asr.runner")
    for _ in range(3):
        assert [h.tokens for h in runner.recognize(audio)] == want
    return [r.getMessage() for r in caplog.records if r.name == "polyaccel.asr.runner"]


class _RefusingEncodeBackend(_RefusingBackend):
    """The CPU reference, except that "capturing" the encoder fails."""

    def compile_graph(self, fn, example_inputs, *, name="graph"):
        if name.startswith("encode"):
            self.compiled.append("refused " + name)
            raise RuntimeError("operation not permitted when stream is capturing")
        self.compiled.append(name)
        return super(_RefusingBackend, self).compile_graph(fn, example_inputs, name=name)


def test_a_refused_encoder_capture_encodes_eagerly_not_fails(model, caplog):
    """A capture of the encoder that the backend refuses (an op a CUDA graph cannot hold) used
    to fail every batch of that bucket; the bucket now encodes eagerly, with the same tokens,
    logged and tried once, and its decoder still runs from graphs."""
    backend = _RefusingEncodeBackend()
    warnings = _three_batches_as_eager(model, backend, caplog, seed=5)
    assert sum("encoding bucket" in m for m in warnings) == 1
    assert backend.compiled.count("refused encode{'batch': 4}") == 1
    assert "greedy_step{'batch': 4}" in backend.compiled


def test_padding_rows_do_not_change_real_rows(model):
    """Garbage in padding rows of a bucket leaves the real rows' tokens unchanged."""
    torch.manual_seed(4)
    feats = torch.randn(2, 16, 3000)
    with torch.inference_mode():
        enc, mask = model.encode(feats, torch.full((2,), 3000))
        results = []
        for pad_value in (0.0, 1e3):
            padded = torch.cat([enc, torch.full((6, *enc.shape[1:]), pad_value)])
            state = model.new_decoder_state(padded, torch.ones(8, enc.shape[1], dtype=torch.bool), 20)
            hyps = greedy_decode(lambda t, p, s=state: model.decode_step(t, p, s), batch=8, num_real=2,
                                 prompt=model.prompt_ids(), eos_id=EOS, max_new_tokens=18,
                                 rules=LogitsRules(model.suppress_ids(), model.begin_suppress_ids()),
                                 device="cpu")
            results.append([h.tokens for h in hyps])
    assert results[0] == results[1]


def test_graph_specs_compile_per_bucket(model):
    specs = {s.name: s for s in model.graph_specs((1, 4))}
    assert set(specs) == {"encode", "decode_step"}
    assert specs["encode"].buckets.sizes == {"batch": (1, 4)}
    cache = GraphCache(select_backend("cpu"), list(specs.values()))
    assert cache.warmup() == 4
    with torch.inference_mode():
        feats, lengths = specs["encode"].example_inputs({"batch": 4})
        assert feats.shape == (4, 16, 3000)
        enc, mask = cache("encode", {"batch": 4}, feats, lengths)
        assert enc.shape == (4, 1500, 32) and mask.all()
        ex = specs["decode_step"].example_inputs({"batch": 4})
        assert ex[2].shape == (2, 4, 4, 20, 8) and ex[4].shape == (2, 4, 4, 1500, 8)
        logits = cache("decode_step", {"batch": 4}, *ex)
        assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
        assert ex[2][:, :, :, 0].abs().sum() > 0 and ex[2][:, :, :, 1:].abs().sum() == 0  # written at 0


def test_prompt_for_multilingual_checkpoints():
    c = small_config(is_multilingual=True, lang_to_id={"<|en|>": 80, "<|de|>": 81},
                     task_to_id={"transcribe": 85, "translate": 84})
    assert WhisperASR(c, language="de", task="translate").prompt_ids() == [START, 81, 84, NO_TS]
    assert WhisperASR(c).prompt_ids() == [START, 80, 85, NO_TS]
    with pytest.raises(ValueError, match="not in this checkpoint"):
        WhisperASR(c, language="xx").prompt_ids()


def test_half_precision_keeps_fp32_front_end(model):
    m16 = TextFreeWhisper(small_config()).to(torch.bfloat16)
    assert m16.log_mel.filters_MK.dtype == torch.float32
    audio = _random_audio(np.random.default_rng(5), 2)
    f32, _ = model.compute_features(audio)
    f16, _ = m16.compute_features(audio)
    assert f16.dtype == torch.bfloat16
    torch.testing.assert_close(f16.float(), f32, rtol=1e-2, atol=1e-2)


def test_min_new_tokens_suppresses_eos_until_reached():
    """An always-eos step function stops at once, unless min_new_tokens forces more steps."""
    import torch

    from polyaccel.asr.decoding import LogitsRules, greedy_decode

    V, eos = 7, 3

    def step(tokens, position):
        logits = torch.zeros(tokens.shape[0], V)
        logits[:, eos] = 10.0
        logits[:, 5] = 1.0
        return logits

    kw = dict(batch=2, num_real=2, prompt=[0], eos_id=eos, max_new_tokens=8,
              rules=LogitsRules([], []), device="cpu", check_every=1)
    assert [h.tokens for h in greedy_decode(step, **kw)] == [[], []]
    assert [h.tokens for h in greedy_decode(step, min_new_tokens=5, **kw)] == [[5] * 5, [5] * 5]


def test_encoder_residual_stream_is_contiguous(model):
    """Every encoder layer gets a contiguous [B, S, D] input: a transposed layout carried
    along the residual stream makes each residual add a strided, unvectorized GPU kernel
    (measured: two ~0.8 ms kernels per layer, a fifth of Whisper turbo's encoder at batch 64)."""
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
             for layer in model.encoder.layers]
    try:
        with torch.no_grad():
            model.encoder(torch.randn(2, 16, 60))
    finally:
        for h in hooks:
            h.remove()
    assert seen == [True] * len(model.encoder.layers)


def test_features_pad_on_the_device_exactly_as_on_the_host(model):
    """``compute_features`` sends only the real samples and pads where the features are made;
    the log-mel equals the one of each clip zero-padded (or cut) to 30 s on the host."""
    rng = np.random.default_rng(9)
    n = model.config.n_samples
    audio = [rng.standard_normal(k).astype(np.float32) for k in (48000, 1, n, n + 777, 12345)]
    feats, lengths = model.compute_features(audio)
    padded = np.zeros((len(audio), n), np.float32)
    for i, a in enumerate(audio):
        padded[i, : min(len(a), n)] = a[:n]
    assert torch.equal(feats, model.log_mel(torch.from_numpy(padded)).to(feats.dtype))
    assert lengths.tolist() == [300, 1, 3000, 3000, 78]
