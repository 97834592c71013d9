"""The Triton kernels of :mod:`polyaccel.cuda.fused_decode`, at module level so that kernels
can call the shared helpers (the interpreter does not see helpers in a closure). Imported only
when a fused kernel first runs: importing it imports Triton."""

import triton
import triton.language as tl

try:  # griddepcontrol: programmatic dependent launch (Hopper and newer)
    from triton.language.extra import cuda as cuda_extra

    HAS_PDL = hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
except ImportError:
    cuda_extra, HAS_PDL = None, False


@triton.jit
def dependent_start(PDL: tl.constexpr):
    # Launched with programmatic dependent launch, a kernel starts while the one before it
    # still runs: wait here, before any load or store, until that one has finished and its
    # writes are visible (so every kernel before it has too); then let the next one start.
    if PDL:
        cuda_extra.gdc_wait()
        cuda_extra.gdc_launch_dependents()


@triton.jit
def ln_stats(X, rm, row_mask, sxm, eps, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # mean and 1 / std of rows rm over K in fp32: two passes in a fixed order, each unrolled
    # (K is a constant) so that its loads are issued together rather than one latency each
    total = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :], mask=row_mask[:, None] & (rk < K)[None, :], other=0.0)
        total += tl.sum(x.to(tl.float32), axis=1)
    mean = total / K
    squares = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xmask = row_mask[:, None] & (rk < K)[None, :]
        x = tl.load(X + rm[:, None] * sxm + rk[None, :], mask=xmask, other=0.0)
        diff = tl.where(xmask, x.to(tl.float32) - mean[:, None], 0.0)
        squares += tl.sum(diff * diff, axis=1)
    return mean, tl.rsqrt(squares / K + eps)


