"""The fused decoder-step kernels (:mod:`polyaccel.cuda.fused_decode`) run by Triton's CPU
interpreter, against core's references; then a tiny Whisper whose fused ``decode_step`` runs
them (registered for the CPU in this process) against its plain ``decode_step``.

Run by ``tests/cuda/test_fused_decode.py`` in a subprocess with ``TRITON_INTERPRET=1`` (see
``interpreted_kernels.py`` for why). Fresh random inputs each run (the seed is printed); fp32
and fp16 (the interpreter mishandles bf16 in ``tl.dot``); rows 1, 3 and 16 (the most the
kernels take) and odd widths, so every block has masked rows, columns and K. Exits non-zero
on the first mismatch.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from polyaccel.core import ops  # noqa: E402
from polyaccel.core.kernels import registry  # noqa: E402
from polyaccel.cuda import fused_decode  # noqa: E402

ROWS = {torch.float32: (1, 5), torch.float16: (16,)}  # fp16 at 16 rows (the most the step takes): its prefixes check 1 and 15
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = rel_err(got, want)
    print(f"{name} {dtype}: rel err {err:.2e}")
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    assert err < TOL[dtype], (name, err)


def layer_norm_params(K: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (1 + 0.2 * torch.randn(K)).to(dtype), (0.2 * torch.randn(K)).to(dtype)


def same_rows_alone(fn, rows: int, name: str) -> None:
    """``fn`` of the first b rows (row 0 alone, then more) equals the first b rows of ``fn``
    of all rows, bit for bit: the other rows' values and count do not reach a row. (Prefixes:
    NumPy's matmul, which runs ``tl.dot`` here, rounds a row by its place in the tile; the
    GPU test checks single rows at other places too.)"""
    full = fn(slice(0, rows))
    for b in sorted({1, rows - 1} - {0, rows}):
        assert torch.equal(fn(slice(0, b)), full[:b]), f"{name}: the first {b} rows alone differ from among {rows}"


def check_ln_linear() -> None:
    """LayerNorm + GEMM + bias (+ exact GELU), narrow and wide (64-column blocks, as a
    vocabulary projection takes) weights, fp32 logits out, no bias; a row alone is the same
    bits as in a batch."""
    for dtype in (torch.float32, torch.float16):
        for K, N, act, out_dtype, has_bias in ((72, 50, "gelu", None, True), (200, 37, None, None, True),
                                               (40, 200, None, torch.float32, False)):
            ln_w, ln_b = layer_norm_params(K, dtype)
            w = (torch.randn(N, K) / K**0.5).to(dtype)
            b = torch.randn(N).to(dtype) if has_bias else None
            for M in ROWS[dtype]:
                x = (3 + 2 * torch.randn(M, 1, K)).to(dtype)  # a mean and scale LayerNorm must take out

                def fused(sl, x=x, ln_w=ln_w, ln_b=ln_b, w=w, b=b, act=act, out_dtype=out_dtype):
                    return fused_decode.ln_linear(x[sl], ln_w, ln_b, 1e-5, w, b, act, out_dtype)

                want = ops.ln_linear.reference(x.double(), ln_w.double(), ln_b.double(), 1e-5, w.double(),
                                               None if b is None else b.double(), act)
                got = fused(slice(None))
                check(f"ln_linear M={M} K={K} N={N} act={act} bias={has_bias}", got,
                      want.to(out_dtype or dtype), dtype)
                same_rows_alone(fused, M, "ln_linear")
    shipped = fused_decode._config  # 128-column blocks, as the rule gives a vocabulary projection
    fused_decode._config = lambda N, K, dtype, parts=1: fused_decode.GemmConfig(128, 64)
    try:
        for dtype in (torch.float32, torch.float16):
            K, N, M = 24, 300, 16
            ln_w, ln_b = layer_norm_params(K, dtype)
            w, x = (torch.randn(N, K) / K**0.5).to(dtype), (3 + 2 * torch.randn(M, 1, K)).to(dtype)
            want = ops.ln_linear.reference(x.double(), ln_w.double(), ln_b.double(), 1e-5, w.double(), None)
            check(f"ln_linear M={M} K={K} N={N} 128-column blocks",
                  fused_decode.ln_linear(x, ln_w, ln_b, 1e-5, w, None, out_dtype=torch.float32), want.float(), dtype)
    finally:
        fused_decode._config = shipped


def check_linear_residual() -> None:
    for dtype in (torch.float32, torch.float16):
        for K, N, has_bias in ((72, 50, True), (130, 24, False)):
            w = (torch.randn(N, K) / K**0.5).to(dtype)
            b = torch.randn(N).to(dtype) if has_bias else None
            for M in ROWS[dtype]:
                x, res = torch.randn(M, 1, K).to(dtype), (4 * torch.randn(M, 1, N)).to(dtype)

                def fused(sl, x=x, w=w, b=b, res=res):
                    return fused_decode.linear_residual(x[sl], w, b, res[sl])

                want = ops.linear_residual.reference(x.double(), w.double(), None if b is None else b.double(),
                                                     res.double())
                check(f"linear_residual M={M} K={K} N={N} bias={has_bias}", fused(slice(None)), want.to(dtype), dtype)
                same_rows_alone(fused, M, "linear_residual")


def check_split_k() -> None:
    """K split over 2 or 3 programs per column block (the last to finish sums the fp32 partials
    in part order): the references' results, including a K part left empty; a row alone is the
    same bits as in a batch; a second call gives the same bits."""
    shipped = fused_decode._config
    try:
        # K=40 in 3 parts of 32: the third is empty
        for split, K, dtype in ((2, 150, torch.float32), (3, 150, torch.float16), (3, 40, torch.float32)):
            fused_decode._config = lambda N, K, dtype, parts=1, split=split: fused_decode.GemmConfig(16, 32, split)
            N, M = 40, ROWS[dtype][-1]
            ln_w, ln_b = layer_norm_params(K, dtype)
            w, b = (torch.randn(N, K) / K**0.5).to(dtype), torch.randn(N).to(dtype)
            x, res = (3 + 2 * torch.randn(M, 1, K)).to(dtype), (4 * torch.randn(M, 1, N)).to(dtype)

            def ln_gelu(sl, x=x, ln_w=ln_w, ln_b=ln_b, w=w, b=b):
                return fused_decode.ln_linear(x[sl], ln_w, ln_b, 1e-5, w, b, "gelu")

            def residual(sl, x=x, w=w, b=b, res=res):
                return fused_decode.linear_residual(x[sl], w, b, res[sl])

            for name, fn, want in (
                    ("ln_linear", ln_gelu, ops.ln_linear.reference(x.double(), ln_w.double(), ln_b.double(),
                                                                    1e-5, w.double(), b.double(), "gelu")),
                    ("linear_residual", residual, ops.linear_residual.reference(x.double(), w.double(),
                                                                                b.double(), res.double()))):
                got = fn(slice(None))
                check(f"{name} split_k={split} M={M} K={K}", got, want.to(dtype), dtype)
                assert torch.equal(fn(slice(None)), got), f"{name} split_k={split}: a second call differs"
                same_rows_alone(fn, M, f"{name} split_k={split}")
    finally:
        fused_decode._config = shipped


def qkv_inputs(M: int, K: int, H: int, D: int, C: int, dtype: torch.dtype):
    ln_w, ln_b = layer_norm_params(K, dtype)
    weights = [(torch.randn(H * D, K) / K**0.5).to(dtype) for _ in range(3)]
    biases = [torch.randn(H * D).to(dtype), None, torch.randn(H * D).to(dtype)]  # Whisper: no k bias
    x = (1 + torch.randn(M, 1, K)).to(dtype)
    cache = [torch.randn(M, H, C, D).to(dtype) for _ in range(2)]
    position = torch.randint(0, C, (M,))
    if M > 1:
        position[0], position[-1] = 0, C - 1
    return x, ln_w, ln_b, weights, biases, cache, position


def check_ln_qkv_into_cache() -> None:
    """q returned, k and v written at each row's position and nowhere else; a row alone
    writes and returns the same bits as in a batch; a position past the cache writes nothing."""
    for dtype in (torch.float32, torch.float16):
        K, H, D, C = 72, 3, 20, 11
        for M in ROWS[dtype]:
            x, ln_w, ln_b, weights, biases, (ck, cv), position = qkv_inputs(M, K, H, D, C, dtype)
            want_k, want_v = ck.double(), cv.double()
            want_q = ops.ln_qkv_into_cache_.reference(x.double(), ln_w.double(), ln_b.double(), 1e-5,
                                                      [w.double() for w in weights],
                                                      [None if b is None else b.double() for b in biases],
                                                      want_k, want_v, position)
            got_k, got_v = ck.clone(), cv.clone()
            q = fused_decode.ln_qkv_into_cache_(x, ln_w, ln_b, 1e-5, weights, biases, got_k, got_v, position)
            check(f"ln_qkv_into_cache_ q M={M}", q, want_q.to(dtype), dtype)
            check(f"ln_qkv_into_cache_ k M={M}", got_k, want_k.to(dtype), dtype)
            check(f"ln_qkv_into_cache_ v M={M}", got_v, want_v.to(dtype), dtype)
            untouched = torch.ones(M, C, dtype=torch.bool)
            untouched[torch.arange(M), position] = False
            for got, before in ((got_k, ck), (got_v, cv)):
                assert torch.equal(got.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched]), \
                    "cache positions other than the rows' own were written"

            def fused(sl, x=x, ln_w=ln_w, ln_b=ln_b, weights=weights, biases=biases, ck=ck, cv=cv, position=position):
                k, v = ck[sl].clone(), cv[sl].clone()
                q = fused_decode.ln_qkv_into_cache_(x[sl], ln_w, ln_b, 1e-5, weights, biases, k, v, position[sl])
                return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)

            same_rows_alone(fused, M, "ln_qkv_into_cache_")
    x, ln_w, ln_b, weights, biases, (ck, cv), position = qkv_inputs(2, 24, 2, 8, 5, torch.float32)
    k = ck.clone()
    fused_decode.ln_qkv_into_cache_(x, ln_w, ln_b, 1e-5, weights, biases, k, cv.clone(), torch.tensor([5, 99]))
    assert torch.equal(k, ck), "a position past the cache was written"


def check_cached_decode_attention() -> None:
    """Attention over cache positions 0..position: positions past it are never read (they
    hold huge values here); a row alone is the same bits as in a batch; q as the fused
    projection returns it and strided as a view of [B, 1, H, D]."""
    for dtype in (torch.float32, torch.float16):
        for C, D in ((90, 64), (37, 40)):
            H = 2
            for M in ROWS[dtype]:
                q = torch.randn(M, 1, H, D).to(dtype).transpose(1, 2)
                ck, cv = torch.randn(M, H, C, D).to(dtype), torch.randn(M, H, C, D).to(dtype)
                position = torch.randint(0, C, (M,))
                if M > 1:
                    position[0], position[-1] = 0, C - 1
                want = ops.cached_decode_attention.reference(q.double(), ck.double(), cv.double(), position)
                later = torch.arange(C)[None, :] > position[:, None]  # [M, C]
                dirty_k, dirty_v = ck.clone(), cv.clone()
                dirty_k.transpose(1, 2)[later] = 3e4
                dirty_v.transpose(1, 2)[later] = -3e4

                def fused(sl, q=q, k=dirty_k, v=dirty_v, position=position):
                    return fused_decode.cached_decode_attention(q[sl], k[sl], v[sl], position[sl])

                check(f"cached_decode_attention M={M} C={C} D={D}", fused(slice(None)), want.to(dtype), dtype)
                same_rows_alone(fused, M, "cached_decode_attention")


def check_greedy_pick() -> None:
    """The first largest column of logits + bias and its log-probability, over a vocabulary of
    three parts (the last partial), at the shipped part width and at twice it (two blocks a
    part): ties within a block, across blocks and across parts take the first; suppressed
    (-inf) columns; a row whose only finite value is in the last part; a row alone is the same
    bits as in a batch."""
    shipped = fused_decode.PICK_PART
    try:
        for part in (shipped, 2 * shipped):
            fused_decode.PICK_PART = part
            _check_greedy_pick(part)
    finally:
        fused_decode.PICK_PART = shipped


def _check_greedy_pick(P: int) -> None:
    V, B = 2 * P + 777, 6
    block = min(P, 1024)  # the kernel's BLOCK_V
    a, b, c, d, e, f = 17, 40, P + 52, 2 * P + 404, 700, max(block, P - 248)
    for dtype in (torch.float32, torch.float16):
        logits = (3 * torch.randn(B, V)).to(dtype)
        bias = torch.zeros(V)
        bias[torch.randperm(V)[:300]] = float("-inf")
        planted = [a, b, c, d, e, f]  # the ties below stay allowed columns
        bias[planted] = 0.0
        logits[0, a] = logits[0, b] = 50  # a tie in one block
        logits[1, c] = logits[1, d] = 50  # a tie across parts
        logits[2, e] = logits[2, f] = 50  # a tie across blocks of one part (or parts, at P = block)
        logits[3, 100] = 50  # suppressed: not the answer
        bias[100] = float("-inf")
        row4 = torch.full((V,), float("-inf"))
        row4[d] = 0.0
        logits[4] = row4.to(dtype)

        def pick(sl, logits=logits, bias=bias):
            best, lp = fused_decode.greedy_pick(logits[sl], bias)
            return torch.stack([best.double(), lp.double()], 1)

        best, lp = fused_decode.greedy_pick(logits, bias)
        want_best, want_lp = ops.greedy_pick.reference(logits, bias)
        assert best.dtype == torch.int64 and lp.dtype == torch.float32
        assert torch.equal(best, want_best), (best, want_best)
        assert best[:3].tolist() == [a, c, e] and best[4].item() == d and best[3].item() != 100
        assert torch.allclose(lp, want_lp, atol=1e-5, rtol=1e-5), (lp, want_lp)
        print(f"greedy_pick part {P} {dtype}: {best.tolist()}")
        same_rows_alone(pick, B, "greedy_pick")


def check_greedy_advance() -> None:
    """The choice and the bookkeeping of core's reference: finished rows get eos and add no
    log-probability; a row choosing eos becomes finished; the column is the step, clamped to
    the last; tokens and positions move on; step itself is left alone."""
    V, B, T, eos = fused_decode.PICK_PART + 500, 5, 4, 7
    for step_value in (1, T + 2):
        logits = 3 * torch.randn(B, V)
        logits[2, eos] = 100  # row 2 chooses eos now
        bias = torch.zeros(V)
        bias[torch.randperm(V)[:50]] = float("-inf")
        bias[eos] = 0.0
        finished = torch.tensor([False, True, False, False, True])
        buffers = [torch.randint(0, 9, (B,)), torch.randint(0, 40, (B,)), finished, torch.randn(B), torch.rand(B) * 5,
                   torch.randint(0, V, (B, T)), torch.tensor([step_value])]
        want = [t.clone() for t in buffers]
        ops.greedy_advance_.reference(logits, bias, *want, eos)
        got = [t.clone() for t in buffers]
        assert fused_decode.greedy_advance_(logits, bias, *got, eos) is None
        names = ("tokens", "position", "finished", "logprob_sum", "counted", "out", "step")
        for name, g, w in zip(names, got, want, strict=True):
            exact = name not in ("logprob_sum", "counted")
            assert g.dtype == w.dtype and (torch.equal(g, w) if exact else torch.allclose(g, w, atol=1e-5)), (name, g, w)
        assert got[2].tolist() == [False, True, True, False, True] and got[6].item() == step_value
        print(f"greedy_advance_ step {step_value}: tokens {got[0].tolist()}")


def check_many_rows_take_the_reference() -> None:
    """Above TRITON_MAX_ROWS the GEMM ops are core's references (cuBLAS on a GPU)."""
    M, K, N = fused_decode.TRITON_MAX_ROWS + 1, 24, 40
    x, w, b = torch.randn(M, K), torch.randn(N, K), torch.randn(N)
    ln_w, ln_b = layer_norm_params(K, torch.float32)
    assert torch.equal(fused_decode.ln_linear(x, ln_w, ln_b, 1e-5, w, b),
                       ops.ln_linear.reference(x, ln_w, ln_b, 1e-5, w, b))
    res = torch.randn(M, N)
    assert torch.equal(fused_decode.linear_residual(x, w, b, res), ops.linear_residual.reference(x, w, b, res))
    print(f"{M} rows: the references")


