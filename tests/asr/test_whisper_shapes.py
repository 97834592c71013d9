"""Our Whisper against Transformers' on checkpoint shapes drawn at random (seeded): 80 or 128
mel bins, widths and head counts that are not powers of two, encoders and decoders of
different depths (as large-v3-turbo's 32 / 4). The weights go through a Transformers
checkpoint on disk, as a user's would: teacher-forced logits and the cached decoder step must
equal Transformers' forward in fp32."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from polyaccel.asr.whisper import WhisperASR

pytestmark = pytest.mark.usefixtures("one_thread")


def _draw(rng: random.Random) -> dict:
    heads = rng.choice([1, 2, 3, 6])
    d_model = heads * rng.choice([8, 12, 16])
    decoder_heads = rng.choice([h for h in (1, 2, 3, 4, 6) if d_model % h == 0])
    return dict(num_mel_bins=rng.choice([80, 128]), d_model=d_model, encoder_layers=rng.randint(1, 3),
                decoder_layers=rng.randint(1, 3), encoder_attention_heads=heads, decoder_attention_heads=decoder_heads,
                encoder_ffn_dim=rng.choice([2, 4]) * d_model + rng.choice([0, 8]),
                decoder_ffn_dim=rng.choice([2, 4]) * d_model + rng.choice([0, 8]),
                vocab_size=rng.choice([100, 131]), max_target_positions=rng.choice([16, 24]),
                max_source_positions=1500, decoder_start_token_id=3, eos_token_id=2, pad_token_id=2,
                begin_suppress_tokens=None, suppress_tokens=None)


SEEDS = list(range(6))


def _id(seed: int) -> str:
    f = _draw(random.Random(f"whisper-{seed}"))
    return (f"seed{seed}-mel{f['num_mel_bins']}-d{f['d_model']}h{f['encoder_attention_heads']}/{f['decoder_attention_heads']}"
            f"-enc{f['encoder_layers']}dec{f['decoder_layers']}")


@pytest.mark.parametrize("seed", SEEDS, ids=[_id(s) for s in SEEDS])
def test_random_shapes_match_transformers(seed: int, tmp_path) -> None:
    fields = _draw(random.Random(f"whisper-{seed}"))
    torch.manual_seed(seed)
    hf = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**fields)).eval()
    with torch.no_grad():  # Transformers zero-inits biases; random ones make every add count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = WhisperASR.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.num_mel_bins == fields["num_mel_bins"]
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, fields["num_mel_bins"], 3000, generator=g)
    ids = torch.randint(3, fields["vocab_size"], (2, 7), generator=g)
    with torch.no_grad():
        want = hf(input_features=features, decoder_input_ids=ids).logits
        got = ours(features, ids)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        enc, mask = ours.encode(features, torch.full((2,), 3000))
        state = ours.new_decoder_state(enc, mask, ours.max_decode_len)
        steps = torch.stack([ours.decode_step(ids[:, t], torch.full((2,), t), state) for t in range(ids.shape[1])], 1)
    torch.testing.assert_close(steps, want, atol=2e-4, rtol=1e-4)
