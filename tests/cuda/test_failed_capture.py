"""A CUDA graph capture that fails leaves the process usable: random ops and the replays of
other graphs still run (torch alone leaves the default generator marked as capturing)."""

from __future__ import annotations

import pytest
import torch

from polyaccel.core.graphs import cuda_graph_capture

pytestmark = pytest.mark.gpu


def _capture_that_fails() -> None:
    bad = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError), cuda_graph_capture(bad):
        noise = torch.randn(8, device="cuda")  # a random op inside: the generator joins the capture
        noise.sum().item()  # a host read: the capture refuses it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_random_ops_and_other_graphs_run_after_a_failed_capture() -> None:
    counter = torch.zeros(4, device="cuda")
    good = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        counter.add_(1)  # warm up off the capture
    torch.cuda.current_stream().wait_stream(side)
    with cuda_graph_capture(good):
        counter.add_(torch.rand(4, device="cuda") + 1)  # a graph that draws random numbers too
    counter.zero_()

    _capture_that_fails()

    torch.manual_seed(0)
    first = torch.randn(16, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.randn(16, device="cuda"), first)  # seeding still decides the draws
    good.replay()
    good.replay()
    torch.cuda.synchronize()
    assert bool(((counter >= 2) & (counter < 4)).all()), counter
    _capture_that_fails()  # and a second failure after that
    good.replay()
    torch.randn(4, device="cuda")
    torch.cuda.synchronize()
