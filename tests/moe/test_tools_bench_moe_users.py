"""``tools/bench_moe_users.py --profile``: kernel names fall in the right categories, and a
profiled step reports its time by category and writes the profiler's table."""

from __future__ import annotations

import importlib.util
import json
import types
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_moe_users.py"


@pytest.fixture(scope="module")
def bench() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("bench_moe_users", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, want", [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("aten::addmm", "gemm"),
    ("_grouped_mm_kernel_persistent", "grouped_gemm"),
    ("_grouped_wgrad_kernel", "grouped_gemm"),
    ("pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("_linear_cross_entropy_fwd", "loss"),
    ("_adamw_flat_kernel", "optimizer"),
    ("_rms_norm_bwd_dx_fused", "norm"),
    ("_moe_permute_kernel", "routing"),
    ("void at::native::(anonymous namespace)::radixSortKVInPlace", "routing"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("triton_poi_fused_add_mul_silu_0", "other"),
])
def test_kernel_names_fall_in_their_category(bench, name, want):
    assert bench.category(name) == want


def test_a_profiled_step_reports_time_by_category_and_writes_the_table(bench, tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    a = types.SimpleNamespace(device="cpu", out_dir=str(tmp_path))
    x, w = torch.randn(256, 256), torch.randn(256, 256)

    def step() -> None:
        for _ in range(5):
            torch.nn.functional.layer_norm(x @ w, (256,))

    got = bench.profile_categories(step, a, "profile.txt")
    assert got["gemm"] > 0 and got["norm"] > 0 and list(got.values()) == sorted(got.values(), reverse=True)
    assert "aten::mm" in (tmp_path / "profile.txt").read_text()


def test_each_row_process_gets_the_weight_gradient_window(bench, tmp_path, monkeypatch, capsys):
    """``--wgrad-window`` and ``--wgrad-tiles`` reach the per-row processes (the window once
    stayed in the parent)."""
    seen = []

    def fake_run(cmd, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(cmd)
        row = {"shape": cmd[cmd.index("--one") + 1], "entry": "loop", "tokens_per_s": 1.0, "peak_gib": 1.0,
               "mfu_dense": 0.1}
        return types.SimpleNamespace(stdout=bench._MARK + __import__("json").dumps(row) + "\n", stderr="",
                                     returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.main(["--entries", "loop", "--wgrad-window", "2", "--wgrad-tiles", "one-per-program",
                       "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    assert seen and all("--wgrad-window=2" in cmd and "--wgrad-tiles=one-per-program" in cmd for cmd in seen)
    capsys.readouterr()


def test_config_overrides_reach_every_entrys_model(bench, tmp_path, monkeypatch):
    """``--config KEY=VALUE`` (shapes no preset has): the Transformers-side rows build the
    changed config, the CLI row gets it as ``--set model.config.KEY=VALUE``, and each row
    process is passed it."""
    config = bench.shape_config("qwen3-moe-tiny", 3, ["num_experts=6", "moe_intermediate_size=24"])
    assert (config.num_experts, config.moe_intermediate_size, config.num_hidden_layers) == (6, 24, 3)
    seen = []

    def fake_run(cmd, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(cmd)
        return types.SimpleNamespace(stdout='{"step_time_s": 1.0, "final_loss": 1.0, "peak_memory_gib": null}\n',
                                     stderr="", returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    a = types.SimpleNamespace(steps=1, warmup=1, seq=8, accum=1, device="cpu", layers=None,
                              config=["num_experts=6"])
    bench.cli_run("qwen3-moe-tiny", a)
    assert seen[-1][seen[-1].index("--set", seen[-1].index("train.device=cpu")) + 1] == "model.config.num_experts=6"
    seen.clear()

    def fake_row(cmd, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(cmd)
        row = {"shape": "s", "entry": "hf", "tokens_per_s": 1.0, "peak_gib": 1.0, "mfu_dense": 0.1}
        return types.SimpleNamespace(stdout=bench._MARK + __import__("json").dumps(row) + "\n", stderr="",
                                     returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_row)
    assert bench.main(["--entries", "hf", "--device", "cpu", "--config", "num_experts=6", "--config",
                       "hidden_size=48", "--out-dir", str(tmp_path)]) == 0
    assert seen and all("--config=num_experts=6" in c and "--config=hidden_size=48" in c for c in seen)


def test_variants_rerun_our_entries_with_their_environment_beside_the_plain_row(bench, tmp_path, monkeypatch,
                                                                                 capsys):
    """``--variant NAME:KEY=VALUE``: each of our entries runs again right after its plain row with
    the variable set in that row's process only (the peers once), and the rows and table say
    which variant each is."""
    seen = []

    def fake_run(cmd, **kwargs):  # noqa: ANN001, ANN003, ANN202
        env = kwargs.get("env") or {}
        seen.append((cmd[cmd.index("--one") + 2], env.get("POLYACCEL_X"), env.get("POLYACCEL_Y")))
        row = {"shape": "s", "entry": cmd[cmd.index("--one") + 2], "tokens_per_s": 100.0 + len(seen),
               "peak_gib": 1.0, "mfu_dense": 0.1}
        return types.SimpleNamespace(stdout=bench._MARK + json.dumps(row) + "\n", stderr="", returncode=0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.delenv("POLYACCEL_X", raising=False)
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--entries", "hf-compile,loop", "--device", "cpu", "--out-dir", str(tmp_path),
                       "--out", str(out), "--variant", "x:POLYACCEL_X=1,POLYACCEL_Y=a=b"]) == 0
    assert seen == [("hf-compile", None, None), ("loop", None, None), ("loop", "1", "a=b")]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("variant") for r in rows] == [None, None, "x"]
    assert rows[2]["env"] == {"POLYACCEL_X": "1", "POLYACCEL_Y": "a=b"}
    table = capsys.readouterr().out.splitlines()
    assert any("loop/x" in line and "1.02" in line for line in table)  # against the plain hf-compile row


@pytest.mark.parametrize("bad", ["x", "x:", ":K=1", "x:K", "x:1K=2", "a b:K=1"])
def test_a_malformed_variant_is_refused_before_any_row_runs(bench, tmp_path, monkeypatch, bad):
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a row ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--entries", "loop", "--device", "cpu", "--out-dir", str(tmp_path), "--variant", bad])
    assert e.value.code == 2


def test_repeated_variant_names_are_refused(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: pytest.fail("a row ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--entries", "loop", "--device", "cpu", "--out-dir", str(tmp_path),
                    "--variant", "x:A=1", "--variant", "x:A=2"])
    assert e.value.code == 2
