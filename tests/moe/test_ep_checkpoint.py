"""Checkpoints under expert parallelism (2 gloo processes, this file re-run as a script):
``from_pretrained(parallel=ParallelPlan(dp=2, ep=2))`` reads only each rank's experts
(per-expert HF keys of Qwen3-MoE, OLMoE, DeepSeek-V3, Mixtral's renamed keys, or fused keys
through ``get_slice``) and computes what Transformers computes; saving gathers to rank 0 and writes per-expert HF keys that plain
Transformers loads with identical tensors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen3_moe_fused")
BUMP = 0.01  # added to every weight under EP before saving


def _is_expert_key(key: str) -> bool:
    return ".experts." in key


def _make_checkpoints(root: Path) -> dict:
    """Plain Transformers checkpoints (per-expert keys), one rewritten with fused expert keys;
    the reference logits and the bytes of expert and other tensors of each."""
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    from polyaccel.moe.presets import tiny

    facts = {}
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    for case in CASES:
        model_type = case.removesuffix("_fused")
        torch.manual_seed(1)
        hf = transformers.AutoModelForCausalLM.from_config(tiny(model_type)).eval()
        path = root / case
        hf.save_pretrained(path)
        if case.endswith("_fused"):  # Transformers v5's in-memory layout: gate_up_proj [E, 2I, H]
            sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
            assert any(k.endswith("experts.gate_up_proj") for k in sd)
            save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        sizes = {"expert": 0, "other": 0}
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                sizes["expert" if _is_expert_key(k) else "other"] += t.numel() * t.element_size()
        with torch.no_grad():
            logits = hf(input_ids=ids).logits
        facts[case] = {"sizes": sizes, "logits": logits, "ids": ids,
                       "state": {k: v.clone() for k, v in hf.state_dict().items()},
                       "params": {k for k, _ in hf.named_parameters()}}
    torch.save(facts, root / "facts.pt")
    return facts


class _CountingOpen:
    """``safetensors.safe_open`` that counts the bytes of every tensor and slice read."""

    read = 0

    def __init__(self, real, *args, **kwargs):
        self._f = real(*args, **kwargs)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_tensor(self, key):
        t = self._f.get_tensor(key)
        _CountingOpen.read += t.numel() * t.element_size()
        return t

    def get_slice(self, key):
        sl = self._f.get_slice(key)

        class _Slice:
            def __getitem__(self, item):
                t = sl[item]
                _CountingOpen.read += t.numel() * t.element_size()
                return t

        return _Slice()


def _worker(rank: int, port: int, root: Path) -> None:
    import safetensors
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from polyaccel.core.parallel import ParallelPlan
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig
    from polyaccel.moe.ep_checkpoint import save_pretrained
    from polyaccel.moe.expert_parallel import expert_modules

    torch.set_num_threads(1)
    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: _CountingOpen(real, *a, **k)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    facts = torch.load(root / "facts.pt", weights_only=False)
    for case in CASES:
        _CountingOpen.read = 0
        # olmoe passes the meshes (device_mesh=) instead of the plan
        layout = ({"device_mesh": ParallelPlan(dp=2, ep=2).build(2, "cpu")} if case == "olmoe"
                  else {"parallel": ParallelPlan(dp=2, ep=2)})
        model, info = AutoModelForCausalLM.from_pretrained(
            root / case, dtype=torch.float32, **layout, output_loading_info=True,
            backend=BackendConfig(backend="cpu", loss="standard", dispatcher="nccl_a2a"))
        assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}, info
        assert model.parallel_plan.ep == 2 and model.device_mesh.moe["ep"].size() == 2
        sizes = facts[case]["sizes"]
        assert _CountingOpen.read == sizes["other"] + sizes["expert"] // 2, (case, _CountingOpen.read, sizes)
        experts = expert_modules(model)[0]
        assert experts.gate_up_proj.to_local().shape[0] in (4, 2)  # 4 local experts (FSDP-sharded on dim 1)
        assert experts.gate_up_proj.shape[0] == 8  # the DTensor's global shape
        with torch.no_grad():
            logits = model(input_ids=facts[case]["ids"]).logits
        torch.testing.assert_close(logits, facts[case]["logits"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, c=case: f"{c} logits: {m}")
        for m in model.modules():  # back to the sharded parameters before editing them
            if isinstance(m, FSDPModule):
                m.reshard()
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().add_(BUMP)
        save_pretrained(model, root / f"{case}_saved")
    dist.barrier()
    dist.destroy_process_group()
    print("worker ok", rank, flush=True)



@pytest.mark.timeout(150)
def test_ep_load_reads_own_experts_and_save_round_trips(tmp_path, free_port):
    """(e): bytes read per rank = non-expert bytes + half the expert bytes; logits equal
    Transformers'; the EP save loads in plain Transformers with identical tensors."""
    import transformers
    from safetensors import safe_open

    facts = _make_checkpoints(tmp_path)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=130)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0 and "worker ok" in log, log[-4000:]

    for case in CASES:
        saved = tmp_path / f"{case}_saved"
        with safe_open(str(saved / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        with safe_open(str(tmp_path / case.removesuffix("_fused") / "model.safetensors"), "pt") as g:
            assert keys == set(g.keys())  # per-expert HF keys, whatever layout was read
        assert not any(k.endswith("gate_up_proj") for k in keys)
        back = transformers.AutoModelForCausalLM.from_pretrained(saved)
        state = back.state_dict()
        assert state.keys() == facts[case]["state"].keys()
        for k, v in facts[case]["state"].items():  # parameters were bumped, buffers not
            assert torch.equal(state[k], v + BUMP if k in facts[case]["params"] else v), (case, k)
        assert json.loads((saved / "config.json").read_text())["model_type"] == case.removesuffix("_fused")
        shutil.rmtree(saved)


def test_ep_load_needs_a_process_group(tmp_path):
    from polyaccel.core.parallel import ParallelPlan
    from polyaccel.moe import AutoModelForCausalLM
    from polyaccel.moe.presets import tiny

    with pytest.raises(RuntimeError, match=r"expert parallelism \(ep=2\) needs torch.distributed initialised"):
        AutoModelForCausalLM.from_config(tiny("qwen3_moe"), parallel=ParallelPlan(dp=2, ep=2))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
    sys.stdout.flush()
    os._exit(0)  # skips the gloo teardown, which at times aborts a finished worker (exit -6)
