"""Training state that can be trusted: checksummed checkpoints with fallback, weights_only
loading, non-finite steps, output locations checked up front, clear errors for damaged
files, changed shapes, bad token ids and bad YAML, and metrics without duplicate steps."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch

from polyaccel.core import clitools
from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe import train
from polyaccel.moe.cli import main
from polyaccel.moe.data import build_dataset
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import ConfigError, DataConfig, load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _sets(root: Path, *extra: str) -> list[str]:
    return [f"checkpoint.dir={root / 'ck'}", f"output_dir={root / 'out'}", f"log.metrics_jsonl={root / 'metrics.jsonl'}",
            "log.progress_bar=false", "log.every_steps=1", "train.max_steps=4", "checkpoint.every_steps=2",
            "checkpoint.keep_last=0", *extra]


def _tiny(root: Path, *extra: str):
    return load_config(TINY, _sets(root, *extra))


def _cli(capsys, root: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["finetune", str(TINY), *[a for s in _sets(root, *extra) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    root = tmp_path_factory.mktemp("finished")
    finetune(_tiny(root))
    return root


def _copy(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished / "ck", tmp_path / "ck")
    return tmp_path


def _no_model_load(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(train, "build_model", refuse)


# --------------------------------------------------------------------------------------------
# Checksums, fallback, damaged files
# --------------------------------------------------------------------------------------------

def test_checkpoints_carry_a_manifest_written_last(finished):
    step4 = finished / "ck/step_00000004"
    manifest = json.loads((step4 / ckpt.MANIFEST).read_text())
    assert manifest["step"] == 4
    on_disk = {p.name for p in step4.iterdir()} - {ckpt.MANIFEST}
    assert set(manifest["files"]) == on_disk >= {ckpt.TRAINER_STATE, "model.safetensors", "rng_rank0.pt"}
    assert ckpt.verify_checkpoint(step4) is None
    assert [p.name for p in ckpt.complete_checkpoints(finished / "ck")] == ["step_00000002", "step_00000004"]


def test_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(finished, tmp_path, caplog):
    root = _copy(finished, tmp_path)
    weights = root / "ck/step_00000004/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # same size, one flipped byte inside a tensor
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        result = finetune(_tiny(root))
    assert result.start_step == 2 and result.steps == 4
    assert "model.safetensors fails its sha256 check" in caplog.text and "step_00000004" in caplog.text
    assert all(math.isfinite(x) for x in result.losses)

    # Explicitly naming a damaged checkpoint fails, naming the file; so does auto when none is intact.
    state = root / "ck/step_00000004/trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match=r"trainer_state.pt has 100 bytes, the manifest says"):
        finetune(_tiny(root, f"checkpoint.resume={root / 'ck/step_00000004'}"))
    for d in ckpt.complete_checkpoints(root / "ck"):
        (d / ckpt.TRAINER_STATE).write_bytes(b"")
    with pytest.raises(ckpt.CheckpointError, match="none of the 2 checkpoints .* is intact"):
        finetune(_tiny(root))


def _drop_trainer_state_from_manifest(d: Path) -> None:
    m = json.loads((d / ckpt.MANIFEST).read_text())
    del m["files"][ckpt.TRAINER_STATE]
    (d / ckpt.MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("damage, why", [
    (lambda d: (d / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda d: (d / ckpt.MANIFEST).unlink(), "manifest.json is missing"),
    (lambda d: (d / ckpt.MANIFEST).write_text('{"step": 4, "files": '), "manifest.json is unreadable"),
    (_drop_trainer_state_from_manifest, "does not list trainer_state.pt"),
], ids=["listed_file_deleted", "no_manifest", "manifest_cut_off", "manifest_without_trainer_state"])
def test_each_kind_of_damage_is_named_and_auto_resume_skips_it(finished, tmp_path, damage, why):
    """verify_checkpoint's other reasons (checksum and size are above): each names what is
    wrong, and resume=auto takes the older intact checkpoint instead of the damaged newer one."""
    root = _copy(finished, tmp_path)
    step4 = root / "ck/step_00000004"
    assert ckpt.verify_checkpoint(step4) is None  # intact before the damage
    damage(step4)
    assert why in (ckpt.verify_checkpoint(step4) or "")
    assert ckpt.find_resume(root / "ck", "auto") == root / "ck/step_00000002"


def test_keep_last_prunes_only_the_oldest_checkpoints(tmp_path):
    """checkpoint.keep_last=2 with a checkpoint every step: the two newest remain, intact."""
    finetune(_tiny(tmp_path, "checkpoint.every_steps=1", "checkpoint.keep_last=2"))
    kept = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert kept == ["step_00000003", "step_00000004"]
    assert all(ckpt.verify_checkpoint(tmp_path / "ck" / name) is None for name in kept)


def test_keep_last_never_prunes_the_checkpoint_just_written_nor_newer_ones(tmp_path):
    """A damaged newer checkpoint (step 200: manifest there, a file cut) that resume skipped,
    then step 150 written with keep_last=1: 150 (the only intact state) and 200 stay, only
    older ones go. Before, the newest keep_last by name were kept: 200 alone, all progress lost."""
    root = tmp_path / "ck"
    for step in (100, 150, 200):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / ckpt.MANIFEST).write_text(json.dumps({"step": step}))
    ckpt._prune(root, root / "step_00000150", keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000150", "step_00000200"]


def test_a_save_clears_what_a_killed_save_left_in_its_temporary_folder(tmp_path):
    """A kill mid-save leaves ``step_N.tmp``: resume ignores it, and the next save of step N
    starts from an empty folder, so none of the stale files end up in the checkpoint."""
    leftover = tmp_path / "ck/step_00000002.tmp"
    leftover.mkdir(parents=True)
    (leftover / ckpt.TRAINER_STATE).write_bytes(b"half written")
    (leftover / "stale.bin").write_bytes(b"junk")
    assert ckpt.find_resume(tmp_path / "ck", "auto") is None
    result = finetune(_tiny(tmp_path))
    assert result.start_step == 0
    step2 = tmp_path / "ck/step_00000002"
    assert not leftover.exists() and not (step2 / "stale.bin").exists()
    assert "stale.bin" not in json.loads((step2 / ckpt.MANIFEST).read_text())["files"]
    assert ckpt.verify_checkpoint(step2) is None


def test_a_later_save_removes_what_killed_saves_of_earlier_steps_left(tmp_path):
    """A kill mid-save of step 1 leaves ``step_00000001.tmp``; the next save (step 2) removes
    it; a leftover of a later step (a run resumed from before it) stays until that step."""
    older, later = tmp_path / "ck/step_00000001.tmp", tmp_path / "ck/step_00000009.tmp"
    for d in (older, later):
        d.mkdir(parents=True)
        (d / "stale.bin").write_bytes(b"junk")
    finetune(_tiny(tmp_path))
    assert not older.exists() and later.exists()
    assert ckpt.verify_checkpoint(tmp_path / "ck/step_00000002") is None


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, clitools.Terminated])
def test_an_interrupted_save_leaves_no_temporary_folder(tmp_path, monkeypatch, interrupt):
    """Ctrl-C (or SIGTERM) while the weights are written: the exception goes on, the
    ``.tmp`` folder is gone, the earlier checkpoint is untouched."""
    model, opt = _small_model_and_optimizer()
    first = ckpt.save_checkpoint(tmp_path / "ck", 1, model, opt, {})

    def interrupted(*args, **kwargs):
        raise interrupt

    monkeypatch.setattr(type(model), "save_pretrained", interrupted)
    with pytest.raises(interrupt):
        ckpt.save_checkpoint(tmp_path / "ck", 2, model, opt, {})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [first.name]
    assert ckpt.verify_checkpoint(first) is None


@pytest.mark.parametrize("damage", ["trainer_state_truncated", "trainer_state_empty", "safetensors_truncated",
                                    "safetensors_empty"])
def test_damaged_files_give_an_error_naming_the_file(finished, tmp_path, damage):
    """A checkpoint without a manifest (written before checksums) resumed explicitly: damaged
    files are still reported by name, not as a raw traceback."""
    root = _copy(finished, tmp_path)
    step2 = root / "ck/step_00000002"
    (step2 / ckpt.MANIFEST).unlink()
    name = ckpt.TRAINER_STATE if damage.startswith("trainer_state") else "model.safetensors"
    f = step2 / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2] if damage.endswith("truncated") else b"")
    with pytest.raises(ckpt.CheckpointError, match=rf"{name} cannot be read, damaged or truncated"):
        finetune(_tiny(root, f"checkpoint.resume={step2}", f"checkpoint.dir={root / 'rewind'}"))


def test_a_pickle_that_runs_code_is_refused(finished, tmp_path):
    root = _copy(finished, tmp_path)
    step2 = root / "ck/step_00000002"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    state = torch.load(step2 / ckpt.TRAINER_STATE, weights_only=True)
    torch.save({**state, "scheduler": Payload()}, step2 / ckpt.TRAINER_STATE)
    ckpt.write_manifest(step2, 2)  # someone else's checkpoint: its manifest matches its bytes
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.pt: refused"):
        finetune(_tiny(root, f"checkpoint.resume={step2}", f"checkpoint.dir={root / 'rewind'}"))
    assert not marker.exists()


def test_changed_model_shape_on_resume_names_the_tensors(finished, tmp_path, capsys):
    root = _copy(finished, tmp_path)
    code, _, err = _cli(capsys, root, "train.max_steps=6", "model.config.moe_intermediate_size=24")
    assert code == 2
    assert "holds weights of another model shape (4 tensors differ" in err
    assert "model.layers.0.mlp.experts.down_proj: checkpoint (4, 32, 16), model (4, 32, 24)" in err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("polyaccel-moe: error: ")


# --------------------------------------------------------------------------------------------
# Non-finite steps
# --------------------------------------------------------------------------------------------

def _nan_at_step(monkeypatch, step: int, grad_accum: int = 2) -> None:
    """Make every micro-batch loss of optimizer step ``step`` NaN (so its gradients too)."""
    scaled, calls = train._scaled_loss, [0]

    def poisoned(*args, **kwargs):
        calls[0] += 1
        loss = scaled(*args, **kwargs)
        return loss * float("nan") if (calls[0] - 1) // grad_accum == step - 1 else loss
    monkeypatch.setattr(train, "_scaled_loss", poisoned)


def test_nonfinite_loss_stops_with_the_step_named(tmp_path, capsys, monkeypatch):
    _nan_at_step(monkeypatch, 3)
    code, _, err = _cli(capsys, tmp_path)
    assert code == 3
    assert "step 3: non-finite loss (nan)" in err and "step_00000002" in err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ck")] == ["step_00000002"]


def test_nonfinite_steps_are_skipped_when_asked(tmp_path, monkeypatch, caplog):
    _nan_at_step(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        result = finetune(_tiny(tmp_path, "train.nonfinite=skip"))
    assert result.steps == 4 and result.skipped_steps == 1
    assert math.isnan(result.losses[1]) and all(math.isfinite(x) for i, x in enumerate(result.losses) if i != 1)
    assert "step 2: non-finite loss" in caplog.text and "optimizer step skipped" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["skipped"] is True and records[1]["loss"] is None
    weights = train_weights(tmp_path / "out")
    assert all(torch.isfinite(w).all() for w in weights.values())


def _nan_model(finished: Path, tmp_path: Path) -> Path:
    """The finished run's model with one NaN in ``model.norm.weight``, as a model.path."""
    from safetensors.torch import save_file

    model = shutil.copytree(finished / "out", tmp_path / "nan_model")
    weights = train_weights(model)
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def test_nonfinite_loaded_weights_are_refused_with_exit_2_naming_the_tensor(finished, tmp_path, capsys):
    """NaN weights in model.path under train.nonfinite=skip: every step was skipped and the NaN
    model replaced the earlier one in output_dir (exit 0); now refused at load (exit 2)."""
    nan_model = _nan_model(finished, tmp_path)
    out = shutil.copytree(finished / "out", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = _cli(capsys, tmp_path, f"model.path={nan_model}", "train.nonfinite=skip")
    assert code == 2 and "Traceback" not in err
    assert f"model.path: the weights loaded from {nan_model} are not finite: model.norm.weight holds NaN" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert ckpt.complete_checkpoints(tmp_path / "ck") == []


def test_a_run_whose_every_step_was_skipped_writes_no_output(finished, tmp_path, capsys, monkeypatch):
    """All steps skipped (train.nonfinite=skip): the untrained model replaced output_dir and
    was checkpointed as finished (exit 0); now exit 3, output_dir and the last checkpoint kept."""
    out = shutil.copytree(finished / "out", tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(train, "_scaled_loss", lambda out, *args: out.loss * float("nan"))
    code, _, err = _cli(capsys, tmp_path, "train.nonfinite=skip")
    assert code == 3 and "Traceback" not in err
    assert "all 4 steps were skipped" in err and "neither output_dir nor the final checkpoint was written" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ck")] == ["step_00000002"]


def test_nonfinite_trained_weights_are_never_saved_as_the_final_model(tmp_path, capsys, monkeypatch):
    """A last optimizer step that leaves a NaN weight (its loss was finite) was saved to
    output_dir and as the final checkpoint; now exit 3 naming the tensor, nothing final saved."""
    original, calls = train.step_scaled, [0]

    def poisoning(optimizer, scale):
        original(optimizer, scale)
        calls[0] += 1
        if calls[0] == 4:
            optimizer.param_groups[0]["params"][0].data.fill_(float("nan"))
    monkeypatch.setattr(train, "step_scaled", poisoning)
    code, _, err = _cli(capsys, tmp_path)
    assert code == 3 and "the trained weights are not finite (model.embed_tokens.weight holds NaN" in err
    assert not (tmp_path / "out").exists()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "ck")] == ["step_00000002"]