def check_whisper_fused_step() -> None:
    """A tiny Whisper (odd widths) decodes greedily through the fused kernels (registered for
    the CPU here) and through its plain step: logits close and the same tokens, 4 steps. (The
    cross-attention's ``decode_attention`` kernel is checked in ``interpreted_kernels.py``.)"""
    from polyaccel.asr.whisper import WhisperASR, WhisperConfig

    cfg = WhisperConfig(num_mel_bins=16, d_model=36, encoder_layers=1, encoder_attention_heads=3,
                        encoder_ffn_dim=72, decoder_layers=2, decoder_attention_heads=3, decoder_ffn_dim=88,
                        vocab_size=131, max_source_positions=1500, max_target_positions=12,
                        decoder_start_token_id=100, eos_token_id=99, no_timestamps_token_id=None)
    model = WhisperASR(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.eval()
    B = 3
    enc = torch.randn(B, 70, cfg.d_model)  # the decoder takes any number of encoder frames

    def decode(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.fused_decode = fused
        state = model.new_decoder_state(enc, torch.ones(enc.shape[:2], dtype=torch.bool), cfg.max_target_positions)
        tokens = torch.full((B,), cfg.decoder_start_token_id)
        logits, chosen = [], []
        for t in range(4):
            step = model.decode_step(tokens, torch.full((B,), t), state)
            tokens = step.argmax(-1)
            logits.append(step)
            chosen.append(tokens)
        return torch.stack(logits, 1), torch.stack(chosen, 1)

    fused_ops = {"ln_linear": fused_decode.ln_linear, "linear_residual": fused_decode.linear_residual,
                 "ln_qkv_into_cache_": fused_decode.ln_qkv_into_cache_,
                 "cached_decode_attention": fused_decode.cached_decode_attention}
    with torch.inference_mode():
        plain_logits, plain_tokens = decode(False)
        for name, fn in fused_ops.items():
            registry.register(name, "cpu", fn, impl="triton-interpreter", backend="test")
        try:
            fused_logits, fused_tokens = decode(True)
        finally:
            for name in fused_ops:
                registry.unregister(name, "cpu")
    err = rel_err(fused_logits, plain_logits)
    print(f"whisper fused step (interpreted kernels) vs plain step: logits rel err {err:.2e}, "
          f"tokens {fused_tokens[0].tolist()}")
    assert err < 1e-5, err
    assert torch.equal(fused_tokens, plain_tokens), (fused_tokens, plain_tokens)


def main() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"seed {seed}")
    check_ln_linear()
    check_linear_residual()
    check_split_k()
    check_ln_qkv_into_cache()
    check_cached_decode_attention()
    check_greedy_pick()
    check_greedy_advance()
    check_many_rows_take_the_reference()
    check_whisper_fused_step()


if __name__ == "__main__":
    main()
    sys.exit(0)
