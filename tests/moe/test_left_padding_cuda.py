"""A left-padded batch on CUDA: our models' loss and gradients equal Transformers' there too.

A padding query that sees no key gets a zero attention output in Transformers (torch's fused
SDPA kernels give zeros for a fully masked row); ours lets it attend everywhere (so no kernel
sees a fully masked row) and zeroes its output after. The CPU equivalence suite checks the
same on CPU; here the CUDA SDPA kernels run, in fp32 (compared) and bf16 (finite).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from polyaccel.moe import AutoModelForCausalLM, BackendConfig
from polyaccel.moe.presets import tiny

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _left_padded_batch(pad: int = 3, S: int = 24):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 97, (2, S), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids[0, :pad] = 0
    return ids.cuda(), mask.cuda(), ids.masked_fill(mask == 0, -100).cuda()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_left_padded_loss_and_gradients_match_transformers_on_cuda(model_type, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny(model_type), attn_implementation="sdpa")
    hf.save_pretrained(tmp_path)
    hf = hf.cuda()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                        backend=BackendConfig(compile=False)).cuda()
    ids, mask, labels = _left_padded_batch()
    ref = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
    out = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    ref.backward()
    out.backward()
    grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, atol=2e-5, rtol=1e-3, msg=name)


def test_left_padded_bf16_step_is_finite(tmp_path):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny("qwen3_moe")).save_pretrained(tmp_path)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                        backend=BackendConfig(compile=False)).cuda()
    ids, mask, labels = _left_padded_batch(pad=7)
    loss = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(bool(torch.isfinite(p.grad).all()) for p in ours.parameters() if p.grad is not None)
