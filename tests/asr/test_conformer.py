"""ConformerAED (tiny preset, CPU): shapes, padding exactness, checkpoints, the static
decode cache, preset sizes, FLOP counts and the core ops it runs on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from polyaccel.asr.char_tokenizer import CharTokenizer
from polyaccel.asr.conformer import ConformerAED, mel_filterbank
from polyaccel.asr.conformer_config import (
    ConformerAEDConfig,
    canary_1b_flash_shape,
    canary_180m_flash_shape,
    decode_step_flops,
    decoder_state_flops,
    encode_flops,
    flops_per_audio_second,
    subsampled_length,
    tiny,
)
from polyaccel.asr.interface import DecoderState
from polyaccel.core import GraphCache, ops, registry, select_backend

SR = 16000
# Odd sample counts on purpose: frames and the stride-2 convs both round up.
LENGTHS = (16000, 9121, 5303)


@pytest.fixture(scope="module")
def model() -> ConformerAED:
    return ConformerAED.from_config(tiny(), seed=0)


@pytest.fixture(scope="module")
def audio() -> list[np.ndarray]:
    rng = np.random.default_rng(1234)
    t = np.arange(max(LENGTHS)) / SR
    tone = 0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 1.3 * t)
    return [(tone[:n] + 0.05 * rng.standard_normal(n)).astype(np.float32) for n in LENGTHS]


def greedy(model: ConformerAED, audio: list[np.ndarray], steps: int, num_frames: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding over ``decode_step``: (tokens [B, steps], logits [B, steps, V])."""
    feats, lengths = model.compute_features(audio, num_frames)
    enc, enc_mask = model.encode(feats, lengths)
    state = model.new_decoder_state(enc, enc_mask, model.max_decode_len)
    B = len(audio)
    suppress = torch.tensor(model.suppress_ids())
    tokens = torch.full((B,), model.prompt_ids()[0], dtype=torch.int64)
    position = torch.zeros(B, dtype=torch.int64)
    out, all_logits = [], []
    for _ in range(steps):
        logits = model.decode_step(tokens, position, state)
        all_logits.append(logits.clone())
        logits[:, suppress] = float("-inf")
        tokens = logits.argmax(-1)
        out.append(tokens)
        position = position + 1
    return torch.stack(out, 1), torch.stack(all_logits, 1)


# ---- shapes -------------------------------------------------------------------------------------