@triton.jit
def ln_gemm_tile(X, LNW, LNB, W, M, N, K, eps, sxm, swn, pid_m, pid_n, k_start, k_end, HAS_LN: tl.constexpr,
                 LN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] fp32 = layer_norm(X)[rm, k_start:k_end] @ W[rn, k_start:k_end].T,
    # LayerNorm (statistics over all LN_K columns) rounded to X's dtype
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rm < M
    col_mask = rn < N
    if HAS_LN:
        mean, rstd = ln_stats(X, rm, row_mask, sxm, eps, LN_K, BLOCK_M, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < k_end
        xmask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(X + rm[:, None] * sxm + rk[None, :], mask=xmask, other=0.0)
        if HAS_LN:
            gamma = tl.load(LNW + rk, mask=k_mask, other=0.0).to(tl.float32)
            beta = tl.load(LNB + rk, mask=k_mask, other=0.0).to(tl.float32)
            h = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
            x = tl.where(xmask, h, 0.0).to(X.dtype.element_ty)
        w = tl.load(W + rn[:, None] * swn + rk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return acc, rm, rn, row_mask, col_mask


@triton.jit
def linear_epilogue(acc, rm, rn, row_mask, col_mask, X, BIAS, RES, OUT, srm, som, HAS_BIAS: tl.constexpr,
                    HAS_RES: tl.constexpr, GELU: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(X.dtype.element_ty).to(tl.float32)  # where F.linear rounds
    if GELU:
        y = (0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))).to(X.dtype.element_ty).to(tl.float32)
    mask = row_mask[:, None] & col_mask[None, :]
    if HAS_RES:
        y += tl.load(RES + rm[:, None] * srm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    y = y.to(X.dtype.element_ty)
    tl.store(OUT + rm[:, None] * som + rn[None, :], y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def linear(X, LNW, LNB, W, BIAS, RES, OUT, PARTS, COUNTS, M, N, K, eps, sxm, swn, srm, som,
           HAS_LN: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GELU: tl.constexpr,
           SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           LN_K: tl.constexpr = 0, PDL: tl.constexpr = False):
    dependent_start(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per
    acc, rm, rn, row_mask, col_mask = ln_gemm_tile(X, LNW, LNB, W, M, N, K, eps, sxm, swn, pid_m, pid_n,
                                                   k_start, tl.minimum(k_start + k_per, K), HAS_LN, LN_K,
                                                   BLOCK_M, BLOCK_N, BLOCK_K)
    if SPLIT_K == 1:
        linear_epilogue(acc, rm, rn, row_mask, col_mask, X, BIAS, RES, OUT, srm, som, HAS_BIAS, HAS_RES, GELU)
    else:
        # Each K part stores its fp32 partial [part, row, column]; the tile's last program to
        # finish (COUNTS: zeros, one counter per tile, fresh each call) sums all parts in part
        # order, so the bits never depend on which one is last, and writes the output.
        rows = tl.num_programs(1) * BLOCK_M
        col_all = col_mask[None, :] & (rm >= 0)[:, None]
        tl.store(PARTS + (pid_k * rows + rm[:, None]) * N + rn[None, :], acc, mask=col_all)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(COUNTS + tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for part in tl.static_range(SPLIT_K):
                total += tl.load(PARTS + (part * rows + rm[:, None]) * N + rn[None, :], mask=col_all, other=0.0,
                                 cache_modifier=".cg")
            linear_epilogue(total, rm, rn, row_mask, col_mask, X, BIAS, RES, OUT, srm, som,
                            HAS_BIAS, HAS_RES, GELU)


@triton.jit
def qkv_into_cache(X, LNW, LNB, WQ, WK, WV, BQ, BK, BV, Q, CK, CV, POS, M, N, K, C, HEAD_D, eps,
                   sxm, sqm, sckb, sckh, sckc, scvb, scvh, scvc,
                   HAS_BQ: tl.constexpr, HAS_BK: tl.constexpr, HAS_BV: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LN_K: tl.constexpr,
                   PDL: tl.constexpr = False):
    dependent_start(PDL)
    part = tl.program_id(1)  # 0: q, 1: k, 2: v
    W = WQ
    if part == 1:
        W = WK
    elif part == 2:
        W = WV
    acc, rm, rn, row_mask, col_mask = ln_gemm_tile(X, LNW, LNB, W, M, N, K, eps, sxm, K,
                                                   tl.program_id(2), tl.program_id(0), 0, K, True, LN_K,
                                                   BLOCK_M, BLOCK_N, BLOCK_K)
    head = rn // HEAD_D
    d = rn % HEAD_D
    pos = tl.load(POS + rm, mask=row_mask, other=0)
    mask = row_mask[:, None] & col_mask[None, :]
    cache_mask = mask & ((pos >= 0) & (pos < C))[:, None]  # a position past the cache writes nothing
    if part == 0:
        if HAS_BQ:
            acc += tl.load(BQ + rn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Q + rm[:, None] * sqm + rn[None, :], acc.to(Q.dtype.element_ty), mask=mask)
    elif part == 1:
        if HAS_BK:
            acc += tl.load(BK + rn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        where = CK + rm[:, None] * sckb + head[None, :] * sckh + pos[:, None] * sckc + d[None, :]
        tl.store(where, acc.to(CK.dtype.element_ty), mask=cache_mask)
    else:
        if HAS_BV:
            acc += tl.load(BV + rn, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        where = CV + rm[:, None] * scvb + head[None, :] * scvh + pos[:, None] * scvc + d[None, :]
        tl.store(where, acc.to(CV.dtype.element_ty), mask=cache_mask)


@triton.jit
def attend_block(K, V, sks, svs, q, s, smask, d, dmask, m, l_sum, acc, KS, VS, sss, SCALED: tl.constexpr):
    # One block of keys (positions s; smask: the ones attended) into the online softmax state:
    # running max m, sum l_sum and weighted values acc, all fp32. A block with no key attended
    # while m is still -inf leaves the state as it is. SCALED: K and V hold e4m3 rows, key s
    # standing for K[s] * KS[s] (V likewise); the scales multiply the scores and the weights.
    kv_mask = smask[:, None] & dmask[None, :]
    k = tl.load(K + s[:, None] * sks + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    if SCALED:
        scores = scores * tl.load(KS + s * sss, mask=smask, other=0.0)
    scores = tl.where(smask, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(scores - m_safe)
    v = tl.load(V + s[:, None] * svs + d[None, :], mask=kv_mask, other=0.0)
    pv = p
    if SCALED:
        pv = p * tl.load(VS + s * sss, mask=smask, other=0.0)
    acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), axis=0)
    l_sum = l_sum * alpha + tl.sum(p, axis=0)
    return m_new, l_sum, acc


@triton.jit
def cached_attention(Q, K, V, POS, OUT, H, C, scale, sqb, sqh, skb, skh, sks, svb, svh, svs, sob, soh,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                     PDL: tl.constexpr = False):
    dependent_start(PDL)
    row = tl.program_id(0)  # b * H + h
    b = row // H
    h = row % H
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(Q + b * sqb + h * sqh + d, mask=dmask, other=0.0).to(tl.float32) * scale
    end = tl.minimum(tl.load(POS + b) + 1, C)
    m = tl.full((), float("-inf"), tl.float32)
    l_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for start in range(0, end, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        m, l_sum, acc = attend_block(K + b * skb + h * skh, V + b * svb + h * svh, sks, svs, q, s, s < end, d, dmask,
                                     m, l_sum, acc, K, V, 0, False)
    o = acc / tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(OUT + b * sob + h * soh + d, o.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def greedy_pick(LOGITS, BIAS, PARTS, COUNTS, BEST, LOGPROB, TOKENS, POSITION, FINISHED, LOGPROB_SUM, COUNTED,
                OUT, STEP, V, slb, sob, T, eos_id, ADVANCE: tl.constexpr, PART_V: tl.constexpr,
                BLOCK_V: tl.constexpr, PARTS_P2: tl.constexpr, PDL: tl.constexpr = False):
    dependent_start(PDL)
    # Program (row, part) scans columns [part * PART_V, +PART_V) of logits + bias: its largest
    # value, that value's first column, and the sum of exp(value - largest). The row's last
    # program to finish combines the parts in part order (bits independent of which is last)
    # and, with ADVANCE, does the greedy step's bookkeeping for the row (core's greedy_advance_).
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    best = tl.full((), float("-inf"), tl.float32)
    where = tl.full((), 0, tl.int32)
    total = tl.zeros((), tl.float32)
    for start in tl.static_range(0, PART_V, BLOCK_V):
        cols = part * PART_V + start + tl.arange(0, BLOCK_V)
        mask = cols < V
        s = tl.load(LOGITS + row * slb + cols, mask=mask, other=0.0).to(tl.float32)
        s = tl.where(mask, s + tl.load(BIAS + cols, mask=mask, other=0.0), float("-inf"))
        block_best = tl.max(s, axis=0)
        block_where = tl.argmax(s, axis=0, tie_break_left=True).to(tl.int32) + part * PART_V + start
        top = tl.maximum(best, block_best)
        total = total * tl.where(best == top, 1.0, tl.exp(best - top))
        total += tl.sum(tl.where(s == float("-inf"), 0.0, tl.exp(s - top)), axis=0)
        where = tl.where(block_best > best, block_where, where)
        best = top
    slot = (row * parts + part) * 3
    tl.store(PARTS + slot, best)
    tl.store(PARTS + slot + 1, where.to(tl.float32))  # exact: column indices < 2**24
    tl.store(PARTS + slot + 2, total)
    tl.debug_barrier()
    if tl.atomic_add(COUNTS + row, 1, sem="acq_rel") == parts - 1:
        # all parts at once (one load latency, not one per part): the largest value, the first
        # column holding it (parts are in column order), the sum of exp rescaled to it
        p = tl.arange(0, PARTS_P2)
        slots = PARTS + (row * parts + p) * 3
        b = tl.load(slots, mask=p < parts, other=float("-inf"), cache_modifier=".cg")
        w = tl.load(slots + 1, mask=p < parts, other=0.0, cache_modifier=".cg").to(tl.int32)
        t = tl.load(slots + 2, mask=p < parts, other=0.0, cache_modifier=".cg")
        best = tl.max(b, axis=0)
        where = tl.min(tl.where((b == best) & (p < parts), w, 2**30), axis=0)
        total = tl.sum(t * tl.where(b == best, 1.0, tl.exp(b - best)), axis=0)
        logprob = -tl.log(total)
        chosen = where.to(tl.int64)
        if ADVANCE:
            done = tl.load(FINISHED + row) != 0
            live = tl.where(done, 0.0, 1.0)
            tl.store(LOGPROB_SUM + row, tl.load(LOGPROB_SUM + row) + logprob * live)
            tl.store(COUNTED + row, tl.load(COUNTED + row) + live)
            chosen = tl.where(done, eos_id, chosen)
            tl.store(OUT + row * sob + tl.minimum(tl.load(STEP), T - 1), chosen)
            tl.store(FINISHED + row, (done | (chosen == eos_id)).to(tl.int1))
            tl.store(TOKENS + row, chosen)
            tl.store(POSITION + row, tl.load(POSITION + row) + 1)
        else:
            tl.store(BEST + row, chosen)
            tl.store(LOGPROB + row, logprob)
