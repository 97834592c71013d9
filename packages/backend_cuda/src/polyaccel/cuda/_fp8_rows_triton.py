"""The Triton kernel of :mod:`polyaccel.cuda.fp8_rows` and its helpers, at module level (the
interpreter does not see helpers in a closure). Imported only when a kernel first runs:
importing it imports Triton."""

import triton
import triton.language as tl


@triton.jit
def nearest_e4m3(q):
    """``q`` (|q| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32 (the
    cast after it is then exact): 3 mantissa bits, subnormals 2^-9 apart."""
    exponent = tl.maximum((q.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)
    step = ((exponent - 3) << 23).to(tl.float32, bitcast=True)
    return ((q / step + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: fp32 addition rounds to even


@triton.jit
def affine(y, W, B, cols, cmask, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """A LayerNorm's weight and bias applied to the normalised piece ``y`` [ROWS, BLOCK]."""
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def gelu_tanh_form(x, EXACT_DIVISION: tl.constexpr):
    """GELU's tanh form, ``0.5 x (1 + tanh(u))`` with ``u = sqrt(2 / pi) (x + 0.044715 x^3)``,
    computed as ``x / (1 + exp(-2u))`` (no cancellation for negative x): within 4.8e-4 of the
    erf GELU everywhere, about a hundredth of an e4m3 step at values near 1, and a third of the
    erf polynomial's instructions, so the pass runs at the memory's rate. The division is the
    GPU's approximate one (``__fdividef``) unless EXACT_DIVISION (the interpreter)."""
    d = 1.0 + tl.exp(-x * (1.5957691216057308 + 0.0713548162726009 * x * x))
    if EXACT_DIVISION:
        return x / d
    return tl.extra.cuda.libdevice.fast_dividef(x, d)


@triton.jit
def to_e4m3(y, inv_scale, fp8_max, mask, ROUND: tl.constexpr):
    q = tl.clamp(y * inv_scale[:, None], -fp8_max, fp8_max)
    if ROUND:
        q = nearest_e4m3(q)
    return tl.where(mask, q, 0.0)


@triton.jit
def rows_fp8(X, W, B, Q, S, M, K, stride_x, eps, inv_max, fp8_max,
             PROLOGUE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
             BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, ROWS: tl.constexpr, ROUND: tl.constexpr):
    """ROWS rows a program, each held in two pieces, BLOCK_A (<= K) then BLOCK_B columns, so a
    width that is not a power of two wastes at most the second piece's padding. PROLOGUE: 0
    none, 1 LayerNorm, 2 GELU (its tanh form). ROUND (the interpreter): round to e4m3 before
    the cast (the interpreter's cast does not round to nearest even) and divide exactly."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    ca = tl.arange(0, BLOCK_A)
    cb = BLOCK_A + tl.arange(0, BLOCK_B)
    ma = rmask[:, None] & (ca < K)[None, :]
    mb = rmask[:, None] & (cb < K)[None, :]
    src = X + rows[:, None].to(tl.int64) * stride_x
    xa = tl.load(src + ca[None, :], mask=ma, other=0.0).to(tl.float32)
    xb = tl.load(src + cb[None, :], mask=mb, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        mean = (tl.sum(xa, axis=1) + tl.sum(xb, axis=1)) / K
        da = tl.where(ma, xa - mean[:, None], 0.0)
        db = tl.where(mb, xb - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn((tl.sum(da * da, axis=1) + tl.sum(db * db, axis=1)) / K + eps)
        ya = tl.where(ma, affine(da * rstd[:, None], W, B, ca, ca < K, HAS_W, HAS_B), 0.0)
        yb = tl.where(mb, affine(db * rstd[:, None], W, B, cb, cb < K, HAS_W, HAS_B), 0.0)
    elif PROLOGUE == 2:
        ya = gelu_tanh_form(xa, ROUND)
        yb = gelu_tanh_form(xb, ROUND)
    else:
        ya = xa
        yb = xb
    amax = tl.maximum(tl.max(tl.abs(ya), axis=1), tl.max(tl.abs(yb), axis=1))
    scale = tl.maximum(amax, 1e-12) * inv_max
    inv_scale = tl.div_rn(1.0, scale)
    dst = Q + rows[:, None].to(tl.int64) * K
    tl.store(dst + ca[None, :], to_e4m3(ya, inv_scale, fp8_max, ma, ROUND).to(Q.dtype.element_ty), mask=ma)
    tl.store(dst + cb[None, :], to_e4m3(yb, inv_scale, fp8_max, mb, ROUND).to(Q.dtype.element_ty), mask=mb)
    tl.store(S + rows, scale, mask=rmask)