def train_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(d / "model.safetensors")


# --------------------------------------------------------------------------------------------
# Outputs, reruns, metrics
# --------------------------------------------------------------------------------------------

def test_output_locations_are_checked_before_the_model_loads(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    _no_model_load(monkeypatch)
    for key, value, message in [("log.metrics_jsonl", tmp_path / "file/m.jsonl", "cannot create the directory"),
                                ("output_dir", tmp_path / "file/out", "is a file"),
                                ("checkpoint.dir", tmp_path / "file/ck", "cannot create the directory")]:
        with pytest.raises(ConfigError, match=f"{key}: .*{message}"):
            finetune(_tiny(tmp_path, f"{key}={value}"))
    monkeypatch.undo()
    result = finetune(_tiny(tmp_path, f"log.metrics_jsonl={tmp_path / 'new/deeper/m.jsonl'}", "train.max_steps=1"))
    assert result.steps == 1 and (tmp_path / "new/deeper/m.jsonl").is_file()


def test_example_outputs_go_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY)
    for path in (cfg.checkpoint.dir, cfg.output_dir):
        assert Path(path).is_relative_to(tmp_path) and not Path(path).is_relative_to(TINY.parent), path


def test_rerunning_a_finished_run_says_so(finished, tmp_path, capsys, monkeypatch, caplog):
    root = _copy(finished, tmp_path)
    _no_model_load(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, out, _ = _cli(capsys, root)
    assert code == 0
    message = "run already finished at step 4"
    assert message in caplog.text and "nothing to do; raise train.max_steps or use a new checkpoint.dir" in caplog.text
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and message in summary["note"]


def test_a_pickled_model_file_is_never_loaded(finished, tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(finished / "out/config.json", model / "config.json")
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model.embed_tokens.weight": Payload()}, model / "pytorch_model.bin")
    code, _, err = _cli(capsys, tmp_path, f"model.path={model}")
    assert code == 2 and "safetensors checkpoints only" in err
    assert not marker.exists()


def test_output_dir_that_would_overwrite_an_input_a_checkpoint_or_user_files_is_refused(finished, tmp_path,
                                                                                          monkeypatch):
    root = _copy(finished, tmp_path)
    base = shutil.copytree(finished / "out", tmp_path / "base")
    before = (base / "model.safetensors").read_bytes()
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "model-00001-of-00002.safetensors").write_text("mine")
    _no_model_load(monkeypatch)
    for sets, message in [([f"model.path={base}", f"output_dir={base}"], "is model.path, which this run reads"),
                          ([f"output_dir={root / 'ck/step_00000004'}"], "is inside checkpoint.dir"),
                          ([f"output_dir={folder}"], "already holds files and no saved model "
                                                     "(model-00001-of-00002.safetensors, notes.txt)")]:
        with pytest.raises(ConfigError) as e:
            finetune(_tiny(root, *sets))
        assert str(e.value).startswith("output_dir: ") and message in str(e.value)
    assert (base / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == ["model-00001-of-00002.safetensors", "notes.txt"]
    assert ckpt.verify_checkpoint(root / "ck/step_00000004") is None


def test_final_save_replaces_an_earlier_model_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    (out / "model.safetensors.index.json").write_text("{}")
    finetune(_tiny(tmp_path, "train.max_steps=1", "checkpoint.every_steps=0"))
    # a model this run did not write: each of its files the save writes over or deletes is kept aside
    earlier = {"config.json": "{}", "model-00001-of-00002.safetensors": "stale", "model.safetensors.index.json": "{}"}
    aside = {name: list(out.glob(f"{name}.bak-*")) for name in earlier}
    assert all(len(v) == 1 and v[0].read_text() == earlier[n] for n, v in aside.items())
    assert sorted(p.name for p in out.iterdir()) == sorted([train._RECORD, "config.json", "generation_config.json",
                                                           "model.safetensors", "notes.txt",
                                                           *(v[0].name for v in aside.values())])
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ck/step_00000001/model.safetensors").read_bytes()


def test_rerun_writes_the_final_output_a_kill_left_unwritten(finished, tmp_path, capsys, monkeypatch, caplog):
    """Killed while writing output_dir (after the last checkpoint): the rerun, finding the run
    finished, writes output_dir from the last checkpoint instead of leaving it damaged."""
    root = _copy(finished, tmp_path)
    final = root / "ck/step_00000004"
    out = root / "out"
    (out / train._STAGING).mkdir(parents=True)
    (out / "config.json").write_bytes((final / "config.json").read_bytes())
    (out / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes()[:1000])
    _no_model_load(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, _, _ = _cli(capsys, root)
    assert code == 0 and "does not hold the final model" in caplog.text
    [cut] = out.glob("model.safetensors.bak-*")  # weights no checkpoint matches: kept aside, never deleted
    assert cut.read_bytes() == (final / "model.safetensors").read_bytes()[:1000]
    assert sorted(p.name for p in out.iterdir()) == [train._RECORD, "config.json", "generation_config.json",
                                                    "model.safetensors", cut.name]
    assert (out / "model.safetensors").read_bytes() == (final / "model.safetensors").read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        assert _cli(capsys, root)[0] == 0
    assert "does not hold the final model" not in caplog.text


def test_a_failed_final_save_leaves_the_earlier_output_as_it_was(finished, tmp_path, monkeypatch):
    root = _copy(finished, tmp_path)
    out = shutil.copytree(finished / "out", root / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    original = train._write_output

    def interrupted(cfg, write_model, **kwargs):
        def write_then_die(staging):
            write_model(staging)
            raise KeyboardInterrupt("killed after writing the staged model")
        return original(cfg, write_then_die)
    monkeypatch.setattr(train, "_write_output", interrupted)
    with pytest.raises(KeyboardInterrupt):
        finetune(_tiny(root, "train.max_steps=6"))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_metrics_have_each_step_once_after_resume(tmp_path):
    finetune(_tiny(tmp_path), stop_after=3)  # steps 1-3 logged, checkpoint at 2: step 3 is redone
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "lo')  # a line cut by the kill
    finetune(_tiny(tmp_path))
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


# --------------------------------------------------------------------------------------------
# Data and YAML errors
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, message", [
    ([1, 2.5, 3], r"ids.jsonl:2: input_ids\[1\] = 2.5 is not an integer token id"),
    ([1, "7"], r"ids.jsonl:2: input_ids\[1\] = '7' is not an integer token id"),
    ([1, -1], r"ids.jsonl:2: input_ids\[1\] is token id -1 outside the model's vocabulary \[0, 128\)"),
    ([1, 128], r"ids.jsonl:2: input_ids\[1\] is token id 128 outside"),
    (7, "ids.jsonl:2: input_ids must be a list"),
])
def test_bad_token_ids_are_refused_naming_the_line(tmp_path, ids, message):
    data = tmp_path / "ids.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": ids}) + "\n")
    with pytest.raises(ConfigError, match=message):
        build_dataset(DataConfig(jsonl=str(data)), seq_len=4, vocab_size=128)


