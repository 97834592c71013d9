"""Training checkpoints (``polyaccel.moe.checkpoint``): behaviour the other tests left unpinned,
found by mutation testing (each test fails when one check, sync or step of ``checkpoint.py``
is dropped or moved): the manifest's durability, pruning, verification and explicit resume."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from polyaccel.moe import AutoModelForCausalLM
from polyaccel.moe import checkpoint as ckpt


def _fake_checkpoint(d: Path, step: int) -> Path:
    """A small intact checkpoint folder (bytes, not a model: only the manifest is looked at)."""
    d.mkdir(parents=True)
    (d / ckpt.TRAINER_STATE).write_bytes(b"state %d" % step)
    (d / "model.safetensors").write_bytes(b"weights %d" % step)
    ckpt.write_manifest(d, step)
    return d


# ---- the manifest is durable before anything trusts it ------------------------------------------------------


def test_the_manifest_is_written_after_every_file_is_synced_and_its_folder_synced_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A power loss after the save must not leave a manifest that vouches for bytes still in the
    page cache (the files, then the pruning of older checkpoints, would be lost together): each
    file and the manifest's temporary are synced before the manifest gets its name, and the
    folder is synced after, so that the name survives too."""
    d = tmp_path / "step_00000001.tmp"
    (d / "sub").mkdir(parents=True)
    (d / ckpt.TRAINER_STATE).write_bytes(b"state")
    (d / "sub" / "rng_rank0.pt").write_bytes(b"rng")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append((f"fsync {kind}", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", lambda a, b: events.append(("replace", str(b))) or real_replace(a, b))
    ckpt.write_manifest(d, 1)
    cut = events.index(("replace", str(d / ckpt.MANIFEST)))
    before = {p for kind, p in events[:cut] if kind == "fsync file"}
    assert before == {str(d / ckpt.TRAINER_STATE), str(d / "sub" / "rng_rank0.pt"), str(d / (ckpt.MANIFEST + ".tmp"))}
    assert ("fsync dir", str(d)) in events[cut + 1:]
    assert ckpt.verify_checkpoint(d) is None


def test_a_step_folder_gets_its_name_only_with_its_manifest_in_it(saved: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest is written in ``step_N.tmp``, before the rename: a kill between a rename and
    a manifest written after it would leave a ``step_N`` with a trainer state but no manifest,
    which ``checkpoint.resume=<path>`` takes, unverified, for a checkpoint written before
    checksums existed."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    optimizer = torch.optim.AdamW(model.parameters())
    at_rename: list[bool] = []
    real = Path.rename

    def rename(self: Path, target):  # noqa: ANN001, ANN202
        at_rename.append((self / ckpt.MANIFEST).is_file())
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    final = ckpt.save_checkpoint(tmp_path / "ck", 1, model, optimizer, {})
    assert at_rename == [True]
    assert ckpt.verify_checkpoint(final) is None


# ---- pruning counts only checkpoints that can be resumed ---------------------------------------------------


def test_a_step_folder_without_a_manifest_is_not_one_of_the_checkpoints_kept(tmp_path: Path) -> None:
    """keep_last=2 with steps 100 (intact), 150 (no manifest: written before checksums, or its
    manifest lost) and 200 (just written): 100 is one of the two intact checkpoints kept and
    must stay; counting 150 among the kept would remove it and leave one to resume from. The
    folder without a manifest is never removed by pruning (it is not a complete checkpoint)."""
    root = tmp_path / "ck"
    _fake_checkpoint(root / "step_00000100", 100)
    legacy = root / "step_00000150"
    legacy.mkdir()
    (legacy / ckpt.TRAINER_STATE).write_bytes(b"old run's state")
    final = _fake_checkpoint(root / "step_00000200", 200)
    ckpt._prune(root, final, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000100", "step_00000150", "step_00000200"]
    ckpt._prune(root, final, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000150", "step_00000200"]


# ---- verification and explicit resume ---------------------------------------------------------------------


def test_a_folder_where_the_manifest_lists_a_file_is_a_reason_not_a_crash(tmp_path: Path, caplog) -> None:
    """A listed file replaced by a folder (of the recorded size): verification names it as
    missing and auto-resume falls back to the older intact checkpoint, instead of
    ``IsADirectoryError`` from hashing it ending the run."""
    root = tmp_path / "ck"
    older = _fake_checkpoint(root / "step_00000001", 1)
    newer = _fake_checkpoint(root / "step_00000002", 2)
    (newer / "model.safetensors").unlink()
    (newer / "model.safetensors").mkdir()
    manifest = json.loads((newer / ckpt.MANIFEST).read_text())
    manifest["files"]["model.safetensors"]["size"] = (newer / "model.safetensors").stat().st_size
    (newer / ckpt.MANIFEST).write_text(json.dumps(manifest))
    why = ckpt.verify_checkpoint(newer)
    assert why is not None and "model.safetensors is missing" in why
    with caplog.at_level("WARNING", logger="polyaccel.moe"):
        assert ckpt.find_resume(root, "auto") == older


@pytest.mark.parametrize("kind", ["model folder", "empty", "killed save"])
def test_an_explicit_resume_path_that_holds_no_checkpoint_is_refused(saved: Path, tmp_path: Path, kind: str) -> None:
    """``checkpoint.resume=<path>`` naming a folder that is no checkpoint (a model folder, an
    empty one, the ``step_N.tmp`` of a killed save with no trainer state yet) is refused by
    ``find_resume``, naming it, before anything is built or loaded from it."""
    if kind == "model folder":
        path = saved
    else:
        path = tmp_path / ("step_00000002.tmp" if kind == "killed save" else "empty")
        path.mkdir()
        if kind == "killed save":
            (path / "rng_rank0.pt").write_bytes(b"rng")
    with pytest.raises(ckpt.CheckpointError, match="is not a complete checkpoint"):
        ckpt.find_resume(None, str(path))


# ---- restoring: the right error for the right cause -------------------------------------------------------


def test_a_trainer_state_without_an_optimizer_entry_is_a_checkpoint_error(saved: Path, tmp_path: Path) -> None:
    """A ``trainer_state.pt`` that passes its manifest but holds no optimizer entry (not written
    by polyaccel) is named as not a polyaccel trainer state, not a raw ``KeyError`` traceback."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    optimizer = torch.optim.AdamW(model.parameters())
    step = ckpt.save_checkpoint(tmp_path / "ck", 1, model, optimizer, {})
    torch.save({"step": 1, "data_position": 3}, step / ckpt.TRAINER_STATE)
    ckpt.write_manifest(step, 1)
    with pytest.raises(ckpt.CheckpointError, match="is not a polyaccel trainer state"):
        ckpt.load_trainer_state(step, model, optimizer)


@pytest.mark.parametrize("written_per_rank", [False, True])
def test_resuming_under_the_other_optimizer_layout_says_so(saved: Path, tmp_path: Path, written_per_rank: bool) -> None:
    """A checkpoint written with the full optimizer state resumed with per-rank optimizer files,
    or the other way round, is a :class:`LayoutMismatch` telling the user to resume with the
    layout that wrote it; not a "missing file" or "cannot be restored ... resume from another
    checkpoint" error that sends them to throw a good checkpoint away."""
    model = AutoModelForCausalLM.from_pretrained(saved)
    optimizer = torch.optim.AdamW(model.parameters())
    step = ckpt.save_checkpoint(tmp_path / "ck", 1, model, optimizer, {}, per_rank_optimizer=written_per_rank)
    assert ckpt.verify_checkpoint(step) is None
    with pytest.raises(ckpt.LayoutMismatch, match="parallel.dense=replicate"):
        ckpt.load_trainer_state(step, model, optimizer, per_rank_optimizer=not written_per_rank)


def test_an_explicit_resume_path_that_does_not_exist_says_so(tmp_path):
    """A mistyped checkpoint.resume is named as missing, not as an incomplete checkpoint."""
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000999 does not exist"):
        ckpt.find_resume(None, str(tmp_path / "step_00000999"))
