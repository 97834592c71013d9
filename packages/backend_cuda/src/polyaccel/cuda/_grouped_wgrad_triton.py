"""The Triton kernels of :mod:`polyaccel.cuda.grouped_wgrad`, at module level so that both can
call the shared tile start and finish (the interpreter does not see helpers in a closure).
Imported only when a kernel first runs: importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def tile_start(OUT, g, rn, rk, N, K, FROM_OUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The fp32 accumulator of output tile (g, rn, rk), its offsets and mask; FROM_OUT starts it
    # from the tile's current values (the gradient being accumulated into), read before the
    # main loop so the read overlaps it instead of every program reading at its end at once.
    off = g.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :]
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    if FROM_OUT:
        acc = tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    return acc, off, mask


@triton.jit
def tile_finish(acc, OUT, off, mask, ADD_OUT: tl.constexpr, SUMSQ, slot, SQUARES: tl.constexpr):
    # Store the tile, adding the current values first with ADD_OUT; with SQUARES also the sum
    # of squares of the values as stored, into SUMSQ[slot].
    if ADD_OUT:
        acc += tl.load(OUT + off, mask=mask, other=0.0).to(tl.float32)
    stored = acc.to(OUT.dtype.element_ty)
    tl.store(OUT + off, stored, mask=mask)
    tile_squares(stored, SUMSQ, slot, SQUARES)


@triton.jit
def tile_squares(stored, SUMSQ, slot, SQUARES: tl.constexpr):
    # The sum of squares of a stored tile (masked lanes hold zeros) into SUMSQ[slot]: one slot
    # per tile, summed afterwards in a fixed order, so the total is the same bits every run.
    if SQUARES:
        q = stored.to(tl.float32)
        tl.store(SUMSQ + slot, tl.sum(tl.sum(q * q, 1), 0))


@triton.jit
def window_tile(acc, g, rn, rk, DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, T0, T1, T2, T3, N, K,
                stride_dy, stride_x, SOURCES: tl.constexpr, BLOCK_T: tl.constexpr):
    # acc += the (rn, rk) tile of sum_s dy_s,g.T @ x_s,g. Row ranges of group g in each source
    # (never past its T rows, whatever the offsets say); one loop runs over their BLOCK_T
    # chunks in turn.
    first = g > 0
    s0 = tl.minimum(tl.load(OFFS0 + g - 1, mask=first, other=0), T0)
    e0 = tl.minimum(tl.load(OFFS0 + g), T0)
    s1, e1, s2, e2, s3, e3 = s0, s0, s0, s0, s0, s0
    if SOURCES > 1:
        s1 = tl.minimum(tl.load(OFFS1 + g - 1, mask=first, other=0), T1)
        e1 = tl.minimum(tl.load(OFFS1 + g), T1)
    if SOURCES > 2:
        s2 = tl.minimum(tl.load(OFFS2 + g - 1, mask=first, other=0), T2)
        e2 = tl.minimum(tl.load(OFFS2 + g), T2)
    if SOURCES > 3:
        s3 = tl.minimum(tl.load(OFFS3 + g - 1, mask=first, other=0), T3)
        e3 = tl.minimum(tl.load(OFFS3 + g), T3)
    c1 = tl.cdiv(e0 - s0, BLOCK_T)
    c2 = c1 + tl.cdiv(e1 - s1, BLOCK_T)
    c3 = c2 + tl.cdiv(e2 - s2, BLOCK_T)
    chunks = c3 + tl.cdiv(e3 - s3, BLOCK_T)
    for i in range(0, chunks):
        DY = tl.where(i < c1, DY0, tl.where(i < c2, DY1, tl.where(i < c3, DY2, DY3)))
        X = tl.where(i < c1, X0, tl.where(i < c2, X1, tl.where(i < c3, X2, X3)))
        t0 = tl.where(i < c1, s0 + i * BLOCK_T, tl.where(i < c2, s1 + (i - c1) * BLOCK_T,
                      tl.where(i < c3, s2 + (i - c2) * BLOCK_T, s3 + (i - c3) * BLOCK_T)))
        end = tl.where(i < c1, e0, tl.where(i < c2, e1, tl.where(i < c3, e2, e3)))
        rt = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        in_rows = rt < end
        a = tl.load(DY + rt[None, :] * stride_dy + rn[:, None],
                    mask=in_rows[None, :] & (rn[:, None] < N), other=0.0)  # [BLOCK_N, BLOCK_T]
        b = tl.load(X + rt[:, None] * stride_x + rk[None, :],
                    mask=in_rows[:, None] & (rk[None, :] < K), other=0.0)  # [BLOCK_T, BLOCK_K]
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def grouped_wgrad(DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, T0, T1, T2, T3, OUT, N, K,
                  ROWS, stride_dy, stride_x, SUMSQ, SOURCES: tl.constexpr, ACCUMULATE: tl.constexpr,
                  GRAD_FIRST: tl.constexpr, SQUARES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    rn = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    acc, off, mask = tile_start(OUT, g, rn, rk, N, K, ACCUMULATE and GRAD_FIRST, BLOCK_N, BLOCK_K)
    acc = window_tile(acc, g, rn, rk, DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, T0, T1, T2, T3,
                      N, K, stride_dy, stride_x, SOURCES, BLOCK_T)
    tile_finish(acc, OUT, off, mask, ACCUMULATE and not GRAD_FIRST, SUMSQ, g * tl.num_programs(0) + tile, SQUARES)


@triton.jit
def grouped_wgrad_persistent(DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, T0, T1, T2, T3, OUT,
                             G, N, K, ROWS, stride_dy, stride_x, SUMSQ, SOURCES: tl.constexpr,
                             ACCUMULATE: tl.constexpr, GRAD_FIRST: tl.constexpr, SQUARES: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                             PER_SM: tl.constexpr, FLATTEN: tl.constexpr):
    # The kernel above as a persistent launch: each program walks every num_programs-th
    # output tile, expert-major (tiles numbered as above's g * tiles + tile, so are the sums
    # of squares' slots). FLATTEN lets Triton pipeline the loads across tiles: the next tile's
    # first row chunks load while this one's epilogue stores, which matters at a few hundred
    # rows per expert, where the epilogue is a fifth of a tile's time.
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_group = tl.cdiv(N, BLOCK_N) * tiles_k
    for tile in tl.range(tl.program_id(0), G * per_group, tl.num_programs(0), flatten=FLATTEN):
        g = tile // per_group
        t = tile - g * per_group
        rn = (t // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = (t % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        acc, off, mask = tile_start(OUT, g, rn, rk, N, K, ACCUMULATE and GRAD_FIRST, BLOCK_N, BLOCK_K)
        acc = window_tile(acc, g, rn, rk, DY0, DY1, DY2, DY3, X0, X1, X2, X3, OFFS0, OFFS1, OFFS2, OFFS3, T0, T1, T2,
                          T3, N, K, stride_dy, stride_x, SOURCES, BLOCK_T)
        tile_finish(acc, OUT, off, mask, ACCUMULATE and not GRAD_FIRST, SUMSQ, tile, SQUARES)


@triton.jit
def grouped_wgrad_tma(DY, X, OFFS, T, OUT, G, N, K, ROWS, stride_dy, stride_x, SUMSQ, ACCUMULATE: tl.constexpr,
                      GRAD_FIRST: tl.constexpr, SQUARES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_T: tl.constexpr, PER_SM: tl.constexpr, TMA_OUT: tl.constexpr,
                      BAND_N: tl.constexpr):
    # Output tiles expert-major, each program taking every num_programs-th (one each unless the
    # launch is persistent: PER_SM programs per SM). TMA_OUT reads and writes the tiles of OUT
    # with tensor-memory copies too: the store is asynchronous, so a tile's store runs under
    # the next tile's loads and MMAs. BAND_N > 0 walks each expert's tiles in bands of BAND_N
    # rows of tiles, column by column: the tiles in flight share a few slices of both dy and x
    # (which stay in L2) instead of one slice of dy and every slice of x.
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_group = tl.cdiv(N, BLOCK_N) * tiles_k
    if TMA_OUT:
        out = tl.make_tensor_descriptor(OUT, shape=[G, N, K], strides=[N.to(tl.int64) * K, K, 1],
                                        block_shape=[1, BLOCK_N, BLOCK_K])
    for tile in range(tl.program_id(0), G * per_group, tl.num_programs(0)):
        g = tile // per_group
        t = tile - g * per_group
        if BAND_N > 0:
            per_band = BAND_N * tiles_k
            first = (t // per_band) * BAND_N
            height = tl.minimum(tl.cdiv(N, BLOCK_N) - first, BAND_N)
            n0 = (first + (t % per_band) % height) * BLOCK_N
            k0 = ((t % per_band) // height) * BLOCK_K
        else:
            n0 = (t // tiles_k) * BLOCK_N
            k0 = (t % tiles_k) * BLOCK_K
        if TMA_OUT:
            if ACCUMULATE and GRAD_FIRST:
                acc = out.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc, off, mask = tile_start(OUT, g, n0 + tl.arange(0, BLOCK_N), k0 + tl.arange(0, BLOCK_K), N, K,
                                        ACCUMULATE and GRAD_FIRST, BLOCK_N, BLOCK_K)
        start = tl.minimum(tl.load(OFFS + g - 1, mask=g > 0, other=0), T)
        rows = tl.minimum(tl.load(OFFS + g), T) - start
        # Descriptors over this expert's rows alone: the copies zero-fill past its last row (an
        # empty expert's, never read, get one row).
        dy = tl.make_tensor_descriptor(DY + start.to(tl.int64) * stride_dy, shape=[tl.maximum(rows, 1), N],
                                       strides=[stride_dy, 1], block_shape=[BLOCK_T, BLOCK_N])
        x = tl.make_tensor_descriptor(X + start.to(tl.int64) * stride_x, shape=[tl.maximum(rows, 1), K],
                                      strides=[stride_x, 1], block_shape=[BLOCK_T, BLOCK_K])
        for t in range(0, rows, BLOCK_T):
            acc = tl.dot(dy.load([t, n0]).T, x.load([t, k0]), acc)
        if TMA_OUT:
            if ACCUMULATE and not GRAD_FIRST:
                acc += out.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
            stored = acc.to(OUT.dtype.element_ty)
            out.store([g, n0, k0], stored.reshape(1, BLOCK_N, BLOCK_K))
            tile_squares(stored, SUMSQ, tile, SQUARES)  # (the copy engine zero-filled past the edges)
        else:
            tile_finish(acc, OUT, off, mask, ACCUMULATE and not GRAD_FIRST, SUMSQ, tile, SQUARES)
