"""Token dispatchers against the local (no-EP) experts: outputs and gradients (tokens, router
weights, expert weights) on random routing with empty experts and uneven ranks, on 2 gloo
processes (this file re-run as a script); balanced gate loads; GPU dispatchers' import and
argument checks (they cannot run here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

E, K, H, I = 8, 2, 16, 8  # noqa: E741


def _experts(dispatcher=None):
    from polyaccel.moe.layers import Experts

    torch.manual_seed(0)
    m = Experts(E, H, I, "silu")
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.3)
        m.down_proj.normal_(0, 0.3)
    return m


def _rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0: 5 tokens routed only to experts {0, 1, 2} (nothing for rank 1); rank 1: 7 tokens
    to {1, 5, 6}. Experts 3, 4 and 7 get no tokens at all."""
    g = torch.Generator().manual_seed(rank)
    T, allowed = (5, torch.tensor([0, 1, 2])) if rank == 0 else (7, torch.tensor([1, 5, 6]))
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([allowed[torch.randperm(3, generator=g)[:K]] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    upstream = torch.randn(T, H, generator=g)
    return x, idx, w, upstream


def _emulate_symm_mem():
    """CPU stand-ins for NVSHMEM: symmetric buffers are plain tensors (filled with NaN, so reading
    an unwritten row shows), and the two ``symm_mem`` ops are implemented with gloo all-to-alls
    following their documented semantics (rank-major in, expert-major out with each local
    expert's block aligned to ``major_align`` rows, an empty block taking ``major_align`` rows;
    the ``_offset`` op reads chunks at given offsets and writes them back rank-major, packed).
    This checks the dispatcher's own bookkeeping and autograd; the real ops run only on GPUs."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as sm
    from torch.distributed.distributed_c10d import _resolve_process_group

    from polyaccel.moe import dispatchers

    dispatchers.require_symm_mem = lambda device: None
    sm.set_backend = lambda name: None
    sm.enable_symm_mem_for_group = lambda name: None
    sm.rendezvous = lambda t, group: None
    sm.empty = lambda shape, dtype, device: (torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point
                                             else torch.full(shape, -1, dtype=dtype))

    def a2a_2d(inp, out, in_splits, out_splits_offsets, group_name, major_align=None):
        g = _resolve_process_group(group_name)
        P = g.size()
        E_l = in_splits.numel() // P
        recv = torch.empty_like(in_splits)
        dist.all_to_all_single(recv, in_splits.clone(), group=g)  # recv[s * E_l + e]
        send_sizes, recv_sizes = in_splits.view(P, E_l).sum(1).tolist(), recv.view(P, E_l).sum(1).tolist()
        rows = inp.new_empty((sum(recv_sizes), inp.shape[1]))
        dist.all_to_all_single(rows, inp[:sum(send_sizes)].contiguous(), recv_sizes, send_sizes, group=g)
        starts = torch.cumsum(recv, 0) - recv  # source-major chunk starts
        align, pos = major_align or 1, 0
        splits, offsets = torch.zeros(E_l, P, dtype=torch.int64), torch.zeros(E_l, P, dtype=torch.int64)
        for e in range(E_l):
            block_start = pos
            for s in range(P):
                n, src = int(recv[s * E_l + e]), int(starts[s * E_l + e])
                splits[e, s], offsets[e, s] = n, pos
                out[pos:pos + n] = rows[src:src + n]
                pos += n
            length = pos - block_start
            pos = block_start + max(-(-length // align) * align, align)
        out_splits_offsets[0].copy_(splits.flatten())
        out_splits_offsets[1].copy_(offsets.flatten())

    def a2a_2d_offset(inp, out, in_splits_offsets, out_splits_offsets, group_name):
        g = _resolve_process_group(group_name)
        P = g.size()
        E_l = in_splits_offsets.shape[1] // P
        splits, offs = in_splits_offsets[0].view(E_l, P), in_splits_offsets[1].view(E_l, P)
        send = torch.cat([inp[int(offs[e, s]):int(offs[e, s] + splits[e, s])] for s in range(P) for e in range(E_l)])
        recv_splits = torch.empty(P * E_l, dtype=torch.int64)
        dist.all_to_all_single(recv_splits, splits.t().contiguous().flatten(), group=g)  # [d * E_l + e]
        send_sizes, recv_sizes = splits.sum(0).tolist(), recv_splits.view(P, E_l).sum(1).tolist()
        rows = inp.new_empty((sum(recv_sizes), inp.shape[1]))
        dist.all_to_all_single(rows, send, recv_sizes, send_sizes, group=g)
        out[:rows.shape[0]] = rows
        out_splits_offsets[0].copy_(recv_splits)
        out_splits_offsets[1].copy_(torch.cumsum(recv_splits, 0) - recv_splits)

    lib = torch.library.Library("symm_mem", "IMPL")
    lib.impl("all_to_all_vdev_2d", a2a_2d, "CPU")
    lib.impl("all_to_all_vdev_2d_offset", a2a_2d_offset, "CPU")
    return lib


def _worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    from polyaccel.moe.dispatchers import make_dispatcher
    from polyaccel.moe.layers import balanced_routing

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    E_local = E // 2
    mine = slice(rank * E_local, (rank + 1) * E_local)

    # The reference: one module with all experts on every rank's tokens.
    ref = _experts()
    ref_out, ref_grads = {}, {}
    for r in (0, 1):
        x, idx, w, up = _rank_inputs(r)
        x.requires_grad_(), w.requires_grad_()
        out = ref(x, idx, w)
        (out * up).sum().backward()
        ref_out[r], ref_grads[r] = out.detach(), (x.grad, w.grad)
    ref_wgrad = (ref.gate_up_proj.grad[mine], ref.down_proj.grad[mine])

    emulation = _emulate_symm_mem()  # noqa: F841  (keeps the CPU kernels registered)
    for name in ("nccl_a2a", "allgather", "symm_mem"):
        ep = _experts()
        with torch.no_grad():  # this rank's experts only, as after expert parallelism
            ep.gate_up_proj = torch.nn.Parameter(ep.gate_up_proj[mine].clone())
            ep.down_proj = torch.nn.Parameter(ep.down_proj[mine].clone())
        ep.dispatcher = make_dispatcher(name, group, E, "cpu")
        x, idx, w, up = _rank_inputs(rank)
        x.requires_grad_(), w.requires_grad_()
        out = ep(x, idx, w)
        (out * up).sum().backward()
        tol = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref_out[rank], **tol, msg=lambda m, n=name: f"{n} output: {m}")
        torch.testing.assert_close(x.grad, ref_grads[rank][0], **tol, msg=lambda m, n=name: f"{n} dx: {m}")
        torch.testing.assert_close(w.grad, ref_grads[rank][1], **tol, msg=lambda m, n=name: f"{n} dw: {m}")
        torch.testing.assert_close(ep.gate_up_proj.grad, ref_wgrad[0], **tol, msg=lambda m, n=name: f"{n} dW1: {m}")
        torch.testing.assert_close(ep.down_proj.grad, ref_wgrad[1], **tol, msg=lambda m, n=name: f"{n} dW2: {m}")

        if name == "symm_mem":
            continue  # its counts include alignment padding
        # Balanced gate: every rank's experts receive the same number of rows.
        T = 12
        bw, bidx = balanced_routing(torch.randn(T, H), K, E)
        _, counts, _ = ep.dispatcher.dispatch(torch.randn(T, H), bidx, bw)
        assert counts.tolist() == [2 * T * K // E] * E_local, (name, counts.tolist())
    dist.barrier()
    dist.destroy_process_group()
    print("worker ok", rank, flush=True)



@pytest.mark.timeout(120)
def test_dispatchers_match_local_experts(free_port):
    """(d): nccl_a2a and allgather (and symm_mem on emulated NVSHMEM ops) give the local block's
    outputs and gradients on 2 ranks, with experts and a whole rank receiving no tokens and
    unequal token counts per rank; the balanced gate gives equal loads per rank."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=100)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0 and "worker ok" in log, log[-4000:]


def test_dispatcher_names_and_gpu_dispatchers_fail_clearly_on_cpu(monkeypatch):
    """(f): ``auto`` is all-to-all on CPU; symm_mem and deepep say what they need."""
    from polyaccel.moe import dispatchers as d

    assert d.resolve_dispatcher("auto", "cpu") == "nccl_a2a"
    assert d.resolve_dispatcher("allgather", "cpu") == "allgather"
    with pytest.raises(ValueError, match="unknown dispatcher 'x'"):
        d.resolve_dispatcher("x", "cpu")
    with pytest.raises(d.DispatcherUnavailable, match="needs CUDA tensors"):
        d.SymmMemDispatcher(None, 8, device="cpu")
    monkeypatch.setattr(d.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(d.DispatcherUnavailable, match="needs DeepEP .*not installed"):
        d.make_dispatcher("deepep", None, 8, "cuda")


def test_symm_mem_calls_match_the_real_op_schemas():
    """The NVSHMEM ops exist in this PyTorch with the arguments the dispatcher passes (they
    only run on CUDA with NVSHMEM, which this machine lacks)."""
    import inspect

    import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem ops)

    from polyaccel.moe import dispatchers as d

    fwd = str(torch.ops.symm_mem.all_to_all_vdev_2d.default._schema)
    back = str(torch.ops.symm_mem.all_to_all_vdev_2d_offset.default._schema)
    assert "Tensor input, Tensor(a!) out, Tensor in_splits, Tensor(a!) out_splits_offsets, str group_name, " \
           "int? major_align=None" in fwd
    assert "Tensor input, Tensor(a!) out, Tensor in_splits_offsets, Tensor(a!) out_splits_offsets, " \
           "str group_name)" in back
    src = inspect.getsource(d)
    assert src.count("torch.ops.symm_mem.all_to_all_vdev_2d(") == 2
    assert src.count("torch.ops.symm_mem.all_to_all_vdev_2d_offset(") == 2


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # skips the gloo teardown, which at times aborts a finished worker (exit -6)
