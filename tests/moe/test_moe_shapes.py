"""Our MoE models against Transformers' on shapes nobody tuned for: per architecture, a few
configurations drawn at random (seeded) from what the config allows: one expert or many, top-1
to top-all, with and without top-k renormalisation, widths that are not powers of two, tied
embeddings, one layer or several. fp32 logits, loss and gradients must match. The draw is
fixed by the seed so a failure reproduces; the shapes it made are in the test id."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny


def _draw(model_type: str, rng: random.Random) -> dict:
    heads = rng.choice([1, 2, 3, 4])
    kv = rng.choice([h for h in (1, heads) if heads % h == 0])
    head_dim = rng.choice([4, 6, 8])
    experts = rng.choice([1, 2, 3, 5, 8])
    top_k = rng.randint(1, experts)
    fields = dict(hidden_size=heads * head_dim * rng.choice([1, 2]) + rng.choice([0, 2]),
                  num_hidden_layers=rng.choice([1, 2]), num_attention_heads=heads,
                  num_key_value_heads=kv, num_experts_per_tok=top_k, vocab_size=rng.choice([61, 97, 128]),
                  tie_word_embeddings=rng.random() < 0.3)
    if model_type == "qwen3_moe":
        fields.update(head_dim=head_dim, num_experts=experts, moe_intermediate_size=rng.choice([5, 12, 16]),
                      norm_topk_prob=rng.random() < 0.5, mlp_only_layers=[], decoder_sparse_step=1)
    elif model_type == "mixtral":
        fields.update(num_local_experts=experts, intermediate_size=rng.choice([5, 12, 16]),
                      sliding_window=rng.choice([None, 5]))
        fields["hidden_size"] = heads * head_dim  # Mixtral's head_dim is hidden / heads
    elif model_type == "olmoe":
        fields.update(num_experts=experts, intermediate_size=rng.choice([5, 12, 16]),
                      norm_topk_prob=rng.random() < 0.5, clip_qkv=rng.choice([None, 3.0]))
        fields["hidden_size"] = heads * head_dim
    elif model_type == "deepseek_v3":
        groups = rng.choice([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2] or [1])
        fields.update(n_routed_experts=experts, n_shared_experts=rng.choice([0, 1, 2]), n_group=groups,
                      topk_group=rng.randint(1, groups), moe_intermediate_size=rng.choice([5, 12]),
                      intermediate_size=rng.choice([7, 16]), first_k_dense_replace=rng.choice([0, 1]),
                      q_lora_rank=rng.choice([None, 10]), kv_lora_rank=rng.choice([6, 12]),
                      qk_nope_head_dim=rng.choice([4, 8]), qk_rope_head_dim=rng.choice([2, 4]),
                      v_head_dim=rng.choice([3, 6]), routed_scaling_factor=rng.choice([1.0, 2.5]),
                      norm_topk_prob=rng.random() < 0.5, num_key_value_heads=heads)
        # Transformers needs every token's top-k inside its chosen groups
        fields["num_experts_per_tok"] = min(top_k, fields["topk_group"] * (experts // groups))
    return fields


CASES = [(arch, seed) for arch in ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3") for seed in range(5)]


def _id(case: tuple[str, int]) -> str:
    arch, seed = case
    f = _draw(arch, random.Random(f"{arch}-{seed}"))
    experts = f.get("num_experts") or f.get("num_local_experts") or f.get("n_routed_experts")
    return f"{arch}-seed{seed}-h{f['hidden_size']}-e{experts}k{f['num_experts_per_tok']}-L{f['num_hidden_layers']}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_random_shapes_match_transformers(case: tuple[str, int], tmp_path) -> None:
    arch, seed = case
    fields = _draw(arch, random.Random(f"{arch}-{seed}"))
    torch.manual_seed(seed)
    # Transformers eager experts: its grouped_mm path refuses widths that are not 16-byte multiples
    hf = transformers.AutoModelForCausalLM.from_config(tiny(arch, **fields), experts_implementation="eager").float()
    for name, buf in hf.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, backend=BackendConfig(backend="cpu"))
    hf.train(), ours.train()  # dropout is 0 in these configs; train() so the routers' aux losses are formed
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, fields["vocab_size"], (2, 11), generator=g)
    ref = hf(input_ids=ids, labels=ids, output_router_logits=True)
    out = ours(input_ids=ids, labels=ids, output_router_logits=True)  # the loss fused with the LM head
    torch.testing.assert_close(ours(input_ids=ids).logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    ref.loss.backward()
    out.loss.backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        q = mine[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=5e-6, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[::2], ids=[_id(c) for c in CASES[::2]])
def test_random_shapes_on_cuda_in_bf16(case: tuple[str, int], tmp_path) -> None:
    """The CUDA kernels (grouped GEMMs with widths padded to 16 bytes, Triton norms, SwiGLU,
    permutation, fused loss) in bf16 on the same shapes, against Transformers in fp32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    arch, seed = case
    fields = _draw(arch, random.Random(f"{arch}-{seed}"))
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(arch, **fields), experts_implementation="eager").float()
    hf.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                backend=BackendConfig(backend="cuda", compile=False)).cuda()
    ids = torch.randint(3, fields["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(seed))
    ref = hf(input_ids=ids, labels=ids)
    out = ours(input_ids=ids.cuda(), labels=ids.cuda())
    out.loss.backward()
    assert abs(out.loss.item() - ref.loss.item()) < 0.02 * ref.loss.item()
    logits = ours(input_ids=ids.cuda()).logits.float().cpu()
    assert (logits - ref.logits).abs().max() < 0.05 * ref.logits.abs().max() + 0.02
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in ours.parameters())


LORA_CASES = [(arch, seed) for arch in ("qwen3_moe", "mixtral", "olmoe") for seed in range(2)]


def _lora_pair(case: tuple[str, int], tmp_path, dtype: torch.dtype, backend: BackendConfig):
    """PEFT on Transformers (fp32) and PEFT on our model (``dtype``, ``backend``), with the same
    random adapters (B not zero: every path contributes), and a batch of ids."""
    peft = pytest.importorskip("peft")
    import copy

    from polyaccel.moe.lora import LoraSettings

    arch, seed = case
    rng = random.Random(f"lora-{arch}-{seed}")
    fields = _draw(arch, rng)
    settings = LoraSettings(r=rng.choice([1, 3, 4, 8]), alpha=rng.choice([1.0, 6.0, 16.0]), router=True)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(arch, **fields), experts_implementation="eager").float()
    hf.save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, backend=backend)
    config = settings.peft_config()
    config.init_lora_weights = False
    ref = peft.get_peft_model(hf, copy.deepcopy(config))
    ours = peft.get_peft_model(ours, copy.deepcopy(config))
    ours.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    ids = torch.randint(3, fields["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(seed))
    return ref, ours, ids


@pytest.mark.parametrize("case", LORA_CASES, ids=[f"{a}-seed{s}" for a, s in LORA_CASES])
def test_lora_on_random_shapes_matches_peft(case: tuple[str, int], tmp_path) -> None:
    """Expert LoRA inside our grouped path at ranks 1-8 (including ranks whose widths are not
    16-byte multiples) against PEFT on plain Transformers, which forms ``W + B·A``."""
    ref, ours, ids = _lora_pair(case, tmp_path, torch.float32, BackendConfig(backend="cpu"))
    want, got = ref(input_ids=ids, labels=ids).loss, ours(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want.backward()
    got.backward()
    mine = dict(ours.named_parameters())
    trained = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    assert trained and all(mine[n].requires_grad for n, _ in trained)
    for name, p in trained:
        torch.testing.assert_close(mine[name].grad, p.grad, atol=5e-6, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", LORA_CASES[::2], ids=[f"{a}-seed{s}" for a, s in LORA_CASES[::2]])
def test_lora_on_random_shapes_on_cuda_compiled(case: tuple[str, int], tmp_path) -> None:
    """The same LoRA shapes through the CUDA backend compiled (bf16 grouped GEMMs whose rank
    widths are padded to 16 bytes, traced by inductor) against PEFT on Transformers in fp32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref, ours, ids = _lora_pair(case, tmp_path, torch.bfloat16, BackendConfig(backend="cuda", compile=True))
    ours.cuda()
    want, got = ref(input_ids=ids, labels=ids).loss, ours(input_ids=ids.cuda(), labels=ids.cuda()).loss
    assert abs(got.item() - want.item()) < 0.02 * want.item()
    want.backward()
    got.backward()
    mine = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        if p.requires_grad:
            g, want_g = mine[name].grad.float().cpu().flatten(), p.grad.flatten()
            if want_g.norm() < 1e-6:  # e.g. the router of one expert: its weight is always 1
                assert g.norm() < 1e-3, name
                continue
            cos = torch.nn.functional.cosine_similarity(g, want_g, dim=0)
            assert cos > 0.98, (name, cos.item())
