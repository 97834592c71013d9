"""The Triton kernel of :mod:`polyaccel.cuda.grouped_gemm`, at module level for the interpreter.
Imported only when the kernel first runs: importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def grouped_mm_tma(X, W, OFFS, OUT, T, P, R, stride_x, stride_out, G, ROWS, W_PR: tl.constexpr,
                   GP2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
                   PER_SM: tl.constexpr, TMA_OUT: tl.constexpr, M_INNER: tl.constexpr,
                   FLATTEN: tl.constexpr):
    # OUT[rows of g] = X[rows of g] @ B_g, B_g = W[g].T (W_PR: W stored [G, P, R], the forward
    # through an F.linear weight) or W[g] (W stored [G, R, P], the input gradient). Tiles are
    # BLOCK_M rows of one expert by BLOCK_P columns, numbered expert-major from each expert's
    # own first row: an expert wastes under BLOCK_M rows at its end, never a neighbour's tile.
    # Rows past the last expert are written as zeros. Every program walks its tiles (one, or
    # every num_programs-th where PER_SM > 0) after reading all G offsets once. Within an
    # expert, consecutive tiles share their rows (or, with M_INNER, their weight columns).
    # TMA_OUT stores through the copy engine (asynchronous), else through pointers. FLATTEN
    # lets Triton pipeline the loads across tiles (the next tile's first chunks load while this
    # one finishes), not only within one tile's reduction.
    idx = tl.arange(0, GP2)
    ends = tl.minimum(tl.load(OFFS + idx, mask=idx < G, other=0), T)
    ends = tl.where(idx < G, ends, tl.max(ends, 0))
    starts = tl.minimum(tl.load(OFFS + idx - 1, mask=(idx > 0) & (idx < G), other=0), T)
    starts = tl.where(idx < G, starts, tl.max(ends, 0))
    rows = tl.maximum(ends - starts, 0)
    tiles_p = tl.cdiv(P, BLOCK_P)
    tiles_m = tl.cdiv(rows, BLOCK_M)
    cum = tl.cumsum(tiles_m, 0) * tiles_p  # tiles of experts 0..g, inclusive
    last = tl.max(ends, 0)
    tail_tiles = tl.cdiv(T - last, BLOCK_M) * tiles_p
    total = tl.max(cum, 0) + tail_tiles
    x = tl.make_tensor_descriptor(X, shape=[T, R], strides=[stride_x, 1], block_shape=[BLOCK_M, BLOCK_R])
    if W_PR:
        w = tl.make_tensor_descriptor(W, shape=[G * P, R], strides=[R, 1], block_shape=[BLOCK_P, BLOCK_R])
    else:
        w = tl.make_tensor_descriptor(W, shape=[G * R, P], strides=[P, 1], block_shape=[BLOCK_R, BLOCK_P])
    step = tl.num_programs(0) if PER_SM > 0 else total + 1
    for tile in tl.range(tl.program_id(0), total, step, flatten=FLATTEN):
        g = tl.sum((cum <= tile).to(tl.int32), 0)
        tail = g >= G  # the rows past the last expert: computed like expert G-1's, stored as zeros
        before = tl.sum(tl.where(idx < g, tiles_m, 0), 0) * tiles_p
        start = tl.where(tail, last, tl.sum(tl.where(idx == g, starts, 0), 0))
        count = tl.where(tail, T - last, tl.sum(tl.where(idx == g, rows, 0), 0))
        g = tl.minimum(g, G - 1)
        local = tile - before
        if M_INNER:
            tiles_here = tl.cdiv(count, BLOCK_M)
            m0 = (local % tiles_here) * BLOCK_M
            p0 = (local // tiles_here) * BLOCK_P
        else:
            m0 = (local // tiles_p) * BLOCK_M
            p0 = (local % tiles_p) * BLOCK_P
        acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            a = x.load([start + m0, r0])
            if W_PR:
                b = w.load([g * P + p0, r0]).T
            else:
                b = w.load([g * R + r0, p0])
            acc = tl.dot(a, b, acc)
        acc = tl.where(tail, 0.0, acc)  # (a select: whatever those rows hold, never NaN)
        if TMA_OUT:
            # A descriptor over this expert's rows alone: the copy engine clips the tile's rows
            # past them (the next expert's) and its columns past P.
            out = tl.make_tensor_descriptor(OUT + start.to(tl.int64) * stride_out, shape=[tl.maximum(count, 1), P],
                                            strides=[stride_out, 1], block_shape=[BLOCK_M, BLOCK_P])
            out.store([m0, p0], acc.to(OUT.dtype.element_ty))
        else:
            rm = m0 + tl.arange(0, BLOCK_M)
            rp = p0 + tl.arange(0, BLOCK_P)
            ptrs = OUT + (start + rm).to(tl.int64)[:, None] * stride_out + rp[None, :]
            tl.store(ptrs, acc.to(OUT.dtype.element_ty), mask=(rm[:, None] < count) & (rp[None, :] < P))
