"""LoRA on polyaccel MoE models (``polyaccel.moe.lora``): PEFT's adapters computed inside our
grouped expert path. Checked against PEFT's own implementation on plain Transformers (which
materializes ``W + B·A``): logits and every adapter gradient in fp32; adapter files and merged
checkpoints interchange both ways; ``compile=True`` runs; selective recomputation gives the
same gradients, runs each layer's forward exactly twice per step and, in a compiled layer,
compiles with its checkpoint (the bug it guards: the checkpoint call disabled dynamo for the
whole layer, so ``compile=True`` + ``selective`` ran eagerly); ``recompute="auto"``; the
memory estimate's parts match real parameter counts."""

from __future__ import annotations

import collections
import copy
import logging
import shutil

import pytest
import torch
import transformers

from polyaccel.core.kernels import registry
from polyaccel.moe import AutoModelForCausalLM, BackendConfig, lora, presets
from polyaccel.moe.lora import LoraSettings

peft = pytest.importorskip("peft")

SETTINGS = LoraSettings(r=4, alpha=8, router=True)


ARCHS = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]


def _pair(tmp_path, backend: BackendConfig, settings: LoraSettings = SETTINGS, arch: str = "qwen3_moe",
          **config):
    """(ours + PEFT, plain Transformers + PEFT) with the same random base and random adapters
    (``init_lora_weights=False``: B is not zero, so every path contributes); ``config``
    overrides the tiny preset's fields."""
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(presets.tiny(arch, **config), backend=backend)
    ours.save_pretrained(tmp_path / "base")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = settings.peft_config()
    config.init_lora_weights = False
    ours = peft.get_peft_model(ours, copy.deepcopy(config))
    ref = peft.get_peft_model(ref, copy.deepcopy(config))
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def _ids(batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(3, 97, (batch, seq), generator=torch.Generator().manual_seed(5))


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", [
    BackendConfig(loss="standard"),
    BackendConfig(loss="fused", grad_accumulation="autograd"),
    BackendConfig(experts="eager", loss="standard"),
], ids=["grouped-fused_accum", "grouped-autograd-fused_loss", "eager"])
def test_logits_and_gradients_equal_peft_reference(tmp_path, backend):
    ours, ref = _pair(tmp_path, backend)
    ids = _ids()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-5, atol=1e-6)
    if out.logits is not None:
        torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    got, want = _adapter_grads(ours), _adapter_grads(ref)
    assert got.keys() == want.keys() and len(got) == 3 * 4 * 2 + 2 * 3 * 2  # (A, B): q k v o x 3 layers; experts x2 + router x 2 MoE layers
    for name, g in want.items():
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_experts_never_materialize_and_frozen_weights_get_no_gradient(tmp_path, monkeypatch):
    ours, _ = _pair(tmp_path, BackendConfig(loss="standard"))

    def refuse(*args, **kwargs):
        raise AssertionError("PEFT formed W + B·A")

    monkeypatch.setattr(peft.tuners.lora.layer.ParamWrapper, "_activate_lora", refuse)
    wgrad_shapes = []
    real_wgrad = lora.ops.grouped_mm_wgrad

    def record(dy, x, offsets, *args, **kwargs):
        out = real_wgrad(dy, x, offsets, *args, **kwargs)
        wgrad_shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(lora.ops, "grouped_mm_wgrad", record)
    ids = _ids()
    ours(input_ids=ids, labels=ids).loss.backward()
    base = [p for n, p in ours.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad and p.grad is None for p in base)
    # only rank-r weight gradients: A [E, r, K] and B [E, O, r], never an [E, O, K] base one
    assert wgrad_shapes and all(4 in s[1:] for s in wgrad_shapes)
    assert len(wgrad_shapes) == 2 * 2 * 2  # (A, B) x (gate_up, down) x 2 MoE layers


def _compiled_layers(model, backend: str = "aot_eager") -> None:
    for layer in model.base_model.model.model.layers:
        layer.compile(backend=backend)


# The compiled-layer tests run two layers, an MoE one and a dense one (qwen3_moe's tiny preset has a
# second MoE layer after them: one more compile of the first's code, ~5 s on CPU, nothing new).
TWO_LAYERS = dict(num_hidden_layers=2, mlp_only_layers=[1])


