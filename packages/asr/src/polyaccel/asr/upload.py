"""Waveforms to the model's device: only the real samples cross, once, from a pinned buffer
each thread reuses, without blocking the host; the zero padding to the batch's length is made
on the device. A padded [B, N] float32 batch built on the host and copied from pageable memory
cost canary's batch of 128 30-s clips 13.5 ms of copy alone on an H200 (246 MB), plus the
host's time to fill it."""

from __future__ import annotations

import threading

import numpy as np
import torch

_STAGING = threading.local()


def pinned_upload(clips: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """``clips`` (float32, 1-D) joined on ``device``: copied once, into a pinned buffer this
    thread reuses (grown as needed), then sent without blocking. The next call waits for the
    previous send before it writes the buffer again."""
    total = sum(c.shape[0] for c in clips)
    buf, done = getattr(_STAGING, "buf", None), getattr(_STAGING, "done", None)
    if done is not None:
        done.synchronize()
    if buf is None or buf.numel() < total:
        buf = torch.empty(max(total, 1 << 20) * 5 // 4, dtype=torch.float32, pin_memory=True)
        _STAGING.buf = buf
    if clips:
        np.concatenate(clips, out=buf.numpy()[:total])
    out = buf[:total].to(device, non_blocking=True)
    _STAGING.done = torch.cuda.Event()
    _STAGING.done.record()
    return out


def padded_batch(audio: list[np.ndarray], n: int, device: torch.device) -> torch.Tensor:
    """[B, n] float32 on ``device``: row i holds clip i's first ``min(len, n)`` samples, then
    zeros. On CUDA only the samples cross (:func:`pinned_upload`)."""
    clips = [np.asarray(a, dtype=np.float32).reshape(-1)[:n] for a in audio]
    samples = [c.shape[0] for c in clips]
    if device.type == "cuda":
        flat = pinned_upload(clips, device)
    else:
        flat = torch.from_numpy(np.concatenate(clips) if clips else np.zeros(0, np.float32))
    valid = torch.arange(n, device=device) < torch.tensor(samples, device=device)[:, None]
    return torch.zeros(len(clips), n, device=device).masked_scatter_(valid, flat)
