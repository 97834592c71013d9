"""On a GPU: CUDA-graph decoding gives exactly the eager tokens at every batch size.

Run on the device machine with ``pytest -m gpu tests/asr/test_asr_cuda_graphs.py``.
"""

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _seed() -> int:
    """The inputs' random seed, named in every failure: ``POLYACCEL_TEST_SEED`` reruns one."""
    return int(os.environ.get("POLYACCEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def _whisper(dtype):
    from polyaccel.asr.whisper import WhisperASR, WhisperConfig

    cfg = WhisperConfig(num_mel_bins=80, d_model=256, encoder_layers=2, encoder_attention_heads=4,
                        encoder_ffn_dim=512, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=512,
                        vocab_size=512, decoder_start_token_id=500, eos_token_id=501, no_timestamps_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WhisperASR(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.decode_text = lambda ids: " ".join(map(str, ids))
    return model.to(dtype).eval().requires_grad_(False)


def _conformer(dtype):
    from polyaccel.asr import conformer_config
    from polyaccel.asr.conformer import ConformerAED

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = ConformerAED(conformer_config.tiny())
    return model.to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("make", [_whisper, _conformer], ids=["whisper", "conformer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_tokens_equal_eager(make, dtype, caplog):
    """Graph replays give the eager tokens, and every capture succeeds (a failed one falls
    back to eager decoding with a warning: the same tokens, so only this check sees it)."""
    import logging

    from polyaccel.asr.runner import ASRRunner

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    caplog.set_level(logging.WARNING, logger="polyaccel.asr.runner")
    model = make(dtype)
    seed = _seed()
    rng = np.random.default_rng(seed)
    audio = [(0.3 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in (3.0, 7.5, 1.2, 9.0, 4.4)]
    graphs = ASRRunner(model, backend="cuda", batch_buckets=(1, 2, 4, 8), max_new_tokens=20, use_graphs=True)
    for b in (1, 2, 5):
        eager = ASRRunner(model, backend="cuda", batch_buckets=(b,), max_new_tokens=20, use_graphs=False)
        got = [h.tokens for h in graphs.recognize(audio[:b])]
        want = [h.tokens for h in eager.recognize(audio[:b])]
        assert got == want, f"POLYACCEL_TEST_SEED={seed}: batch {b}: graphed {got}, eager {want}"
    # a second pass over the same graphs (state reused in place) is still exact
    again = ASRRunner(model, backend="cuda", batch_buckets=(2,), max_new_tokens=20, use_graphs=False)
    assert [h.tokens for h in graphs.recognize(audio[:2])] == [h.tokens for h in again.recognize(audio[:2])], seed
    assert not [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()], seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_replicas_capturing_while_the_other_runs(dtype, caplog):
    """Two runners sharing one model on two threads, as the Transcriber's replicas do: each
    captures its batch buckets lazily while the other decodes. No capture may fail (on an
    H200, fp32 replicas lost 16 of 20 files to invalidated captures before the capture gate)
    and every replica's tokens equal one eager runner's."""
    import logging
    import threading

    from polyaccel.asr.runner import ASRRunner

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _whisper(dtype)
    seed = _seed()
    rng = np.random.default_rng(seed)
    audio = [(0.3 * rng.standard_normal(int(16000 * s))).astype(np.float32) for s in rng.uniform(1, 29, 24)]
    sizes = [1, 3, 8, 2, 5, 4, 1]  # each new size is a new bucket: captures all along the run

    def run(use_graphs: bool) -> list:
        runner = ASRRunner(model, backend="cuda", batch_buckets=(1, 2, 4, 8), max_new_tokens=12,
                           use_graphs=use_graphs)
        got, start = [], 0
        for k in sizes * 2:
            got.append([h.tokens for h in runner.recognize([audio[(start + j) % len(audio)] for j in range(k)])])
            start += k
        return got

    want = run(use_graphs=False)  # the same batches in the same buckets, eagerly, alone
    results, errors = {}, []

    def replica(i: int) -> None:
        try:
            results[i] = run(use_graphs=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    with caplog.at_level(logging.WARNING, logger="polyaccel.asr.runner"):
        threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert not errors, (seed, errors)
    assert not [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()], seed
    assert len(results) == 2, (seed, results.keys())
    for i, got in results.items():
        wrong = [(n, g, w) for n, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not wrong, f"POLYACCEL_TEST_SEED={seed}: replica {i}, batches (index, graphed, eager) {wrong[:2]}"
