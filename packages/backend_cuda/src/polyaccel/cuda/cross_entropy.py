"""LM head plus cross-entropy over token chunks, gradients computed in the forward pass.

For a 151,936-token vocabulary and 4,096 tokens the [N, V] logits are 1.2 GB in bf16 and
2.5 GB in fp32, and autograd would keep them (and their gradient) alive. Here, per chunk of
tokens:

1. ``logits = hidden_c @ weight.T`` (bf16, cuBLAS);
2. one Triton kernel per row reads the logits twice: an online max/sum-exp gives the
   log-sum-exp and the row's loss, then it overwrites the logits in place with the loss
   gradient ``(softmax - onehot) * scale`` (fp32 math; ``scale`` is 1/number of counted
   tokens for ``mean``, read from device memory so nothing waits on the host);
3. ``grad_hidden_c = grad_logits @ weight`` and ``grad_weight += grad_logits.T @ hidden_c``
   (fp32 accumulation across chunks).

The op returns the loss and the two gradients; its backward only scales them by the
incoming gradient. So the forward costs the three GEMMs of forward+backward and the logits
exist one chunk at a time. Only ``mean`` and ``sum`` reductions are fused (``none`` needs
per-row output gradients; callers take the reference for it).

Tensors off CUDA take the same op through torch math (tests, CPU).
"""

from __future__ import annotations

import torch

from polyaccel.cuda._triton import cdiv, triton_kernels, use_triton

_LIB = "polyaccel_cuda"
CHUNK_BYTES = 2 << 30
"""Largest logits chunk (bytes) materialised at once. One chunk (4,096 tokens x 151,936 bf16
logits = 1.2 GB fits) needs no fp32 weight-gradient accumulator: two chunks measured 6 ms
slower per 4-micro-batch step on an H200 (fp32 add and cast of the [V, H] gradient)."""


