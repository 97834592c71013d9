"""What a user trained is never lost, and the CLI says so in one line: a final save or a
checkpoint that cannot be written (full disk) exits 4 with the trained weights in the final
checkpoint or a fallback folder; output locations are proven writable before training; a
run that would keep nothing is refused; a refused run creates no directory; the printed JSON
is strict; a closed stdout ends ``presets`` quietly and never stops a training run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from safetensors import SafetensorError
from safetensors.torch import load_file

from polyaccel.moe import train
from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
QUICK = ["log.progress_bar=false", "train.max_steps=2", "checkpoint.every_steps=0"]


def _cli(capsys, *sets: str, config: Path = TINY) -> tuple[int, str, str]:
    code = main(["finetune", str(config), *[a for s in (*QUICK, *sets) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


def _full_disk(monkeypatch, disk: Path) -> None:
    """Every safetensors file written under ``disk`` fails as on a full disk."""
    real = transformers.modeling_utils.safe_save_file

    def save(tensors, filename, *args, **kwargs):
        if Path(filename).resolve().is_relative_to(disk.resolve()):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save)


def _private_tmpdir(monkeypatch, path: Path) -> Path:
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))  # what $TMPDIR sets
    return path


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("polyaccel-moe: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_final_save_that_fails_without_checkpoints_rescues_the_weights(tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    _full_disk(monkeypatch, disk)
    code, out, err = _cli(capsys, f"output_dir={disk / 'final'}", "checkpoint.dir=null")
    line = _error_line(err)
    assert code == 4 and "start_step" not in out, err  # no summary of a run whose save failed
    assert f"could not be written to output_dir {disk / 'final'}" in line and "No space left on device" in line
    assert list(disk.iterdir()) == []  # neither the output folder nor its .polyaccel-partial/ is left
    rescued = list(tmp.glob("polyaccel-moe-rescue-final-*"))
    assert len(rescued) == 1 and f"saved instead to {rescued[0]}" in line
    weights = load_file(rescued[0] / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(rescued[0])
    assert model.config.num_hidden_layers == 2


def test_a_final_save_that_fails_names_the_final_checkpoint_and_a_rerun_writes_it(tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    _full_disk(monkeypatch, disk)
    sets = [f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={disk / 'final'}"]
    code, _, err = _cli(capsys, *sets)
    line = _error_line(err)
    assert code == 4 and f"safe in the final checkpoint {tmp_path / 'ck/step_00000002'}" in line, err
    assert list(disk.iterdir()) == [] and list(tmp.iterdir()) == []  # no rescue needed
    monkeypatch.undo()  # the disk has room again: the same command writes output_dir, without training
    code, out, err = _cli(capsys, *sets)
    assert code == 0 and "run already finished at step 2" in json.loads(out)["note"], err
    assert (load_file(disk / "final/model.safetensors").keys()
            == load_file(tmp_path / "ck/step_00000002/model.safetensors").keys())


def test_a_checkpoint_that_cannot_be_written_stops_with_the_weights_rescued(tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    _full_disk(monkeypatch, disk)
    code, _, err = _cli(capsys, f"checkpoint.dir={disk / 'ck'}", f"output_dir={disk / 'out'}",
                        "train.max_steps=4", "checkpoint.every_steps=2")
    line = _error_line(err)
    assert code == 4 and "step 2: the checkpoint could not be written" in line and "training stopped" in line
    # no step_00000002.tmp, and neither ck/ nor disk/ (the failed save created both); the rescue
    # tried next to output_dir (in disk/) left nothing either
    assert not disk.exists()
    rescued = list(tmp.glob("polyaccel-moe-rescue-step_00000002-*"))
    assert len(rescued) == 1 and (rescued[0] / "model.safetensors").is_file() and str(rescued[0]) in line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_an_output_dir_that_cannot_be_created_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """``os.access`` says yes to root everywhere; /proc accepts no new directory."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(train, "build_model", refuse)
    code, _, err = _cli(capsys, "output_dir=/proc/polyaccel-nope/final", "checkpoint.dir=null")
    line = _error_line(err)
    assert code == 2 and "output_dir: cannot create the directory /proc/polyaccel-nope/final" in line, err
    assert not list(Path("/proc").glob(".polyaccel-probe-*"))


def test_a_run_that_would_keep_nothing_is_refused_but_bench_runs(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: {preset: qwen3-moe-tiny}\n")
    code, out, err = _cli(capsys, config=config)
    line = _error_line(err)
    assert code == 2 and out == "" and "set output_dir" in line and "checkpoint.dir" in line
    assert main(["bench", "--config", str(config), "--steps", "1", "--warmup", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 1


def test_a_refused_run_creates_no_directory(tmp_path, capsys):
    code, _, err = _cli(capsys, f"checkpoint.dir={tmp_path / 'a/ck'}", f"log.metrics_jsonl={tmp_path / 'b/m.jsonl'}",
                        f"output_dir={tmp_path / 'c/out'}", f"data.jsonl={tmp_path / 'missing.jsonl'}")
    assert code == 2 and "data.jsonl" in _error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_a_config_path_that_is_a_directory_is_named_so(tmp_path, capsys):
    code, _, err = _cli(capsys, f"output_dir={tmp_path / 'out'}", config=tmp_path)
    assert code == 2 and f"config file {tmp_path} is a directory" in _error_line(err)


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_printed_json_is_strict_when_the_loss_is_not_finite(tmp_path, capsys):
    code, out, err = _cli(capsys, "train.nonfinite=skip", "train.lr=1e30", "train.max_steps=8",
                          "checkpoint.dir=null", f"output_dir={tmp_path / 'out'}",
                          f"log.metrics_jsonl={tmp_path / 'm.jsonl'}")
    lines = out.splitlines()
    summary = _strict(lines[-1])
    assert summary["skipped_steps"] >= 1 and summary["final_loss"] is None, err
    for line in lines[:-1] + (tmp_path / "m.jsonl").read_text().splitlines():
        _strict(line)


def _closed_stdout(*args: str, timeout: float = 300) -> tuple[int, str]:
    proc = subprocess.Popen([sys.executable, "-m", "polyaccel.moe.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    proc.stdout.close()  # like `| head -0`: the reader is gone before anything is printed
    err = proc.stderr.read().decode()
    return proc.wait(timeout=timeout), err


def test_presets_into_a_closed_pipe_exit_quietly():
    code, err = _closed_stdout("presets")
    assert code == 141 and "Traceback" not in err, err


def test_a_closed_stdout_does_not_stop_training(tmp_path):
    code, err = _closed_stdout("finetune", str(TINY), *[a for s in QUICK for a in ("--set", s)],
                               "--set", f"output_dir={tmp_path / 'out'}", "--set", "checkpoint.dir=null")
    assert code == 0 and "Traceback" not in err and "metrics lines are no longer printed" in err, err
    assert (tmp_path / "out/model.safetensors").is_file()
