"""GraphedMicroStep: a forward + backward replayed as one CUDA graph, equal to eager."""

from __future__ import annotations

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.graphed_step import GraphedMicroStep
from polyaccel.moe.presets import tiny

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _model(device: str, backend: str, **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend=backend, **kw))
    return model.to(device).train()


def test_refuses_a_model_off_cuda():
    with pytest.raises(ValueError, match="CUDA graphs"):
        GraphedMicroStep(_model("cpu", "cpu"))


def test_refuses_zero_warmup():
    with pytest.raises(ValueError, match="warmup"):
        GraphedMicroStep(torch.nn.Linear(2, 2), warmup=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("gate", "mode"), [("learned", "graph"), ("balanced", "graph"),
                                            ("learned", "overlap"), ("balanced", "overlap")])
def test_gpu_replays_equal_eager_steps(gate, mode):
    """Four optimizer steps of 3 micro-batches each, graphed (``overlap``: with the AdamW
    step inside the last micro-batch's graph, the expert weights' in their gradient kernels,
    their grads written over by the next step's first micro-batch) and eager, give the same
    losses and parameters (bf16: the same kernels run; atomics may reorder sums)."""
    from polyaccel.moe.optim import FlatAdamW

    runs = {}
    for graphed in (False, True):
        model = _model("cuda", "cuda", gate=gate).to(torch.bfloat16)
        opt = FlatAdamW(model.parameters(), lr=1e-3)
        overlap = graphed and mode == "overlap"
        step = GraphedMicroStep(model, warmup=1, optimizer=opt if overlap else None) if graphed else None
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(4):
            for mb in range(3):
                ids = torch.randint(3, 97, (2, 32), device="cuda", generator=gen)
                if step is not None:
                    losses.append(step(input_ids=ids, labels=ids, optimizer_step=overlap and mb == 2))
                else:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    losses.append(loss.detach())
            if not overlap:
                opt.step()
                opt.zero_grad()
        if step is not None:  # every kind captured by step 3 and replayed in step 4
            kinds = {(False, False), (True, False), (False, True)} if overlap else {(False, False)}
            assert step.kinds.keys() == kinds and all(k.graph is not None for k in step.kinds.values())
        runs[graphed] = (torch.stack(losses), [p.detach().clone() for p in model.parameters()])
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-2, atol=1e-2)
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=2e-3)
