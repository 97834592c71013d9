"""A ``step_N`` folder of the user's in ``checkpoint.dir`` is never replaced by a checkpoint, and
a ``train.seq_len`` of one token or data without a target token (nothing to predict) is refused
instead of "training"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(capsys, tmp_path: Path, *sets: str) -> tuple[int, str, str]:
    """The tiny example with its outputs under ``tmp_path`` (``sets`` may move them)."""
    base = ("train.max_steps=2", "log.progress_bar=false", f"output_dir={tmp_path / 'out'}", "checkpoint.dir=null")
    args = [a for s in (*base, *sets) for a in ("--set", s)]
    code = main(["finetune", str(TINY), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("resume", ["none", "auto"])
def test_a_step_folder_of_other_files_in_checkpoint_dir_is_refused_and_kept(tmp_path, capsys, resume):
    """``resume: none`` (what the "none is intact" error suggests) or ``auto`` past an intact
    earlier checkpoint: saving step 2 removed the user's ``step_00000002/`` with its files."""
    ck = tmp_path / "ck"
    if resume == "auto":  # an intact checkpoint of step 1 to resume from
        code, _, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", "train.max_steps=1", "checkpoint.every_steps=1")
        assert code == 0, err
    mine = ck / "step_00000002"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    code, _, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", f"checkpoint.resume={resume}",
                             "checkpoint.every_steps=1")
    assert code == 2, err
    assert "step_00000002: no manifest.json or trainer_state.pt" in err and "Traceback" not in err
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_an_empty_step_folder_or_one_before_the_start_does_not_stop_a_run(tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "step_00000002").mkdir(parents=True)
    code, out, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", "checkpoint.resume=none")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["last_checkpoint"] == str(ck / "step_00000002")


def test_a_one_token_sequence_is_refused_before_anything_is_written(tmp_path, capsys):
    """Synthetic data at ``seq_len: 1`` trained on no target at all: exit 0, ``final_loss`` 0.0 and
    an output_dir written (packed data refused it only once the data was read)."""
    code, _, err = _finetune(capsys, tmp_path, f"output_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck", "train.seq_len=1")
    assert code == 2 and "train.seq_len must be >= 2" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("records", [
    [{"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}] * 3,
    [{"input_ids": [7]}],
])
def test_data_without_a_token_to_train_on_is_refused(tmp_path, capsys, records):
    """Every label -100, or one token (never a target): exit 0 with ``final_loss`` 0.0 and an
    output_dir of an untrained model."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, err = _finetune(capsys, tmp_path, f"output_dir={tmp_path}/out", f"data.jsonl={data}")
    assert code == 2 and f"{data} has no token to train on" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_a_step_folder_past_max_steps_is_left_alone_and_does_not_stop_a_run(tmp_path, capsys):
    mine = tmp_path / "ck/step_00000009"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    code, _, err = _finetune(capsys, tmp_path, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.resume=none")
    assert code == 0, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
