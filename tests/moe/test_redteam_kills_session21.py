"""Red team, session 21 (kills and corrupt checkpoints of ``polyaccel-moe finetune``).

Real SIGKILLs of the tiny CPU run (in the middle of a checkpoint's files, before its manifest's
rename, before the folder's rename, inside ``save_pretrained`` of the final checkpoint, between
the final save's moves into ``output_dir``) and Ctrl-C there all resumed to the uninterrupted
run's final weights, byte for byte. One kill point was not clean:

- A kill while ``checkpoint.keep_last`` pruned an old checkpoint (``shutil.rmtree`` of
  ``step_N``) left ``step_N`` holding part of its files: with its manifest gone but its trainer
  state still there it passed for a checkpoint written before manifests, so pruning (which
  counts only checkpoints with a manifest) never removed it again; on a real model that is a
  whole checkpoint of disk kept for good. An old checkpoint's trainer state is now removed
  first and its manifest last, so a kill leaves a ``step_N`` whose manifest names missing files:
  never resumed from, and pruned by the next save.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from polyaccel.moe import checkpoint as ckpt


class Killed(BaseException):
    """What a SIGKILL in the middle of a removal amounts to: nothing after it runs."""


def _checkpoint(root: Path, step: int) -> Path:
    d = ckpt.step_dir(root, step)
    d.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "rng_rank0.pt", ckpt.TRAINER_STATE):
        (d / name).write_bytes(name.encode() * step)
    ckpt.write_manifest(d, step)
    return d


def test_a_kill_while_pruning_leaves_no_half_checkpoint_that_is_never_pruned(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ck"
    _checkpoint(root, 4)
    newest = _checkpoint(root, 8)
    real_rmtree = shutil.rmtree

    def killed_halfway(path, *args, **kwargs):
        files = sorted(Path(path).iterdir())  # config.json and manifest.json go first
        for f in files[: len(files) // 2]:
            f.unlink()
        raise Killed

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_halfway)
    with pytest.raises(Killed):
        ckpt._prune(root, newest, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    assert ckpt.written_checkpoints(root) == ckpt.complete_checkpoints(root), \
        "a half-removed checkpoint with its trainer state and no manifest passes for an old checkpoint"
    assert ckpt.not_checkpoints(root) == [] and ckpt.find_resume(root, "auto") == newest
    _checkpoint(root, 12)
    ckpt._prune(root, ckpt.step_dir(root, 12), keep_last=1)  # the next save's
    assert sorted(p.name for p in root.iterdir()) == ["step_00000012"]


@pytest.mark.parametrize("kill_at", range(1, 6))
def test_a_kill_at_any_file_of_a_pruned_checkpoint_leaves_one_the_next_prune_removes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill_at: int) -> None:
    root = tmp_path / "ck"
    _checkpoint(root, 4)
    newest = _checkpoint(root, 8)
    real_unlink, calls = os.unlink, []

    def unlink(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == kill_at:
            raise Killed
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(Killed):
        ckpt._prune(root, newest, keep_last=1)
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert ckpt.written_checkpoints(root) == ckpt.complete_checkpoints(root)
    assert ckpt.find_resume(root, "auto") == newest
    _checkpoint(root, 12)
    ckpt._prune(root, ckpt.step_dir(root, 12), keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008", "step_00000012"]


def test_pruning_removes_old_checkpoints_whole(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    for step in (2, 4, 6):
        _checkpoint(root, step)
    ckpt._prune(root, ckpt.step_dir(root, 6), keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000006"]
