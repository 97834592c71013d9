"""``polyaccel.asr.upload``: the padded batch both models' features start from (on CUDA only
the real samples cross, from a pinned buffer reused per thread)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyaccel.asr.upload import pack, padded_batch


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
def test_rows_hold_each_clips_samples_cropped_then_zeros(device):
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) for n in (5, 12, 0, 30)]
    clips.append(rng.standard_normal((2, 4)))  # float64, 2-D: flattened
    got = padded_batch(clips, 12, torch.device(device)).cpu()
    assert got.shape == (5, 12) and got.dtype == torch.float32
    for row, clip in zip(got, clips, strict=True):
        flat = torch.from_numpy(np.asarray(clip, dtype=np.float32).reshape(-1)[:12])
        assert torch.equal(row[: flat.numel()], flat) and not row[flat.numel():].any()


@pytest.mark.parametrize("piece,chunk", [(7, 21), (64, 64), (1000, 4000)])
def test_pack_writes_clips_end_to_end_and_hands_on_each_chunk_once_filled(piece, chunk):
    """Pieces cut across clip ends and chunk ends: the buffer holds the clips laid end to end
    (float64 cast on the way), and each chunk is handed on in order, once, after it is filled."""
    rng = np.random.default_rng(piece)
    clips = [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(0, 300, size=40)]
    clips[3] = rng.standard_normal(2500)  # float64, longer than a chunk
    want = np.concatenate(clips).astype(np.float32)
    out = np.full(want.size + 5, -7.0, np.float32)
    handed = []

    def sent(a, b):
        assert np.array_equal(out[a:b], want[a:b]), f"chunk {a}:{b} handed on before it was filled"
        handed.append((a, b))

    assert pack(clips, out, sent=sent, piece=piece, chunk=chunk) == want.size
    assert np.array_equal(out[:want.size], want) and (out[want.size:] == -7.0).all()
    assert handed == [(a, min(a + chunk, want.size)) for a in range(0, want.size, chunk)]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_pack_in_a_forked_child_after_the_parent_packed():
    """The copy threads are the parent's: a child forked after the parent packed (a process
    pool's worker) makes its own pool instead of waiting forever on threads it lacks."""
    import os

    clips = [np.arange(3_000_000, dtype=np.float32), np.ones(10, np.float32)]
    out = np.empty(3_000_010, np.float32)
    pack(clips, out, piece=1 << 16)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if it packs, fast
        code = 1
        try:
            import signal

            signal.alarm(20)
            child = np.empty_like(out)
            pack(clips, child, piece=1 << 16)
            code = 0 if np.array_equal(child, out) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_pack_refuses_a_short_buffer_and_a_chunk_not_made_of_pieces():
    clips = [np.ones(10, np.float32), np.ones(5, np.float32)]
    with pytest.raises(ValueError, match="holds 14 samples, the clips 15"):
        pack(clips, np.zeros(14, np.float32))
    with pytest.raises(ValueError, match="multiple of piece"):
        pack(clips, np.zeros(15, np.float32), piece=4, chunk=6)


@pytest.mark.gpu
def test_reused_pinned_buffer_keeps_earlier_batches():
    """The next upload waits for the previous one before writing the buffer: a batch made first
    is still intact after later, larger ones (which grow the buffer) and smaller ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(1)
    batches = [[rng.standard_normal(n).astype(np.float32) for n in sizes]
               for sizes in ((1000, 300), (3_000_000, 7), (10, 20, 30))]
    made = [padded_batch(b, max(len(c) for c in b), torch.device("cuda")) for b in batches]
    torch.cuda.synchronize()
    for batch, got in zip(batches, made, strict=True):
        for row, clip in zip(got.cpu(), batch, strict=True):
            assert torch.equal(row[: clip.size], torch.from_numpy(clip)) and not row[clip.size:].any()


def test_on_another_device_the_samples_are_moved_there_before_they_are_scattered(monkeypatch):
    """A device other than the CPU and CUDA (Neuron's) is given its samples on itself: a host
    tensor scattered into a device tensor fails there (the meta device stands in for it)."""
    seen = []
    scatter = torch.Tensor.masked_scatter_

    def spy(self, mask, source):  # noqa: ANN001, ANN202
        seen.append((self.device, mask.device, source.device))
        return scatter(self, mask, source)

    monkeypatch.setattr(torch.Tensor, "masked_scatter_", spy)
    meta = torch.device("meta")
    assert padded_batch([np.ones(5, np.float32), np.ones(9, np.float32)], 8, meta).shape == (2, 8)
    assert seen == [(meta, meta, meta)]
