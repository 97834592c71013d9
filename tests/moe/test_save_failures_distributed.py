"""A checkpoint that cannot be written under torchrun (2 CPU ranks, gloo): whichever rank's
write fails, every rank leaves the save together and exits 4 with the one line that names
where the trained weights are (``output_dir`` at the final step, else a rescue folder next
to it), no ``step_N.tmp`` is left, and the same command, rerun, resumes from the last intact
checkpoint. The full disk is a ``sitecustomize`` on the ranks' ``PYTHONPATH`` that fails
writes under one folder, on the ranks named, from a given step's checkpoint on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
SOURCES = [REPO / "packages" / p / "src" for p in ("core", "backend_cuda", "moe", "asr")]

_FULL_DISK = '''
import os, re
from pathlib import Path

if os.environ.get("FULL_DISK") and "RANK" in os.environ:  # the ranks, not the torchrun launcher
    import torch
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    disk = Path(os.environ["FULL_DISK"]).resolve()
    ranks = os.environ["FULL_DISK_RANKS"].split(",")
    from_step = int(os.environ["FULL_DISK_FROM_STEP"])

    def full(f):
        m = re.search(r"step_(\\d+)", str(f))
        return (os.environ["RANK"] in ranks and Path(f).resolve().is_relative_to(disk)
                and (m is None or int(m.group(1)) >= from_step))

    real_st, real_ts = mu.safe_save_file, torch.save

    def safe_save_file(tensors, filename, *a, **k):
        if full(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_st(tensors, filename, *a, **k)

    def save(obj, f, *a, **k):
        if isinstance(f, (str, os.PathLike)) and full(f):
            raise OSError(28, "No space left on device", str(f))
        return real_ts(obj, f, *a, **k)

    mu.safe_save_file, torch.save = safe_save_file, save
'''


def _torchrun(tmp_path: Path, name: str, sets: list[str], full_disk: dict[str, str] | None = None,
              timeout: float = 60) -> tuple[subprocess.CompletedProcess, dict[int, int], list[str]]:
    """(torchrun's result, each rank's exit code from its summary, each rank's stderr)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_FULL_DISK)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", TMPDIR=str(tmp_path / "tmp"),
               PYTHONPATH=os.pathsep.join(map(str, [site, *SOURCES])), **(full_disk or {}))
    logs = tmp_path / "logs" / name
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--redirects=3", f"--log-dir={logs}", "-m", "polyaccel.moe.cli", "finetune", str(TINY),
                          *[a for s in ["log.progress_bar=false", *sets] for a in ("--set", s)]],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    codes = {int(r): int(c) for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)",
                                                  run.stderr)}
    errs = [next(logs.glob(f"*/attempt_0/{r}/stderr.log")).read_text() for r in (0, 1)]
    return run, codes, errs


def _error_line(run: subprocess.CompletedProcess, codes: dict[int, int], errs: list[str]) -> str:
    """The one error line each rank prints (the same on each; torchrun may SIGTERM a rank still
    exiting once the other has exited 4, so one copy may be missing), no traceback anywhere."""
    assert run.returncode != 0 and 4 in codes.values() and set(codes.values()) <= {4, -15}, (
        run.stderr[-2000:] + errs[0][-2000:] + errs[1][-2000:])
    lines = {line for err in errs for line in err.splitlines() if line.startswith("polyaccel-moe: error:")}
    assert len(lines) == 1 and not any("Traceback" in err for err in errs), errs[0][-3000:] + errs[1][-3000:]
    return lines.pop()


def _finite(folder: Path) -> bool:
    return all(torch.isfinite(w).all() for w in load_file(folder / "model.safetensors").values())


@pytest.mark.slow
def test_a_final_checkpoint_rank_0_cannot_write_leaves_the_model_in_output_dir(tmp_path):
    """The final checkpoint fails on rank 0 alone (rank 1 waits in the save): the trained
    model must still reach output_dir, as with one process, not die with the run."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    run, codes, errs = _torchrun(tmp_path, "final", [f"checkpoint.dir={ck}", f"output_dir={out}",
                                                     "train.max_steps=2", "checkpoint.every_steps=1"],
                                 {"FULL_DISK": str(ck), "FULL_DISK_RANKS": "0", "FULL_DISK_FROM_STEP": "2"})
    line = _error_line(run, codes, errs)
    assert "step 2: the checkpoint could not be written" in line and "No space left on device" in line
    assert f"The final model was written to output_dir {out}" in line and str(ck / "step_00000001") in line
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001"]  # no step_00000002.tmp
    assert _finite(out) and not list(tmp_path.rglob("polyaccel-moe-rescue-*"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["parallel.dense=replicate"]], ids=["fsdp", "dense-replicas"])
def test_a_checkpoint_rank_1_cannot_write_stops_every_rank_with_the_weights_rescued(tmp_path, layout):
    """Rank 1's own files of the step-2 checkpoint fail (rank 0's write fine): every rank
    stops with exit 4 and rank 1's reason; the weights of step 2 go to a rescue folder next
    to output_dir; rerun with room again, the same command resumes from step 1 and finishes."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    sets = [f"checkpoint.dir={ck}", f"output_dir={out}", "train.max_steps=3", "checkpoint.every_steps=1", *layout]
    run, codes, errs = _torchrun(tmp_path, "mid", sets,
                                 {"FULL_DISK": str(ck), "FULL_DISK_RANKS": "1", "FULL_DISK_FROM_STEP": "2"})
    line = _error_line(run, codes, errs)
    assert "step 2: the checkpoint could not be written" in line and "training stopped" in line
    assert "(rank 1: No space left on device" in line and str(ck / "step_00000001") in line
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000001"] and not out.exists()
    rescued = list(tmp_path.glob("polyaccel-moe-rescue-step_00000002-*"))
    assert len(rescued) == 1 and f"saved instead to {rescued[0]}" in line and _finite(rescued[0])
    if layout:
        return  # one rerun is enough
    rerun, codes, errs = _torchrun(tmp_path, "rerun", sets)
    assert rerun.returncode == 0, rerun.stderr[-3000:] + errs[0][-3000:]
    stdout = next((tmp_path / "logs/rerun").glob("*/attempt_0/0/stdout.log"))
    summary = json.loads(stdout.read_text().splitlines()[-1])
    assert summary["start_step"] == 1 and summary["steps"] == 3 and _finite(out)
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002", "step_00000003"]
