"""Shape buckets and the per-bucket graph cache."""

import pytest
import torch

from polyaccel.core import GraphCache, GraphSpec, ShapeBuckets, select_backend


def test_bucket_pick_and_limits():
    b = ShapeBuckets({"batch": (8, 1, 2, 4), "frames": (3000,)})
    assert b.sizes["batch"] == (1, 2, 4, 8)
    assert b.pick(batch=3, frames=100) == {"batch": 4, "frames": 3000}
    assert b.pick(batch=8, frames=3000) == {"batch": 8, "frames": 3000}
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        b.pick(batch=9)
    assert len(b.all()) == 4 and b.max == {"batch": 8, "frames": 3000}
    with pytest.raises(ValueError):
        ShapeBuckets({"batch": ()})
    with pytest.raises(ValueError, match="positive"):
        ShapeBuckets({"batch": (0, 4)})
    assert ShapeBuckets({"batch": (4, 2, 4)}).all() == [{"batch": 2}, {"batch": 4}]


def test_graph_cache_compiles_each_bucket_once():
    compiled = []

    class CountingBackend(type(select_backend("cpu"))):
        name = "counting"

        def compile_graph(self, fn, example_inputs, *, name="graph"):
            compiled.append((name, tuple(t.shape for t in example_inputs)))
            return fn

    spec = GraphSpec("double", lambda x: x * 2, ShapeBuckets({"batch": (1, 4)}),
                     lambda bucket: [torch.zeros(bucket["batch"], 3)])
    cache = GraphCache(CountingBackend(), [spec])
    for n in (1, 3, 4, 2):
        bucket = spec.buckets.pick(batch=n)
        x = torch.ones(bucket["batch"], 3)
        assert torch.equal(cache("double", bucket, x), x * 2)
    assert [c[1] for c in compiled] == [((1, 3),), ((4, 3),)]
    assert cache.warmup() == 2 and len(compiled) == 2
    two = GraphSpec("add", torch.add, ShapeBuckets({"batch": (2,), "frames": (5,)}),
                    lambda b: [torch.zeros(b["batch"], b["frames"])] * 2)
    cache = GraphCache(CountingBackend(), [two])
    assert cache.get("add", {"batch": 2, "frames": 5}) is cache.get("add", {"frames": 5, "batch": 2})
    assert len(cache) == 1  # one bucket, however its dict is ordered


def test_graph_cache_refuses_other_buffers_for_a_compiled_graph():
    """A graph compiled over one set of state tensors must not silently serve another."""
    spec = GraphSpec("inc", lambda x: x.add_(1), ShapeBuckets({"batch": (2,)}), lambda b: [torch.zeros(2)])
    cache = GraphCache(select_backend("cpu"), [spec])
    mine = torch.zeros(2)
    cache.get("inc", {"batch": 2}, example_inputs=[mine])
    assert cache.get("inc", {"batch": 2}, example_inputs=[mine]) is not None
    with pytest.raises(RuntimeError, match="compiled over other input tensors"):
        cache.get("inc", {"batch": 2}, example_inputs=[torch.zeros(2)])
    # Compiled first over the spec's own example inputs: the caller's state is not its buffers either.
    fresh = GraphCache(select_backend("cpu"), [spec])
    fresh.get("inc", {"batch": 2})
    with pytest.raises(RuntimeError, match="compiled over other input tensors"):
        fresh.get("inc", {"batch": 2}, example_inputs=[mine])


def test_a_failed_cuda_capture_closes_the_generator_capture_then_raises_its_own_error(monkeypatch) -> None:
    """The control flow of ``cuda_graph_capture`` (the GPU test in tests/cuda/test_failed_capture.py
    shows the generator usable after a real failed capture): the repair runs after a failure
    only, and a repair that fails itself never hides the capture's error."""
    import contextlib

    from polyaccel.core import graphs

    repairs: list[int] = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):  # noqa: ANN001, ANN202
        yield

    monkeypatch.setattr(graphs.torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(graphs.torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(graphs, "_close_generator_capture", repairs.append)
    with graphs.cuda_graph_capture(object()):
        pass
    assert repairs == []
    with pytest.raises(ValueError, match="capture refused"), graphs.cuda_graph_capture(object()):
        raise ValueError("capture refused")
    assert repairs == [3]

    def repair_fails(device: int) -> None:
        raise RuntimeError("repair failed too")

    monkeypatch.setattr(graphs, "_close_generator_capture", repair_fails)
    with pytest.raises(ValueError, match="capture refused"), graphs.cuda_graph_capture(object()):
        raise ValueError("capture refused")


def test_no_garbage_collection_runs_inside_a_cuda_capture(monkeypatch) -> None:
    """A collection inside a capture may destroy an unreachable old ``CUDAGraph``, which fails
    the capture (seen on an H200); the collector is paused for the capture, nested captures
    included, and is back on afterwards, after a failed capture too."""
    import contextlib
    import gc

    from polyaccel.core import graphs

    inside: list[bool] = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):  # noqa: ANN001, ANN202
        inside.append(gc.isenabled())
        yield

    monkeypatch.setattr(graphs.torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(graphs.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(graphs, "_close_generator_capture", lambda device: None)
    assert gc.isenabled()
    with graphs.cuda_graph_capture(object()):
        with graphs.cuda_graph_capture(object()):
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer capture still runs
    assert gc.isenabled() and inside == [False, False]
    with pytest.raises(ValueError), graphs.cuda_graph_capture(object()):
        raise ValueError("capture refused")
    assert gc.isenabled()
    gc.disable()
    try:
        with graphs.cuda_graph_capture(object()):
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()