@pytest.mark.parametrize("grad_accumulation", ["fused", "autograd"])
def test_compile_with_lora_runs_forward_and_backward(tmp_path, grad_accumulation):
    torch._dynamo.reset()
    ours, ref = _pair(tmp_path, BackendConfig(compile=True, loss="standard", grad_accumulation=grad_accumulation),
                      **TWO_LAYERS)
    assert [hasattr(layer.mlp, "experts") for layer in ours.base_model.model.model.layers] == [True, False]
    _compiled_layers(ours)  # BackendConfig(compile=True) compiled with inductor; aot_eager is quicker on CPU
    ids = _ids()
    for _ in range(2):  # the second call runs the compiled graphs
        ours.zero_grad()
        out = ours(input_ids=ids, labels=ids)
        out.loss.backward()
    ref_out = ref(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-5)
    got = _adapter_grads(ours)
    for name, g in _adapter_grads(ref).items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype of every matmul over ``rows`` token rows."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows, self.dtypes = rows, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm") and args[-2].shape[0] == self.rows:
            self.dtypes.append(args[-2].dtype)
        return func(*args, **(kwargs or {}))


def test_attention_lora_computes_in_the_input_dtype(tmp_path):
    """``apply_lora``/``load_adapter`` make PEFT's ``lora.Linear`` (q/k/v/o) compute in the input's
    dtype: fp32 models give PEFT's numbers exactly; in a bf16 model no token-row matmul runs in
    fp32 (PEFT casts every input up to fp32: fp32 GEMMs, 7% of the 24-layer H200 step)."""
    ours, ref = _pair(tmp_path, BackendConfig(loss="standard"))
    assert lora.compute_linear_lora_in_input_dtype(ours) == 4 * 3
    assert lora.compute_linear_lora_in_input_dtype(ours) == 0  # once
    ids = _ids()
    out, want = ours(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    got = _adapter_grads(ours)
    for name, g in _adapter_grads(ref).items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    for model in (ours, ref):
        for name, p in model.named_parameters():
            if "lora_" not in name:
                p.data = p.data.to(torch.bfloat16)
    dtypes = {}
    for label, model in (("ours", ours), ("peft", ref)):
        with _MatmulDtypes(ids.numel()) as seen:
            model(input_ids=ids, labels=ids).loss.backward()
        dtypes[label] = set(seen.dtypes)
    assert dtypes["ours"] == {torch.bfloat16}, dtypes
    assert torch.float32 in dtypes["peft"], dtypes  # the control: PEFT's own forward does
    assert all(p.grad.dtype == torch.float32 for n, p in ours.named_parameters() if "lora_" in n)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                    reason="inductor on the CPU needs a C++ compiler")
