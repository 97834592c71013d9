"""Two ``polyaccel-moe finetune`` runs on the same ``checkpoint.dir`` / ``output_dir`` at once
(the same command started twice, a requeued job whose first copy still runs): each save
removed the other's ``step_N.tmp`` in progress (the first run stopped with "No such file or
directory: .../step_00000001.tmp/manifest.json.tmp"), or could mix their files in one
checkpoint. A run now holds ``<folder>.lock`` (flock) beside each folder it writes; a second
run is a config error (exit 2) before anything is loaded or written."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from polyaccel.moe.cli import main


def _config(tmp_path: Path, out: Path, ck: Path) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"preset": "qwen3-moe-tiny"}, "data": {"synthetic": {}},
                                  "train": {"seq_len": 8, "micro_batch": 1, "grad_accum": 1, "max_steps": 1,
                                            "dtype": "fp32", "device": "cpu"},
                                  "log": {"progress_bar": False}, "checkpoint": {"dir": str(ck)},
                                  "output_dir": str(out)}))
    return config


def test_a_second_run_on_the_same_folders_is_refused_while_the_first_runs(tmp_path: Path, capsys) -> None:
    run = tmp_path / "runs"
    config = _config(tmp_path, run / "final", run / "ck")
    run.mkdir()
    lock = run / "ck.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"polyaccel-moe lock, pid 4242\n")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the first run, still training
        assert main(["finetune", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"checkpoint.dir {run / 'ck'} is being written by another run (pid 4242)" in err, err
        assert sorted(p.name for p in run.iterdir()) == ["ck.lock"]  # nothing made, the lock file as it was
        assert lock.read_bytes() == b"polyaccel-moe lock, pid 4242\n"
    finally:
        os.close(fd)
    assert main(["finetune", str(config)]) == 0  # the first run ended: its stale lock file is no obstacle
    assert sorted(p.name for p in run.iterdir()) == ["ck", "final"]


def test_checkpoints_inside_output_dir_run_and_resume_with_their_lock_there(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    config = _config(tmp_path, run, run / "ck")
    assert main(["finetune", str(config)]) == 0, capsys.readouterr().err
    assert main(["finetune", str(config)]) == 0, capsys.readouterr().err  # already finished
    assert not list(run.glob("*.lock")) and (run / "model.safetensors").is_file()


@pytest.mark.parametrize("content", [b"my notes\n", b"12345\n"])
def test_a_users_file_on_the_lock_path_is_refused_and_kept(tmp_path: Path, capsys, content: bytes) -> None:
    config = _config(tmp_path, tmp_path / "final", tmp_path / "ck")
    (tmp_path / "final.lock").write_bytes(content)
    assert main(["finetune", str(config)]) == 2
    assert "is not a lock file of polyaccel-moe" in capsys.readouterr().err
    assert (tmp_path / "final.lock").read_bytes() == content
    assert not (tmp_path / "final").exists() and not (tmp_path / "ck").exists() and not (tmp_path / "ck.lock").exists()