@pytest.mark.parametrize("text, message", [
    ("model:\n  preset: qwen3-moe-tiny\ntrain: {max_steps: 3\n", "c.yaml:4:1: YAML syntax error"),
    ("model:\n  preset: qwen3-moe-tiny\ntrain:\n  micro_batch: two\n",
     "c.yaml:4: train.micro_batch: expected an integer, got 'two'"),
    ("model:\n  preset: qwen3-moe-tiny\ntrain:\n  max_stepz: 3\n", "c.yaml:4: unknown config key 'train.max_stepz'"),
    ("model:\n  preset: 5\n", "c.yaml:2: model.preset: expected a preset name, got 5"),
    ("model:\n  preset: qwen3-moe-tiny\ntrain:\n  nonfinite: ignore\n",
     "c.yaml:4: train.nonfinite: 'ignore' is not one of 'stop', 'skip'"),
])
def test_yaml_errors_name_file_and_line_with_exit_2(tmp_path, capsys, text, message):
    (tmp_path / "c.yaml").write_text(text)
    code = main(["finetune", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="--set train.betas=\\[0.9: YAML syntax error"):
        load_config(overrides=["train.betas=[0.9"])


def test_resume_restores_the_rng_streams_and_the_optimizer(tmp_path):
    """What a checkpoint restores besides the weights: the Python and torch RNG streams
    continue exactly where the save left them (dropout, router jitter and shuffles after a
    resume equal the straight run's), and the optimizer state comes back (step counts and
    moments), so the next update is the straight run's."""
    import random

    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, FlatAdamW
    from polyaccel.moe.presets import tiny

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"),
                                             dtype=torch.float32)
    opt = FlatAdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    random.seed(3)
    torch.manual_seed(4)
    path = ckpt.save_checkpoint(tmp_path / "ck", 1, model, opt, {"marker": 7})
    expected = (random.random(), torch.rand(5))
    moments = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}

    random.seed(99)
    torch.manual_seed(99)  # what a restarted process would have
    fresh = FlatAdamW(model.parameters(), lr=1e-2)
    state = ckpt.load_trainer_state(path, model, fresh)
    assert state["marker"] == 7 and state["step"] == 1
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(5), expected[1])
    restored = fresh.state[next(model.parameters())]
    assert float(restored["step"]) == 1.0
    for k in ("exp_avg", "exp_avg_sq"):
        assert moments[k].abs().sum() > 0 and torch.equal(restored[k], moments[k]), k


def _small_model_and_optimizer():
    from polyaccel.moe import AutoModelForCausalLM, BackendConfig, FlatAdamW
    from polyaccel.moe.presets import tiny

    model = AutoModelForCausalLM.from_config(tiny("qwen3_moe"), backend=BackendConfig(backend="cpu"),
                                             dtype=torch.float32)
    return model, FlatAdamW(model.parameters(), lr=1e-2)