def test_expert_factor_layout_survives_inductor():
    """PEFT's expert ``lora_B`` [O, r*E] reordered to [E, O, r] and fed to ``_grouped_mm``
    inside an inductor-compiled function: traced as ``permute().contiguous()`` inductor dropped
    the copy and ``_grouped_mm`` got an operand with no unit stride ("Invalid strides/sizes";
    the whole 48-layer LoRA run crashed on the H200). Forward and gradients equal eager."""
    E, r, out_dim, K, N = 4, 8, 16, 16, 32
    gen = torch.Generator().manual_seed(0)
    b_weight = torch.randn(out_dim, r * E, generator=gen, requires_grad=True)
    x = torch.randn(N, K, generator=gen).to(torch.bfloat16)
    a = torch.randn(E, r, K, generator=gen).to(torch.bfloat16)
    w = torch.randn(N, out_dim, generator=gen).to(torch.bfloat16)
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * (N // E)

    def delta(b_weight):
        b = lora._expert_major(b_weight.to(torch.bfloat16), E)
        xa = torch._grouped_mm(x, a.transpose(1, 2), offsets)
        return torch._grouped_mm(xa, b.transpose(1, 2), offsets)

    want = delta(b_weight)
    (want * w).sum().backward()
    want_grad, b_weight.grad = b_weight.grad, None
    torch._dynamo.reset()
    got = torch.compile(delta, backend="inductor", fullgraph=True)(b_weight)
    (got * w).sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(b_weight.grad, want_grad)
    per_expert = b_weight.detach().view(out_dim, r, E)
    for e in range(E):
        torch.testing.assert_close(lora._expert_major(b_weight.detach(), E)[e], per_expert[:, :, e])


def _spy_on_recompute_policy(monkeypatch) -> list[tuple[str, str]]:
    """The (op name, decision) of every call of the selective recomputation policy from now on."""
    decisions = []
    real_policy = lora.selective_recompute_policy

    def spying_policy(cheap_k):
        policy = real_policy(cheap_k)

        def spy(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            decisions.append((lora._op_name(op), decision.name))
            return decision

        return spy

    monkeypatch.setattr(lora, "selective_recompute_policy", spying_policy)
    return decisions


def _selective_step_equals_peft(tmp_path, monkeypatch) -> list[tuple[str, str]]:
    """One backward of ours under selective recomputation against PEFT's reference (adapter
    gradients equal); returns the policy's (op name, decision) calls."""
    ours, ref = _pair(tmp_path, BackendConfig(loss="standard"))
    ours.train()
    decisions = _spy_on_recompute_policy(monkeypatch)
    lora.enable_selective_recompute(ours)
    ids = _ids()
    ours(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    got = _adapter_grads(ours)
    for name, g in _adapter_grads(ref).items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    return decisions


def test_selective_recompute_gives_the_same_gradients(tmp_path, monkeypatch):
    decisions = _selective_step_equals_peft(tmp_path, monkeypatch)
    kept = {n for n, d in decisions if d == "MUST_SAVE"}
    recomputed = {n for n, d in decisions if d == "PREFER_RECOMPUTE"}
    assert "mm" in kept and "mm" in recomputed  # base GEMMs kept, rank-r LoRA GEMMs recomputed
    assert {"rsqrt", "silu"} <= recomputed  # norms and SwiGLU


# ---- interchange -----------------------------------------------------------------------------


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_saved_by_ours_loads_in_plain_peft_transformers(tmp_path, arch):
    ours, _ = _pair(tmp_path, BackendConfig(), arch=arch)
    ours.save_pretrained(tmp_path / "adapter")
    ids = _ids()
    want = _logits(ours, ids)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    plain = peft.PeftModel.from_pretrained(plain, tmp_path / "adapter")
    torch.testing.assert_close(_logits(plain, ids), want, rtol=1e-5, atol=1e-5)
    base_only = _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ids)
    assert (base_only - want).abs().max() > 1e-3  # the adapter matters


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_trained_by_plain_peft_loads_into_ours(tmp_path, arch):
    _, ref = _pair(tmp_path, BackendConfig(), arch=arch)
    ref.save_pretrained(tmp_path / "adapter")
    ids = _ids()
    want = _logits(ref, ids)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ours = lora.load_adapter(ours, str(tmp_path / "adapter"), trainable=False)
    torch.testing.assert_close(_logits(ours, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_and_save_writes_a_plain_checkpoint(tmp_path, arch):
    """Our merge-and-save writes the files PEFT's merge on plain Transformers writes."""
    from safetensors.torch import load_file

    ours, ref = _pair(tmp_path, BackendConfig(), arch=arch)
    ids = _ids()
    want = _logits(ours, ids)
    merged = ours.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    ref.merge_and_unload().save_pretrained(tmp_path / "peft_merged")
    ours_files, peft_files = (load_file(tmp_path / d / "model.safetensors") for d in ("merged", "peft_merged"))
    assert ours_files.keys() == peft_files.keys()
    for k, v in peft_files.items():
        torch.testing.assert_close(ours_files[k], v, rtol=1e-6, atol=1e-7, msg=k)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(_logits(plain, ids), want, rtol=1e-4, atol=1e-5)


# ---- settings and memory -----------------------------------------------------------------------


def test_settings_refuse_what_peft_cannot_do():
    with pytest.raises(ValueError, match="dropout"):
        LoraSettings(dropout=0.1)
    assert LoraSettings(dropout=0.1, experts=False).peft_config().lora_dropout == 0.1
    with pytest.raises(ValueError, match="recompute"):
        LoraSettings(recompute="all")


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "mixtral"])
def test_adapter_count_formula_matches_peft(tmp_path, arch):
    config = presets.tiny(arch, **({"mlp_only_layers": []} if arch == "qwen3_moe" else {}))
    model = AutoModelForCausalLM.from_config(config)
    model = lora.apply_lora(model, SETTINGS)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora.lora_param_count(config, SETTINGS) == trainable


@pytest.mark.parametrize("preset", ["qwen3_30b_a3b", "olmoe_1b_7b", "mixtral_8x7b"])
def test_weight_formula_matches_the_real_model(preset):
    config = getattr(presets, preset)(num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(lora._base_param_counts(config)) == sum(p.numel() for p in model.parameters())


def test_whole_qwen3_30b_a3b_fits_one_h200_at_seq_4096():
    config = presets.qwen3_30b_a3b(num_hidden_layers=48)
    settings = LoraSettings(r=16, alpha=32, recompute="selective")
    est = lora.estimate_lora_memory(config, 4096, settings)
    assert 56 < est["weights"] < 58  # ~30.5B bf16 parameters, no fp32 copy
    assert est["total"] < 130, est
    none = dataclasses_replace(settings, recompute="none")
    eager = lora.estimate_lora_memory(config, 4096, none, compiled=False)
    assert eager["activations"] > 2 * lora.estimate_lora_memory(config, 4096, settings, compiled=False)["activations"]
    # compiled layers (the CUDA default) save about the GEMM outputs: measured on the H200
    # (2026-12-01) 46.85 GiB at 24 layers and 90.65 GiB at 48 without recomputation
    compiled = lora.estimate_lora_memory(config, 4096, none)
    assert 90.65 < compiled["total"] < 90.65 * 1.1, compiled
    assert compiled["activations"] < eager["activations"] / 2


def dataclasses_replace(settings: LoraSettings, **changes) -> LoraSettings:
    import dataclasses

    return dataclasses.replace(settings, **changes)


# ---- selective recomputation: how often, and compiled -----------------------------------------
def _count_layer_pieces(model) -> collections.Counter:
    """Forward calls per (layer, piece): attention's q-norm, the router, the experts' base module."""
    calls: collections.Counter = collections.Counter()
    for layer_idx, layer in enumerate(model.base_model.model.model.layers):
        pieces = {"q_norm": layer.self_attn.q_norm}
        if hasattr(layer.mlp, "experts"):
            pieces["router"] = lora.unwrap_peft(layer.mlp.gate)[0]
            pieces["experts"] = lora.unwrap_peft(layer.mlp.experts)[0]
        for piece, module in pieces.items():
            module.register_forward_pre_hook(lambda m, a, key=(layer_idx, piece): calls.update([key]))
    return calls


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_each_layer_forward_runs_once_or_twice_per_step(tmp_path, recompute):
    ours, _ = _pair(tmp_path, BackendConfig(loss="standard", compile=False))
    ours.train()
    if recompute == "selective":
        lora.enable_selective_recompute(ours)
        lora.enable_selective_recompute(ours)  # idempotent: no nested checkpoint
    calls = _count_layer_pieces(ours)
    ids = _ids()
    for _ in range(2):
        calls.clear()
        ours(input_ids=ids, labels=ids).loss.backward()
        want = 2 if recompute == "selective" else 1  # forward (+ one recompute in the backward)
        assert calls and set(calls.values()) == {want}, dict(calls)


# ---- compiled layers ---------------------------------------------------------------------------


def _groups(offsets: torch.Tensor, n: int) -> torch.Tensor:
    return torch.searchsorted(offsets.to(torch.int64), torch.arange(n, device=offsets.device), right=True)


def _traceable_grouped_mm(x, w, offsets):
    """core's ``grouped_mm`` without its host sync (``offsets.tolist()``), as CUDA's is: per-row
    expert weights gathered (tiny shapes only)."""
    g = _groups(offsets, x.shape[0])
    y = torch.einsum("nk,nok->no", x, w[g.clamp(max=w.shape[0] - 1)])
    return torch.where((g < w.shape[0])[:, None], y, 0)


def _traceable_grouped_mm_wgrad(dy, x, offsets, out=None, accumulate=True):
    assert out is None
    g, E = _groups(offsets, dy.shape[0]), offsets.numel()
    return dy.new_zeros(E + 1, dy.shape[1], x.shape[1]).index_add_(
        0, g.clamp(max=E), dy[:, :, None] * x[:, None, :])[:E]


@pytest.fixture
def sync_free_cpu_ops():
    """CPU stand-ins for the CUDA backend's device grouped GEMMs (no host sync), so dynamo can
    trace a whole layer on CPU as it does on CUDA."""
    registry.register("grouped_mm", "cpu", _traceable_grouped_mm, impl="test")
    registry.register("grouped_mm_wgrad", "cpu", _traceable_grouped_mm_wgrad, impl="test")
    yield
    registry.unregister("grouped_mm", "cpu")
    registry.unregister("grouped_mm_wgrad", "cpu")


def test_compiled_selective_layer_compiles_with_its_checkpoint(tmp_path, sync_free_cpu_ops):
    """Each compiled layer is one graph holding the checkpoint (dynamo's
    ``tag_activation_checkpoint``), no graph break, no recompile after the first step; the
    adapter gradients equal PEFT's reference. Before the fix dynamo traced no frame at all."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # grad_accumulation="fused" (the default) used to route the experts through a
    # torch.compiler.disable'd call: a graph break that sends the whole checkpoint to eager
    ours, ref = _pair(tmp_path, BackendConfig(compile=False, loss="standard", grad_accumulation="fused"),
                      **TWO_LAYERS)
    assert [hasattr(layer.mlp, "experts") for layer in ours.base_model.model.model.layers] == [True, False]
    ours.train()
    lora.enable_selective_recompute(ours)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    for layer in ours.base_model.model.model.layers:
        layer.compile(backend=backend)
    ids = _ids()
    frames = []
    for _ in range(3):
        ours.zero_grad()
        ours(input_ids=ids, labels=ids).loss.backward()
        frames.append(counters["frames"]["total"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert frames[0] > 0, "dynamo traced nothing: the checkpointed layers ran eagerly"
    assert frames[1] == frames[2] == frames[0], frames  # nothing recompiled after the first step
    assert graphs and all("tag_activation_checkpoint" in str(gm.graph) for gm in graphs)
    ref(input_ids=ids, labels=ids).loss.backward()
    got = _adapter_grads(ours)
    for name, g in _adapter_grads(ref).items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


# ---- recompute: auto -----------------------------------------------------------------------------


def test_auto_recompute_picks_by_the_estimate_and_says_why(caplog):
    auto = LoraSettings(r=16, alpha=32, recompute="auto")
    caplog.set_level(logging.INFO, logger="polyaccel.moe.lora")
    # GiB without recomputation, compiled layers: 47.6 / 92.3 / ~163 (seq 16384); eager layers at 48: 122.4
    for layers, seq, compiled, want in ((24, 4096, True, "none"), (48, 4096, True, "none"),
                                        (48, 16384, True, "selective"), (48, 4096, False, "selective")):
        caplog.clear()
        config = presets.qwen3_30b_a3b(num_hidden_layers=layers)
        got = lora.resolve_recompute(auto, config, seq, device_memory_gib=139.8, compiled=compiled)
        assert got.recompute == want and got.r == 16
        assert f"lora.recompute=auto -> {want}" in caplog.text and "GiB" in caplog.text
    fixed = LoraSettings(recompute="selective")
    assert lora.resolve_recompute(fixed, presets.qwen3_30b_a3b(), 4096, device_memory_gib=1e6) is fixed


def test_auto_recompute_estimates_olmoe_and_mixtral_and_plays_safe_on_others(caplog):
    auto = LoraSettings(r=16, alpha=32, recompute="auto")
    caplog.set_level(logging.INFO, logger="polyaccel.moe.lora")
    for config in (presets.olmoe_1b_7b(), presets.mixtral_8x7b(num_hidden_layers=4)):
        caplog.clear()
        assert lora.resolve_recompute(auto, config, 4096, device_memory_gib=139.8).recompute == "none"
        assert "estimated peak without recomputation" in caplog.text
        assert lora.resolve_recompute(auto, config, 4096, device_memory_gib=4.0).recompute == "selective"
    caplog.clear()
    deepseek = presets.tiny("deepseek_v3")
    assert lora.resolve_recompute(auto, deepseek, 4096, device_memory_gib=139.8).recompute == "selective"
    assert "no memory estimate for this config" in caplog.text


def test_auto_recompute_on_cpu_is_none(caplog):
    caplog.set_level(logging.INFO, logger="polyaccel.moe.lora")
    model = AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe"))
    model = lora.apply_lora(model, LoraSettings(r=4, alpha=8, recompute="auto"), seq_len=16)
    assert not any(getattr(m, "_polyaccel_selective", False) for m in model.modules())
    assert "lora.recompute=auto -> none" in caplog.text


def test_attention_adapter_in_input_dtype_keeps_peft_dropout_and_scale():
    """``compute_linear_lora_in_input_dtype``'s forward is PEFT's ``lora.Linear`` forward: same
    output in training with dropout (same RNG draw) and in eval, with the ``alpha / r`` scale."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"),
                                             dtype=torch.float32)
    model = lora.apply_lora(model, LoraSettings(r=4, alpha=12, dropout=0.5, experts=False, recompute="none"))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert getattr(layer, "_polyaccel_lora_forward", False) and float(layer.scaling["default"]) == 3.0
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # PEFT starts B at zero
    x = torch.randn(2, 5, layer.in_features)
    for training in (True, False):
        layer.train(training)
        torch.manual_seed(3)
        ours = layer(x)
        torch.manual_seed(3)
        theirs = type(layer).forward(layer, x)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    layer.train(True)
    torch.manual_seed(3)
    assert not torch.allclose(layer(x), layer.eval()(x), atol=1e-4)  # dropout really acts in training


def test_merged_adapters_are_not_added_twice():
    """After PEFT's ``merge_adapter()`` the expert and router deltas live in the base weights:
    the grouped path must stop adding them (same logits as unmerged), and ``unmerge_adapter()``
    brings the factors back."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"),
                                             dtype=torch.float32)
    model = lora.apply_lora(model, LoraSettings(r=4, alpha=8, target_modules=[], experts=True, router=True,
                                                recompute="none"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    model.eval()
    ids = _ids()
    base = model.get_base_model()
    with torch.no_grad(), model.disable_adapter():
        plain = base(input_ids=ids).logits
    with torch.no_grad():
        unmerged = base(input_ids=ids).logits
        assert not torch.allclose(unmerged, plain, atol=1e-3)  # the adapters change the output
        model.merge_adapter()
        merged = base(input_ids=ids).logits
        model.unmerge_adapter()
        again = base(input_ids=ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again, unmerged, rtol=1e-4, atol=1e-5)


def _merged_reference(x, weight, offsets, factors):
    """Per group ``x_g @ (W_g + sum s * B_g A_g).T``: what PEFT's merged weight computes."""
    out, start = [], 0
    for g, end in enumerate(offsets.tolist()):
        w = weight[g] + sum(f.scale * f.B[g] @ f.A[g] for f in factors)
        out.append(x[start:end] @ w.T)
        start = end
    return torch.cat(out + [x.new_zeros(x.shape[0] - start, weight.shape[1])])


@pytest.mark.parametrize("adapters", [1, 2])
@pytest.mark.parametrize("gathered", [False, True])
def test_grouped_lora_linear_equals_the_merged_weight(adapters, gathered):
    """``grouped_lora_linear`` (the base GEMM with the adapter's product added in place, and its
    data gradient added into the base one in the backward) against ``x @ (W + s·B·A).T`` per
    group: output and the gradients of x, a trainable base weight and every factor, with an
    empty group, rows past the last group, and a second active adapter (its delta added)."""
    gen = torch.Generator().manual_seed(adapters * 2 + gathered)
    E, K, N, r = 5, 12, 10, 3
    counts = torch.tensor([4, 0, 7, 3, 5])
    offsets = counts.cumsum(0).to(torch.int32)
    source = torch.randn(9, K, dtype=torch.float64, generator=gen)
    rows = torch.randint(0, 9, (int(counts.sum()) + 2,), generator=gen)
    leaves = {"x": source[rows].clone(), "weight": torch.randn(E, N, K, dtype=torch.float64, generator=gen)}
    for i in range(adapters):
        leaves[f"A{i}"] = torch.randn(E, r, K, dtype=torch.float64, generator=gen)
        leaves[f"B{i}"] = torch.randn(E, N, r, dtype=torch.float64, generator=gen)
    grad_out = torch.randn(rows.numel(), N, dtype=torch.float64, generator=gen)

    def run(fn):
        ts = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        factors = [lora.LoraFactors(ts[f"A{i}"], ts[f"B{i}"], 0.5 + i) for i in range(adapters)]
        y = fn(ts, factors)
        y.backward(grad_out)
        return y.detach(), {k: t.grad for k, t in ts.items()}

    def ours(ts, factors):
        # gathered_from: the backward re-gathers x from (source, rows), so x must be exactly that
        return lora.grouped_lora_linear(ts["x"], ts["weight"], offsets, factors,
                                        gathered_from=(source, rows) if gathered else None)

    got, got_grads = run(ours)
    want, want_grads = run(lambda ts, factors: _merged_reference(ts["x"], ts["weight"], offsets, factors))
    torch.testing.assert_close(got, want)
    for name in leaves:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=name)


