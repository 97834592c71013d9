"""Entries in ``checkpoint.dir`` named like checkpoints that are not this run's: a file named
``step_N`` (or ``step_N.tmp``) is refused before training instead of failing the save of step N
after it (exit 4); a link named like one is replaced as a link, never followed; and a
``step_N`` folder that is no checkpoint (empty, or of other files) is not taken for a damaged
checkpoint by ``checkpoint.resume: auto`` (the default)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers  # noqa: F401  (at collection: its log handler binds the sys.stderr of its first import, not a test's capsys)

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(capsys, tmp_path: Path, *sets: str) -> tuple[int, str, str]:
    """Two steps of the tiny example, a checkpoint each step in ``tmp_path/ck``."""
    base = ("train.max_steps=2", "log.progress_bar=false", f"output_dir={tmp_path / 'out'}",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=1")
    code = main(["finetune", str(TINY), *[a for s in (*base, *sets) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["step_00000002", "step_00000002.tmp"])
def test_a_file_named_like_a_checkpoint_of_the_run_is_refused_before_training_and_kept(tmp_path, capsys, name):
    mine = tmp_path / "ck" / name
    mine.parent.mkdir()
    mine.write_text("mine")
    code, _, err = _finetune(capsys, tmp_path)
    assert code == 2, err
    assert f"({name}: not folders)" in err and "Traceback" not in err
    assert mine.read_text() == "mine" and sorted(p.name for p in mine.parent.iterdir()) == [name]
    assert not (tmp_path / "out").exists()


def test_links_named_like_checkpoints_are_replaced_as_links_and_what_they_point_to_is_kept(tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ck = tmp_path / "ck"
    ck.mkdir()
    os.symlink(elsewhere, ck / "step_00000001")  # an empty folder: left alone by the checks
    os.symlink(elsewhere, ck / "step_00000002.tmp")
    code, out, err = _finetune(capsys, tmp_path)
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["last_checkpoint"] == str(ck / "step_00000002")
    assert not any(p.is_symlink() for p in ck.iterdir()) and list(elsewhere.iterdir()) == []
    assert (ck / "step_00000001/manifest.json").is_file()


def test_resume_auto_passes_over_step_folders_that_are_no_checkpoints(tmp_path, capsys):
    """An empty one, and one of other files past ``train.max_steps``: left alone (docs), not
    "none of the 2 checkpoints is intact" under the default ``resume: auto``."""
    empty, mine = tmp_path / "ck/step_00000001", tmp_path / "ck/step_00000009"
    empty.mkdir(parents=True)
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, out, err = _finetune(capsys, tmp_path, "train.max_steps=1")
    assert code == 0, err
    assert "not resuming" not in err and json.loads(out.splitlines()[-1])["start_step"] == 0
    assert (empty / "manifest.json").is_file() and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