@torch.no_grad()
def test_shapes(model: ConformerAED, audio: list[np.ndarray]) -> None:
    cfg = model.config
    frames = [-(-n // cfg.hop_length) for n in LENGTHS]
    assert frames == [model.feature_frames(n) for n in LENGTHS] == [100, 58, 34]
    feats, lengths = model.compute_features(audio)  # padded to the smallest frame bucket
    assert feats.shape == (3, cfg.n_mels, 200) and feats.dtype == torch.float32
    assert lengths.tolist() == frames
    assert model.compute_features([np.zeros(201 * 160, np.float32)])[0].shape[-1] == 400
    enc, enc_mask = model.encode(feats, lengths)
    S = subsampled_length(200, 3)
    assert enc.shape == (3, S, cfg.d_model)
    assert enc_mask.sum(1).tolist() == [subsampled_length(f, 3) for f in frames]
    state = model.new_decoder_state(enc, enc_mask, 16)
    L, NH, Dh = cfg.decoder_layers, cfg.decoder_heads, cfg.decoder_dim // cfg.decoder_heads
    assert state.self_k.shape == (L, 3, NH, 16, Dh)
    assert state.cross_k.shape == (L, 3, NH, S, Dh)  # its own frame bucket's frames, not the largest's
    assert state.enc_mask.shape == (3, S)
    assert state.enc_mask.sum(1).tolist() == enc_mask.sum(1).tolist()
    logits = model.decode_step(torch.ones(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), state)
    assert logits.shape == (3, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # explicit frames: padding and cropping
    feats_b, lengths_b = model.compute_features(audio, num_frames=400)
    assert feats_b.shape[-1] == 400 and lengths_b.tolist() == frames
    feats_c, lengths_c = model.compute_features(audio, num_frames=40)
    assert feats_c.shape[-1] == 40 and lengths_c.tolist() == [40, 40, 34]
    assert model.max_audio_seconds() == pytest.approx(8.0)


def test_features_are_normalized_log_mel(model: ConformerAED, audio: list[np.ndarray]) -> None:
    fb = mel_filterbank(80, 512, SR)
    assert fb.shape == (257, 80) and (fb >= 0).all()
    assert (fb.sum(0) > 0).all()  # every filter covers at least one FFT bin
    feats, lengths = model.compute_features(audio)
    for i, n in enumerate(lengths.tolist()):
        real = feats[i, :, :n]
        torch.testing.assert_close(real.mean(-1), torch.zeros(80), atol=1e-4, rtol=0)
        torch.testing.assert_close(real.std(-1), torch.ones(80), atol=1e-3, rtol=0)
        assert (feats[i, :, n:] == 0).all()


# ---- padding must not leak ---------------------------------------------------------------------

@torch.no_grad()
def test_padded_batch_matches_each_item_alone(model: ConformerAED, audio: list[np.ndarray]) -> None:
    feats, lengths = model.compute_features(audio, num_frames=400)
    enc, enc_mask = model.encode(feats, lengths)
    batch_tokens, _ = greedy(model, audio, steps=24, num_frames=400)
    for i, a in enumerate(audio):
        f1, l1 = model.compute_features([a], model.feature_frames(len(a)))  # no padding at all
        n = l1.item()
        torch.testing.assert_close(feats[i, :, :n], f1[0], atol=1e-5, rtol=1e-5)
        e1, m1 = model.encode(f1, l1)
        s = int(m1.sum())
        assert s == e1.shape[1] == int(enc_mask[i].sum())
        torch.testing.assert_close(enc[i, :s], e1[0], atol=1e-4, rtol=1e-4)
        solo_tokens, _ = greedy(model, [a], steps=24, num_frames=model.feature_frames(len(a)))
        assert torch.equal(batch_tokens[i], solo_tokens[0]), i

    # The check can fail: claim every frame is real and the shorter items change.
    enc_leaky, _ = model.encode(feats, torch.full_like(lengths, feats.shape[-1]))
    s = int(enc_mask[2].sum())
    assert not torch.allclose(enc_leaky[2, :s], enc[2, :s], atol=1e-3)


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_save_load_round_trip(tmp_path, audio: list[np.ndarray], tie: bool) -> None:
    cfg = tiny(tie_word_embeddings=tie)
    model = ConformerAED.from_config(cfg, seed=1)
    # non-trivial batch-norm statistics, so the fold is exercised and must be saved
    for block in model.encoder.layers:
        block.conv.norm.running_mean.normal_()
        block.conv.norm.running_var.uniform_(0.5, 2.0)
    model.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "tokenizer.json", "model.safetensors"}
    loaded = ConformerAED.from_pretrained(tmp_path)
    assert loaded.config == cfg
    assert loaded.tokenizer.to_dict() == model.tokenizer.to_dict()
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    if tie:
        assert loaded.decoder.lm_head.weight.data_ptr() == loaded.decoder.embed_tokens.weight.data_ptr()
    feats, lengths = model.compute_features(audio)
    ids = torch.randint(0, cfg.vocab_size, (3, 7))
    assert torch.equal(model(feats, lengths, ids), loaded(feats, lengths, ids))
    assert torch.equal(greedy(model, audio, 8)[0], greedy(loaded, audio, 8)[0])

    half = ConformerAED.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    logits = greedy(half, audio[:1], 2)[1]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_config_json_is_complete(tmp_path) -> None:
    cfg = canary_180m_flash_shape(frame_buckets=(1500, 3000))
    cfg.save(tmp_path)
    assert ConformerAEDConfig.load(tmp_path) == cfg
    with pytest.raises(ValueError):
        tiny(model_type="whisper")


def test_tokenizer_round_trip(tmp_path, model: ConformerAED) -> None:
    tok = CharTokenizer()
    ids = tok.encode("Hello, world 42!")
    assert min(ids) >= 4 and tok.decode(ids) == "hello, world 42!"
    assert tok.decode([tok.token_id("<unk>")] + tok.encode("a")) == "a"
    tok.save(tmp_path)
    assert CharTokenizer.load(tmp_path).to_dict() == tok.to_dict()
    eos = model.config.eos_token_id
    assert model.decode_text([1, *tok.encode("ok"), 63, eos, *tok.encode("no")]) == "ok"
    assert set(model.suppress_ids()) >= {0, 1, 3, 63} and eos not in model.suppress_ids()


# ---- the static cache ----------------------------------------------------------------------------

@torch.no_grad()
def test_static_cache_decode_matches_full_recompute(model: ConformerAED, audio: list[np.ndarray]) -> None:
    steps = 20
    tokens, step_logits = greedy(model, audio, steps)
    feats, lengths = model.compute_features(audio)
    prefix = torch.cat([torch.full((3, 1), model.config.bos_token_id), tokens[:, :-1]], 1)
    full_logits = model(feats, lengths, prefix)  # [B, steps, V], whole prefix, no cache
    torch.testing.assert_close(step_logits, full_logits, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_graph_specs_run_through_graph_cache(model: ConformerAED, audio: list[np.ndarray]) -> None:
    specs = {s.name: s for s in model.graph_specs()}
    assert specs["encode"].buckets.sizes == {"batch": (1, 2, 4, 8), "frames": (200, 400, 800)}
    assert specs["decode_step"].buckets.sizes == {"batch": (1, 2, 4, 8), "frames": (200, 400, 800)}
    cache = GraphCache(select_backend("cpu"), list(specs.values()))

    feats, lengths = model.compute_features(audio)
    assert feats.shape[-1] == 200
    feats = torch.cat([feats, torch.zeros_like(feats[:1])])  # batch bucket 4: one empty item
    lengths = torch.cat([lengths, torch.zeros(1, dtype=torch.int64)])
    enc, enc_mask = cache("encode", {"batch": 4, "frames": 200}, feats, lengths)
    ref_enc, _ = model.encode(feats[:3], lengths[:3])
    torch.testing.assert_close(enc[:3], ref_enc)
    assert torch.isfinite(enc).all() and not enc_mask[3].any()

    state = model.new_decoder_state(enc, enc_mask, model.max_decode_len)
    example = specs["decode_step"].example_inputs({"batch": 4, "frames": 200})
    assert [tuple(t.shape) for t in example[2:]] == [tuple(t.shape) for t in state.tensors()]
    step = cache.get("decode_step", {"batch": 4, "frames": 200})
    tok = torch.full((4,), model.config.bos_token_id)
    before = state.self_k.clone()
    logits = step(tok, torch.zeros(4, dtype=torch.int64), *state.tensors())
    assert logits.shape == (4, model.config.vocab_size)
    assert not torch.equal(before[:, :, :, 0], state.self_k[:, :, :, 0])  # written in place at position 0
    assert torch.equal(before[:, :, :, 1:], state.self_k[:, :, :, 1:])


@pytest.mark.parametrize("use_graphs", [True, False])
def test_asr_runner_greedy_matches_reference_at_every_batch_size(model: ConformerAED, audio: list[np.ndarray],
                                                                use_graphs: bool) -> None:
    from polyaccel.asr.runner import ASRRunner

    steps = 12
    runner = ASRRunner(model, "cpu", batch_buckets=(1, 2, 4), max_new_tokens=steps, use_graphs=use_graphs)
    ref_tokens, _ = greedy(model, audio, steps)
    eos = model.config.eos_token_id
    expected = [row[: row.index(eos)] if eos in row else row for row in ref_tokens.tolist()]
    hyps = runner.recognize(audio)  # 3 utterances in a batch bucket of 4
    assert [h.tokens for h in hyps] == expected
    assert [h.text for h in hyps] == [model.decode_text(t) for t in expected]
    for i, a in enumerate(audio):
        assert runner.recognize([a])[0].tokens == expected[i]


# ---- presets, FLOPs, core ops --------------------------------------------------------------------

@pytest.mark.parametrize("preset, expected, published", [
    (canary_180m_flash_shape, 184_580_096, 182e6),
    (canary_1b_flash_shape, 856_344_576, 883e6),
])
def test_preset_parameter_counts_on_meta(preset, expected: int, published: float) -> None:
    with torch.device("meta"):
        model = ConformerAED(preset())
    n = sum(p.numel() for p in model.parameters())
    assert n == expected
    assert abs(n - published) / published < 0.05  # canary adds relative-position weights we lack
    assert all(p.device.type == "meta" for p in model.parameters())


def test_flop_formulas_match_flop_counter(model: ConformerAED) -> None:
    cfg = model.config
    frames, batch = 400, 2
    feats = torch.randn(batch, cfg.n_mels, frames)
    lengths = torch.full((batch,), frames)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        enc, enc_mask = model.encode(feats, lengths)
    assert counter.get_total_flops() == batch * sum(encode_flops(cfg, frames).values())

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        state = model.new_decoder_state(enc, enc_mask, cfg.max_decode_len)
    assert counter.get_total_flops() == batch * decoder_state_flops(cfg, enc.shape[1])

    tok, pos = torch.ones(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64)
    # the step's one-token attention ops run SDPA on the CPU, whose kernel the counter does not
    # see: count them as core's explicit attention (the same math)
    explicit = lambda q, k, v, mask=None, *a: ops.attention.reference(q, k, v, mask)  # noqa: E731
    visible = lambda q, k, v, p: explicit(q, k, v, (torch.arange(k.shape[2]) <= p[:, None])[:, None, None])  # noqa: E731
    saved = {op: registry.implementations(op).get("cpu") for op in ("decode_attention", "cached_decode_attention")}
    try:
        registry.register("decode_attention", "cpu", explicit, impl="explicit", backend="test")
        registry.register("cached_decode_attention", "cpu", visible, impl="explicit", backend="test")
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model.decode_step(tok, pos, state)
    finally:
        for op, impl in saved.items():
            registry.unregister(op, "cpu")
            if impl is not None:
                registry.register(op, "cpu", impl.fn, impl=impl.impl, backend=impl.backend)
    assert state.cross_k.shape[3] == model.cross_frames(enc.shape[1])  # its frame bucket, not the largest
    assert counter.get_total_flops() == batch * decode_step_flops(cfg, cfg.max_decode_len, state.cross_k.shape[3])

    # the TARGETS estimate for the canary-1b-flash shape: ~20 GFLOP per audio second
    per_s = flops_per_audio_second(canary_1b_flash_shape())
    assert 15e9 < per_s["total"] < 30e9


def test_runs_on_core_ops(model: ConformerAED, audio: list[np.ndarray]) -> None:
    """Each heavy op dispatches through the core registry (where a backend's kernel plugs in)."""
    cfg = model.config
    calls: dict[str, int] = {}
    names = ("conv2d_subsample", "ffn", "fused_qkv", "attention", "depthwise_conv1d", "layer_norm",
             "decode_attention", "cached_decode_attention")
    saved = {op: registry.implementations(op).get("cpu") for op in names}

    def spy(op):
        ref = registry.reference(op)

        def fn(*args, **kwargs):
            calls[op] = calls.get(op, 0) + 1
            return ref(*args, **kwargs)
        return fn

    try:
        for op in names:
            registry.register(op, "cpu", spy(op), impl="spy", backend="test")
        with torch.no_grad():
            feats, lengths = model.compute_features(audio[:1])
            enc, enc_mask = model.encode(feats, lengths)
            encoder_calls = dict(calls)
            state = model.new_decoder_state(enc, enc_mask, 8)
            calls.clear()
            model.decode_step(torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), state)
    finally:
        for op, impl in saved.items():
            registry.unregister(op, "cpu")
            if impl is not None:
                registry.register(op, "cpu", impl.fn, impl=impl.impl, backend=impl.backend)
    n_enc, n_dec = cfg.encoder_layers, cfg.decoder_layers
    assert encoder_calls == {"conv2d_subsample": 1, "ffn": 2 * n_enc, "fused_qkv": n_enc,
                             "attention": n_enc, "depthwise_conv1d": n_enc, "layer_norm": 5 * n_enc}
    # a decoder step's attention is the one-token ops (the self-attention's reference, on the
    # CPU, is decode_attention over the positions so far: counted twice)
    assert calls == {"fused_qkv": n_dec, "cached_decode_attention": n_dec, "decode_attention": 2 * n_dec,
                     "ffn": n_dec, "layer_norm": 3 * n_dec + 1}


@torch.no_grad()
def test_decoder_state_padding_and_reuse(model: ConformerAED) -> None:
    enc = torch.randn(2, 13, model.config.d_model)
    state = model.new_decoder_state(enc, torch.ones(2, 13, dtype=torch.bool), 8)
    assert isinstance(state, DecoderState) and len(state.tensors()) == 5
    assert state.cross_k.shape[3] == subsampled_length(200, 3)  # the smallest bucket holding 13 frames
    assert not state.enc_mask[:, 13:].any() and (state.cross_k[:, :, :, 13:] == 0).all()
    assert model.cross_frames(26) == subsampled_length(400, 3) and model.cross_frames(10**6) == 100
    model.decode_step(torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), state)
    assert state.self_k.abs().sum() > 0

    # ``out=``: the next utterance is written into the same memory, cache cleared
    ptrs = [t.data_ptr() for t in state.tensors()]
    enc2 = torch.randn(2, 7, model.config.d_model)
    reused = model.new_decoder_state(enc2, torch.ones(2, 7, dtype=torch.bool), 8, out=state)
    fresh = model.new_decoder_state(enc2, torch.ones(2, 7, dtype=torch.bool), 8)
    assert [t.data_ptr() for t in reused.tensors()] == ptrs
    for a, b in zip(reused.tensors(), fresh.tensors()):
        assert torch.equal(a, b)


@pytest.mark.slow
@torch.no_grad()
def test_graphs_trace_without_breaks(model: ConformerAED) -> None:
    """Both graphs trace whole (``fullgraph=True``), as a compiling backend needs, and the
    traced decode step still writes its K/V into the cache it is given."""
    specs = {s.name: s for s in model.graph_specs((2,))}
    for name, bucket in (("encode", {"batch": 2, "frames": 200}), ("decode_step", {"batch": 2})):
        example = specs[name].example_inputs(bucket)
        if name == "encode":
            example[0].normal_()
            example[1][1] = 77
        ref_inputs = [t.clone() for t in example]
        expected = specs[name].fn(*ref_inputs)
        compiled = torch.compile(specs[name].fn, backend="aot_eager", fullgraph=True)
        got = compiled(*example)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
        for r, t in zip(ref_inputs, example):  # same in-place updates as eager
            assert torch.equal(r, t)
    torch._dynamo.reset()


def test_encoder_blocks_get_contiguous_inputs(model):
    """Each conformer block sees a contiguous [B, S, D] residual stream (a strided one makes
    every residual add an unvectorized GPU kernel; see Whisper's encoder)."""
    seen = []
    hooks = [block.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
             for block in model.encoder.layers]
    try:
        with torch.no_grad():
            model.encoder(torch.randn(2, model.config.n_mels, 200), torch.tensor([200, 150]))
    finally:
        for h in hooks:
            h.remove()
    assert seen == [True] * len(model.encoder.layers)


# ---- variable-length batching ----------------------------------------------------------------------

@pytest.mark.parametrize("use_graphs", [True, False])
def test_length_bucketed_batches_equal_each_clip_alone(model: ConformerAED, use_graphs: bool) -> None:
    """Clips of 0.4-7.5 s in shuffled order, one recognize call: the runner sorts them by
    length and batches only clips of one frame bucket, each batch padded to its own bucket
    (encoder frames and cross-attention), so every clip's tokens equal its batch-1 decode."""
    from polyaccel.asr.runner import ASRRunner

    rng = np.random.default_rng(7)
    lengths = [6400, 120000, 30000, 47000, 9000, 64000, 31000, 15000, 100000, 2000, 70000]
    t = np.arange(max(lengths)) / SR
    clips = [(0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t[:n]) + 0.2 * rng.standard_normal(n)
              ).astype(np.float32) for n in lengths]
    runner = ASRRunner(model, "cpu", batch_buckets=(1, 2, 4, 8), max_new_tokens=10, use_graphs=use_graphs)
    seen: list[tuple[list[int], int]] = []  # (clip lengths, feature frames) per model call
    compute = model.compute_features

    def spy(audio, num_frames=None):
        feats, lens = compute(audio, num_frames)
        seen.append(([len(a) for a in audio], feats.shape[-1]))
        return feats, lens

    model.compute_features = spy
    try:
        batched = runner.recognize(clips)
        seen_batched, seen[:] = list(seen), []
        alone = [runner.recognize([c])[0] for c in clips]
    finally:
        del model.compute_features
    assert [h.tokens for h in batched] == [h.tokens for h in alone]
    assert len({tuple(h.tokens) for h in alone}) > 3  # the tokens depend on the input
    assert sorted(n for ns, _ in seen_batched for n in ns) == sorted(lengths)
    for ns, frames in seen_batched:  # each batch: one bucket, padded to it and no further
        assert {model.frame_bucket(n) for n in ns} == {frames}, (ns, frames)
    assert [len(ns) for ns, _ in seen_batched] == [3, 2, 6]  # frame buckets 800, 400, 200: one call each
    # the decode slots attend over each bucket's own encoder frames
    ones = {dict(k)["frames"]: s for k, s in runner._slots.items() if dict(k)["batch"] == 1}
    assert {f: s.state.cross_k.shape[3] for f, s in ones.items()} == {f: subsampled_length(f, 3) for f in (200, 400, 800)}
    assert len({s.state.self_k.data_ptr() for s in ones.values()}) == 1  # one self-attention cache per batch size
