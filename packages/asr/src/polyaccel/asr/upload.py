"""Waveforms to the model's device: only the real samples cross, once, from a pinned buffer
each thread reuses, without blocking the host; the zero padding to the batch's length is made
on the device. A padded [B, N] float32 batch built on the host and copied from pageable memory
cost canary's batch of 128 30-s clips 13.5 ms of copy alone on an H200 (246 MB), plus the
host's time to fill it.

Filling the pinned buffer is host work on the critical path (nothing is queued on the GPU
before the batch's samples): one thread's ``np.concatenate`` of those 246 MB took 46 ms on the
H200 machine's host. :func:`pack` copies in pieces on a small thread pool (NumPy copies run
without the GIL) and hands each finished chunk to the caller, which sends it while the next
one is filled.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

PIECE = 1 << 20
"""Samples one thread copies at a time (4 MB)."""
CHUNK = 8 * PIECE
"""Samples filled before they are handed on (sent) together; a multiple of :data:`PIECE`."""

_STAGING = threading.local()
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's copy threads do not exist there, so make a new pool."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor | None:
    """The process's copy threads (up to 8, fewer on small hosts; None on one core)."""
    global _POOL
    workers = min(8, os.cpu_count() or 1)
    if workers < 2:
        return None
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="polyaccel-pack")
    return _POOL


def _pieces(lengths: Sequence[int], piece: int) -> Iterator[tuple[int, int, int, int]]:
    """(output offset, clip, first sample, end sample) of each piece: the clips laid end to
    end, cut at every multiple of ``piece`` in the output and at every clip's end."""
    dst = 0
    for i, n in enumerate(lengths):
        a = 0
        while a < n:
            b = min(n, a + piece - (dst + a) % piece)
            yield dst + a, i, a, b
            a = b
        dst += n


def pack(clips: Sequence[np.ndarray], out: np.ndarray, *, sent: Callable[[int, int], None] | None = None,
         piece: int = PIECE, chunk: int = CHUNK) -> int:
    """Writes the 1-D ``clips`` one after another into ``out`` (1-D, at least as long as all
    of them; values cast to its dtype) and returns their total length. The copies run in
    pieces of ``piece`` samples on a thread pool; ``sent(start, end)`` is called, in order,
    for each filled chunk of ``chunk`` samples (the last one shorter), while no thread writes
    to it any more."""
    if chunk % piece:
        raise ValueError("chunk must be a multiple of piece")
    total = sum(c.shape[0] for c in clips)
    if out.shape[0] < total:
        raise ValueError(f"out holds {out.shape[0]} samples, the clips {total}")

    def copy(task: tuple[int, int, int, int]) -> None:
        d, i, a, b = task
        out[d:d + b - a] = clips[i][a:b]

    pool = _pool() if total > piece else None
    for k, tasks in itertools.groupby(_pieces([c.shape[0] for c in clips], piece), key=lambda t: t[0] // chunk):
        group = list(tasks)
        if pool is not None and len(group) > 1:
            list(pool.map(copy, group))
        else:
            for t in group:
                copy(t)
        if sent is not None:
            sent(k * chunk, min((k + 1) * chunk, total))
    return total


def pinned_upload(clips: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """``clips`` (1-D) joined on ``device`` as float32: packed (:func:`pack`) into a pinned
    buffer this thread reuses (grown as needed), each chunk sent without blocking while the
    next is packed. The next call waits for the previous sends before it writes the buffer
    again."""
    total = sum(c.shape[0] for c in clips)
    buf, done = getattr(_STAGING, "buf", None), getattr(_STAGING, "done", None)
    if done is not None:
        done.synchronize()
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 1 << 20) * 5 // 4, dtype=torch.float32, pin_memory=True)
        _STAGING.buf = buf
    out = torch.empty(total, dtype=torch.float32, device=device)

    def send(a: int, b: int) -> None:
        out[a:b].copy_(buf[a:b], non_blocking=True)

    pack(clips, buf.numpy(), sent=send)
    _STAGING.done = torch.cuda.Event()
    _STAGING.done.record()
    return out


def padded_batch(audio: list[np.ndarray], n: int, device: torch.device) -> torch.Tensor:
    """[B, n] float32 on ``device``: row i holds clip i's first ``min(len, n)`` samples, then
    zeros. On CUDA only the samples cross (:func:`pinned_upload`)."""
    clips = [_as_float(a).reshape(-1)[:n] for a in audio]
    samples = [c.shape[0] for c in clips]
    if device.type == "cuda":
        flat = pinned_upload(clips, device)
    else:
        flat = torch.empty(sum(samples), dtype=torch.float32)
        pack(clips, flat.numpy())
        flat = flat.to(device)  # another device (Neuron) takes no host tensor in masked_scatter_
    valid = torch.arange(n, device=device) < torch.tensor(samples, device=device)[:, None]
    return torch.zeros(len(clips), n, device=device).masked_scatter_(valid, flat)


def _as_float(a: np.ndarray) -> np.ndarray:
    """``a`` as an array of float32 or float64 (those are cast while packed, without a copy
    of their own)."""
    a = np.asarray(a)
    return a if a.dtype in (np.float32, np.float64) else a.astype(np.float32)