@pytest.mark.gpu
def test_gpu_grouped_lora_linear_compiled_equals_eager():
    """The fused base + adapter grouped linear inside ``torch.compile`` (its in-place add is an
    opaque mutating op the compiler must keep) equals eager, forward and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from polyaccel.core.plugins import select_backend

    select_backend("cuda")  # registers the CUDA kernels: torch._grouped_mm, the Triton in-place add
    torch.manual_seed(0)
    E, K, N, r, T = 16, 512, 768, 16, 4096
    counts = (torch.distributions.Dirichlet(torch.full((E,), 0.5)).sample() * T).floor().long()
    counts[-1] += T - counts.sum()  # every row in a group (torch._grouped_mm leaves rows past them unwritten)
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    A = (torch.randn(E, r, K, device="cuda") / K**0.5).requires_grad_()
    B = torch.randn(E, N, r, device="cuda").requires_grad_()
    g = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        xl = x.clone().requires_grad_()
        y = fn(xl, A, B)
        grads = torch.autograd.grad(y, [xl, A, B], g)
        return y, grads

    def layer(x, A, B):
        f = lora.LoraFactors(A.to(torch.bfloat16), B.to(torch.bfloat16), 2.0)
        return torch.nn.functional.silu(lora.grouped_lora_linear(x, weight, offsets, [f]))

    want, want_grads = run(layer)
    torch._dynamo.reset()
    got, got_grads = run(torch.compile(layer, fullgraph=True))
    for a, b in zip((got, *got_grads), (want, *want_grads), strict=True):
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() < 1e-2


@pytest.fixture
def one_op_grouped_mm():
    """core's ``grouped_mm`` on CPU as one aten op (``torch._grouped_mm``), as on CUDA: the op
    selective recomputation sees, keeps and hands back in the recompute."""
    registry.register("grouped_mm", "cpu", lambda x, w, offsets: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
                      impl="test")
    yield
    registry.unregister("grouped_mm", "cpu")


def test_selective_recompute_with_a_one_op_grouped_gemm(tmp_path, one_op_grouped_mm, monkeypatch):
    """The base grouped GEMM's output is what selective recomputation keeps (a GEMM with a
    large reduction dim) and hands back when the layer is recomputed. Adding the adapter's
    product into that very tensor in place (in the first forward) made the recompute either
    refuse the mutated cache entry or add the product twice; the base GEMM and the add are now
    one functional op. Adapter gradients equal PEFT's reference."""
    decisions = _selective_step_equals_peft(tmp_path, monkeypatch)
    kept = {name for name, decision in decisions if decision == "MUST_SAVE"}
    assert "grouped_mm_plus_lowrank" in kept  # the experts' base GEMM output (adapter added) is kept