@triton_kernels
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(LOGITS, LABELS, LOSS, SCALE, V, row_stride, ignore_index, WRITE_GRAD: tl.constexpr,
                BLOCK_V: tl.constexpr):
        """Loss of one row (its first V logits); with WRITE_GRAD also its logits gradient, in place."""
        row = tl.program_id(0).to(tl.int64)
        base = LOGITS + row * row_stride
        m = tl.full((BLOCK_V,), -1e30, dtype=tl.float32)  # finite, so masked lanes add exp(-inf)=0
        s = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for v0 in tl.range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        m_row = tl.max(m, axis=0)
        lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))
        label = tl.load(LABELS + row)
        counted = label != ignore_index
        target = tl.load(base + label, mask=counted, other=0.0).to(tl.float32)
        tl.store(LOSS + row, tl.where(counted, lse - target, 0.0))
        if WRITE_GRAD:
            scale = tl.where(counted, tl.load(SCALE), 0.0)
            for v0 in tl.range(0, V, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                mask = cols < V
                x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                p = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
                tl.store(base + cols, (p * scale).to(LOGITS.dtype.element_ty), mask=mask)

    return ce_rows


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 result (cuBLAS writes fp32 directly from bf16 inputs on CUDA)."""
    if a.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return torch.mm(a, b).float()


def _loss_and_grad_rows(logits: torch.Tensor, labels: torch.Tensor, loss_rows: torch.Tensor,
                        scale: torch.Tensor, ignore_index: int, write_grad: bool) -> None:
    """Fill ``loss_rows`` and, with ``write_grad``, turn ``logits`` into their gradient in place
    (``logits`` may be the first columns of wider rows: :func:`padded_vocab`)."""
    if use_triton(logits):
        ce_rows = _kernels()
        ce_rows[(logits.shape[0],)](logits, labels, loss_rows, scale, logits.shape[1], logits.stride(0),
                                    ignore_index, WRITE_GRAD=write_grad, BLOCK_V=4096, num_warps=16)
        return
    lf = logits.float()
    lse = torch.logsumexp(lf, -1)
    counted = labels != ignore_index
    safe = torch.where(counted, labels, 0)
    target = lf.gather(1, safe[:, None]).squeeze(1)
    loss_rows.copy_(torch.where(counted, lse - target, 0.0))
    if write_grad:
        p = torch.exp(lf - lse[:, None])
        p.scatter_add_(1, safe[:, None], -torch.ones_like(lse[:, None]))
        logits.copy_(p * (scale * counted)[:, None])


VOCAB_ALIGN = 64
"""Vocabulary sizes are padded to a multiple of this for the LM-head GEMMs: on CUDA, with an odd
vocabulary (49,155; GPT-2's 50,257) the logits' row length is not a multiple of 8 elements, and
cuBLAS falls back to unaligned sm75 kernels, measured at about half the rate of the aligned
ones on an H200 (a third of a small model's step). Zero rows added to the weight give logits of
exactly 0 in the extra columns, which the loss never reads and whose gradient stays 0."""


def padded_vocab(vocab: int) -> int:
    """The vocabulary size the LM-head GEMMs run at (see :data:`VOCAB_ALIGN`)."""
    return cdiv(vocab, VOCAB_ALIGN) * VOCAB_ALIGN


def chunk_rows(n: int, vocab: int, itemsize: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk: as few equal chunks as keep one chunk's logits under ``chunk_bytes``
    (default :data:`CHUNK_BYTES`), a multiple of 64."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    chunks = max(1, cdiv(n * vocab * itemsize, chunk_bytes))
    return max(1, cdiv(cdiv(n, chunks), 64) * 64)


@torch.library.custom_op(f"{_LIB}::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            ignore_index: int, reduction: str, chunk: int, compute_grad: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 scalar, d loss/d hidden [N, H], d loss/d weight [V, H]); empty grads without
    ``compute_grad``. ``reduction`` is ``"mean"`` (over non-ignored labels) or ``"sum"``."""
    N = hidden.shape[0]
    scale = _loss_scale(labels, ignore_index, reduction)
    loss_rows = torch.empty(N, device=hidden.device, dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    V = weight.shape[0]
    padded = padded_vocab(V)
    w = _padded_weight(weight)
    grad_w_acc = None
    for s in range(0, N, chunk):
        h = hidden[s:s + chunk]
        logits = torch.mm(h, w.t())
        _loss_and_grad_rows(logits[:, :V], labels[s:s + chunk], loss_rows[s:s + chunk], scale, ignore_index,
                            compute_grad)
        if compute_grad:
            torch.mm(logits, w, out=grad_h[s:s + chunk])
            if chunk >= N:
                grad_w_acc = torch.mm(logits.t(), h)
            elif grad_w_acc is None:
                grad_w_acc = _mm_f32(logits.t(), h)
            else:
                grad_w_acc += _mm_f32(logits.t(), h)
    loss = loss_rows.sum() * scale[0]
    if not compute_grad:
        return loss, grad_h, weight.new_empty(0)
    if grad_w_acc is None:
        return loss, grad_h, torch.zeros_like(weight)
    if padded != V:  # a copy of the first V rows: no view of the wider tensor is returned
        return loss, grad_h, grad_w_acc[:V].to(weight.dtype, copy=True)
    return loss, grad_h, grad_w_acc.to(weight.dtype)


def _loss_scale(labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """[1] fp32 on the labels' device: 1 / the counted labels for ``mean``, 1 for ``sum``."""
    if reduction == "mean":
        return (1.0 / (labels != ignore_index).sum().clamp_min(1).float()).reshape(1)
    return torch.ones(1, device=labels.device, dtype=torch.float32)


def _padded_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` with zero rows up to :func:`padded_vocab` rows (itself when none are needed)."""
    V = weight.shape[0]
    padded = padded_vocab(V)
    return torch.nn.functional.pad(weight, (0, 0, 0, padded - V)) if padded != V else weight


@torch.library.custom_op(f"{_LIB}::linear_cross_entropy_logits", mutates_args=())
def linear_cross_entropy_logits_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   ignore_index: int, reduction: str
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 scalar, d loss/d hidden [N, H], d loss/d logits [N, padded V]): one chunk, the
    logits' gradient kept for the caller's weight-gradient GEMM (its columns past V are zero)."""
    scale = _loss_scale(labels, ignore_index, reduction)
    loss_rows = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
    w = _padded_weight(weight)
    logits = torch.mm(hidden, w.t())
    _loss_and_grad_rows(logits[:, :weight.shape[0]], labels, loss_rows, scale, ignore_index, True)
    return loss_rows.sum() * scale[0], torch.mm(logits, w), logits


@linear_cross_entropy_logits_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction):
    return (hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden),
            hidden.new_empty(hidden.shape[0], padded_vocab(weight.shape[0])))


@linear_cross_entropy_op.register_fake
def _(hidden, weight, labels, ignore_index, reduction, chunk, compute_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, torch.empty_like(hidden), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.compute_grad = inputs[6]
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grad_loss, _gh, _gw):
    if not ctx.compute_grad:
        raise RuntimeError("linear_cross_entropy ran without compute_grad; it cannot backpropagate")
    grad_h, grad_w = ctx.saved_tensors
    # A foreach multiply reads the 0-dim scale from device memory and stays vectorized; ``t * g``
    # broadcasts g through the strided path (0.75 vs 0.36 ms for the 622 MB LM-head gradient).
    grad_h, grad_w = torch._foreach_mul([grad_h, grad_w], grad_loss.float())
    return grad_h, grad_w, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """Core ``linear_cross_entropy`` on CUDA: chunked, the [N, V] logits never whole.

    hidden [..., H], weight [V, H], labels [...] -> fp32 scalar loss.
    """
    if reduction not in ("mean", "sum"):
        from polyaccel.core.ops import linear_cross_entropy as core_op

        return core_op.reference(hidden, weight, labels, ignore_index, reduction)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    compute_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    chunk = chunk_rows(h.shape[0], weight.shape[0], h.element_size())
    loss, _, _ = torch.ops.polyaccel_cuda.linear_cross_entropy(h, weight, y, ignore_index, reduction,
                                                               chunk, compute_grad)
    return loss


def linear_cross_entropy_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               ignore_index: int = -100, reduction: str = "mean", chunk: int = 1024,
                               grad_hidden: bool = True, grad_weight: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Core ``linear_cross_entropy_grads`` on CUDA: the same op as :func:`linear_cross_entropy`,
    its gradients returned instead of kept for autograd (``chunk`` is ignored: the chunks are
    sized by :data:`CHUNK_BYTES`). Unfused reductions take core's reference."""
    if reduction not in ("mean", "sum"):
        from polyaccel.core.ops import linear_cross_entropy_grads as core_op

        return core_op.reference(hidden, weight, labels, ignore_index, reduction, chunk, grad_hidden, grad_weight)
    rows = chunk_rows(hidden.shape[0], weight.shape[0], hidden.element_size())
    with torch.no_grad():
        loss, grad_h, grad_w = torch.ops.polyaccel_cuda.linear_cross_entropy(
            hidden, weight, labels, ignore_index, reduction, rows, grad_hidden or grad_weight)
    return loss, grad_h if grad_hidden else None, grad_w if grad_weight else None


def linear_cross_entropy_logit_grads(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                     ignore_index: int = -100, reduction: str = "mean"
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Core ``linear_cross_entropy_logit_grads`` on CUDA: the LM-head GEMM on the aligned
    vocabulary, the loss and the logits' gradient in place by one Triton pass per row, and
    ``d loss/d hidden``; returns the logits' gradient as the first V columns of its aligned
    rows (a view). Unfused reductions take core's reference."""
    if reduction not in ("mean", "sum"):
        from polyaccel.core.ops import linear_cross_entropy_logit_grads as core_op

        return core_op.reference(hidden, weight, labels, ignore_index, reduction)
    with torch.no_grad():
        loss, grad_h, grad_logits = torch.ops.polyaccel_cuda.linear_cross_entropy_logits(
            hidden, weight, labels, ignore_index, reduction)
    return loss, grad_h, grad_logits[:, :weight.shape[0]]
