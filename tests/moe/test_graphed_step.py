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


@pytest.mark.parametrize(("arch", "window"), [("qwen3_moe", "auto"), ("mixtral", 2), ("olmoe", 2),
                                            ("deepseek_v3", "auto")])  # each window, each architecture
def test_documented_two_line_loop_runs_off_cuda_like_the_plain_loop(arch, window, caplog):
    """README's own loop (FlatAdamW + ``GraphedMicroStep(model, grad_accum=4, wgrad_window=...)``)
    on the CPU: eager calls, said once in the log, and the weights of the plain loop with torch
    AdamW after three steps (it used to raise ValueError off CUDA)."""
    from polyaccel.moe.optim import FlatAdamW

    def model():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny(arch), backend=BackendConfig(backend="cpu")).train()

    batches = torch.randint(3, 97, (3, 4, 2, 12), generator=torch.Generator().manual_seed(2))
    ref, start = model(), model().state_dict()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for batch in batches:
        for ids in batch:
            ref(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ours = model()
    with caplog.at_level("WARNING", logger="polyaccel.moe.fast_path"):
        step = GraphedMicroStep(ours, grad_accum=4, wgrad_window=window)
    opt = FlatAdamW(ours.parameters(), lr=1e-2, weight_decay=0.1, grads_overwritten=step.overwritten_params)
    assert step.overwritten_params  # the expert grads really are left to the micro-step
    for batch in batches:
        for ids in batch:
            step(input_ids=ids, labels=ids)
        opt.step()
        opt.zero_grad()
    assert not step.graphs and not any(k.graph for k in step.kinds.values())
    assert "CUDA graphs need CUDA" in caplog.text or not caplog.records  # said once per process
    for k, v in ref.state_dict().items():
        assert not torch.equal(v, start[k]) or k.endswith("e_score_correction_bias"), k  # trained
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_refuses_zero_warmup():
    with pytest.raises(ValueError, match="warmup"):
        GraphedMicroStep(torch.nn.Linear(2, 2), warmup=0)


def test_refuses_a_bad_window():
    with pytest.raises(ValueError, match="wgrad_window"):
        GraphedMicroStep(torch.nn.Linear(2, 2), wgrad_window=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("gate", "window", "positions"), [("learned", 1, False), ("balanced", 1, True),
                                                         ("learned", 2, True), ("learned", 3, True),
                                                         ("balanced", 4, True)])
def test_gpu_replays_equal_eager_steps(gate, window, positions):
    """Five optimizer steps of 3 micro-batches each, graphed and eager, give the same losses
    and parameters (bf16: the same kernels run; atomics may reorder sums). ``window``: expert
    weight gradients computed once per that many micro-batches (in both); ``positions``: calls say where
    they stand (the step's first expert gradients written over ``.grad``). In step 4 the middle
    micro-batch has another shape: it and the rest of its window run eagerly."""
    from polyaccel.moe.grouped_linear import defers, wgrad_window
    from polyaccel.moe.optim import FlatAdamW

    runs = {}
    for graphed, lr in ((False, 1e-3), (True, 1e-3), (False, 0.0)):  # lr=0: the negative control
        model = _model("cuda", "cuda", gate=gate).to(torch.bfloat16)
        opt = FlatAdamW(model.parameters(), lr=lr)
        step = GraphedMicroStep(model, warmup=1, wgrad_window=window) if graphed else None
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for s in range(5):
            for mb in range(3):
                ids = torch.randint(3, 97, (2, 24 if (s, mb) == (3, 1) else 32), device="cuda", generator=gen)
                if step is not None:
                    where = {"micro_batch": (mb, 3)} if positions else {}
                    losses.append(step(input_ids=ids, labels=ids, **where))
                else:  # eager, with the same windows (sums of the same products, rounded alike)
                    with wgrad_window(defer=defers(mb, 3, window)):
                        loss = model(input_ids=ids, labels=ids).loss
                        loss.backward()
                    losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
        if step is not None:  # every kind captured in step 2
            assert all(k.graph is not None for k in step.kinds.values())
            assert len(step.kinds) == (1 if not positions else 2 if window == 1 else 3)
        runs[graphed, lr] = (torch.stack(losses).double(), torch.cat([p.detach().double().flatten()
                                                                        for p in model.parameters()]))
    # Within 20% of what training changed (an lr=0 run, which must fail the same bounds): a fixed
    # bf16 tolerance wider than five Adam steps of ~lr each would pass an lr=0 run.
    (l_g, w_g), (l_e, w_e), (l_0, w_0) = runs[True, 1e-3], runs[False, 1e-3], runs[False, 0.0]
    moved, learned = (w_e - w_0).norm(), (l_e - l_0).abs().max()
    assert moved > 0 and learned > 0
    assert (w_g - w_e).norm() <= 0.2 * moved and (l_g - l_e).abs().max() <= 0.2 * learned
    assert (w_0 - w_e).norm() > 0.2 * moved and (l_0 - l_e).abs().max() > 0.2 * learned
