"""A ``model.path`` (or ``data.tokenizer``) inside a checkpoint of the run's own
``checkpoint.dir`` is refused while ``keep_last`` prunes: the run deleted the model it was
told to start from (keep_last pruned ``step_00000001``), and the same command rerun then
failed, "model.path ... does not exist"."""

from __future__ import annotations

import json
from pathlib import Path

import transformers  # noqa: F401  (at collection: its log handler binds the sys.stderr of its first import, not a test's capsys)

from polyaccel.moe.cli import main

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(capsys, tmp_path: Path, *sets: str) -> tuple[int, str, str]:
    base = ("log.progress_bar=false", f"output_dir={tmp_path / 'out'}", f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.every_steps=1")
    code = main(["finetune", str(TINY), *[a for s in (*base, *sets) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_model_path_in_a_checkpoint_keep_last_prunes_is_refused(tmp_path, capsys):
    code, _, err = _finetune(capsys, tmp_path, "train.max_steps=1")
    assert code == 0, err
    first = tmp_path / "ck/step_00000001"
    start_from = ("model.preset=null", f"model.path={first}", "train.max_steps=4", "checkpoint.keep_last=2")
    code, _, err = _finetune(capsys, tmp_path, *start_from)
    assert code == 2 and "Traceback" not in err, err
    assert f"model.path: {first} is in checkpoint step_00000001 of checkpoint.dir" in err
    assert "checkpoint.keep_last=2 prunes" in err and (first / "model.safetensors").is_file()
    code, out, err = _finetune(capsys, tmp_path, *start_from, "checkpoint.keep_last=0", "train.max_steps=2")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["steps"] == 2 and (first / "model.safetensors").is_file()
