"""What a user trained is never lost, and the CLI says so in one line: a final save or a
checkpoint that cannot be written (full disk) exits 4 with the trained weights in the final
checkpoint or a fallback folder; output locations are proven writable before training; a
run that would keep nothing is refused; a refused run creates no directory; the printed JSON
is strict; a closed stdout ends ``presets`` quietly and never stops a training run, another
broken pipe (a metrics log FIFO whose reader left) is one warning naming it while training
goes on, not 141; a failure after a
checkpoint's rename (pruning, the directory sync) is a warning, the checkpoint is written; a
kill between the final save's moves leaves a folder that does not load (never mixed weights).
Also: the rescue folder holds the tokenizer as ``output_dir`` would, and the line says it is
private and when a reboot deletes it (tmpfs); a checkpoint write that fails
removes the directories it created (only those, when empty); JSON nested too deeply in the
metrics log or in the summary a ``--ray`` run hands back is a clean error naming the file (or,
as the line a kill cut, dropped)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from safetensors.torch import load_file

from polyaccel.moe import train
from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
QUICK = ["log.progress_bar=false", "train.max_steps=2", "checkpoint.every_steps=0"]


def _cli(capsys, *sets: str, config: Path = TINY, extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    code = main(["finetune", str(config), *extra, *[a for s in (*QUICK, *sets) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


def _private_tmpdir(monkeypatch, path: Path) -> Path:
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))  # what $TMPDIR sets
    return path


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("polyaccel-moe: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_final_save_that_fails_without_checkpoints_rescues_the_weights(full_disk, tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    full_disk(disk)
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


def test_a_rescue_goes_on_when_the_temporary_directory_cannot_be_found(full_disk, tmp_path, capsys, monkeypatch):
    """On a full disk finding $TMPDIR itself can fail (every candidate unwritable): the rescue
    must go on to the working directory, not end with a traceback and the weights lost."""
    disk = tmp_path / "disk"
    disk.mkdir()
    full_disk(disk)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def no_tempdir():
        raise FileNotFoundError("No usable temporary directory found in ['/tmp', '/var/tmp']")

    monkeypatch.setattr(tempfile, "gettempdir", no_tempdir)
    code, _, err = _cli(capsys, f"output_dir={disk / 'final'}", "checkpoint.dir=null")
    line = _error_line(err)
    rescued = list(cwd.glob("polyaccel-moe-rescue-final-*"))
    assert code == 4 and len(rescued) == 1 and f"saved instead to {rescued[0]}" in line, err


def test_a_final_save_that_fails_names_the_final_checkpoint_and_a_rerun_writes_it(full_disk, tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    full_disk(disk)
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


def test_a_checkpoint_that_cannot_be_written_stops_with_the_weights_rescued(full_disk, tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    full_disk(disk)
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


def test_an_unbuffered_stdout_into_a_closed_pipe_exits_quietly_too():
    proc = subprocess.Popen([sys.executable, "-u", "-m", "polyaccel.moe.cli", "presets"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    proc.stdout.close()  # with -u nothing is left to flush: the closed pipe is seen by poll
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err


def test_a_metrics_log_fifo_whose_reader_left_is_a_warning_and_training_goes_on(tmp_path, capsys, caplog):
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)

    def leave():
        with open(fifo, "rb"):  # returns once finetune opens the log, then the reader goes away
            pass

    reader = threading.Thread(target=leave, daemon=True)
    reader.start()
    try:
        with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
            code, out, err = _cli(capsys, "train.max_steps=4", "checkpoint.dir=null",
                                  f"output_dir={tmp_path / 'out'}", f"log.metrics_jsonl={fifo}")
    finally:
        if reader.is_alive():  # finetune never opened it: release the reader
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=60)
    assert code == 0, err  # not 141 (stdout is fine), and the run was not stopped for a metrics line
    assert json.loads(out.splitlines()[-1])["steps"] == 4
    assert (tmp_path / "out/model.safetensors").is_file()
    assert caplog.text.count(f"the metrics log {fifo} could not be written") == 1


def test_a_closed_stdout_does_not_stop_training(tmp_path):
    code, err = _closed_stdout("finetune", str(TINY), *[a for s in QUICK for a in ("--set", s)],
                               "--set", f"output_dir={tmp_path / 'out'}", "--set", "checkpoint.dir=null")
    assert code == 0 and "Traceback" not in err and "metrics lines are no longer printed" in err, err
    assert (tmp_path / "out/model.safetensors").is_file()


# ---- what fails after a checkpoint's rename (pruning, the directory sync) is a warning, not a failed save

def _finished_with_the_checkpoint(tmp_path: Path, code: int, out: str, err: str) -> Path:
    """The run finished (exit 0, its summary printed) with the final checkpoint written and loadable."""
    assert code == 0 and "could not be written" not in err, err
    final = tmp_path / "ck/step_00000003"
    assert json.loads(out.splitlines()[-1])["last_checkpoint"] == str(final)
    assert train.ckpt.verify_checkpoint(final) is None
    assert transformers.AutoModelForCausalLM.from_pretrained(final).config.num_hidden_layers == 2
    assert (tmp_path / "out/model.safetensors").is_file()
    return final


def test_old_checkpoints_that_cannot_be_pruned_are_a_warning_naming_them(tmp_path, capsys, monkeypatch, caplog):
    real = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kwargs):  # an old checkpoint's files cannot be removed
        if re.fullmatch(r"step_\d+", Path(path).name) and Path(path).exists():
            if ignore_errors:
                return None
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "model.safetensors"))
        return real(path, ignore_errors=ignore_errors, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, out, err = _cli(capsys, "train.max_steps=3", "checkpoint.every_steps=1", "checkpoint.keep_last=1",
                              f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}")
    _finished_with_the_checkpoint(tmp_path, code, out, err)
    for old in ("step_00000001", "step_00000002"):
        assert (tmp_path / "ck" / old).is_dir()
        assert (f"old checkpoint {tmp_path / 'ck' / old} could not be removed (checkpoint.keep_last=1: Permission "
                f"denied: {tmp_path / 'ck' / old / 'model.safetensors'}); remove it yourself") in caplog.text


def test_a_checkpoint_directory_that_cannot_be_synced_after_the_rename_is_a_warning(tmp_path, capsys, monkeypatch,
                                                                                      caplog):
    real = train.ckpt._fsync_dir

    def fsync_dir(path):  # the step_N.tmp folder syncs; checkpoint.dir, after the rename, does not
        if Path(path) == tmp_path / "ck":
            raise OSError(errno.EIO, "Input/output error")
        real(path)

    monkeypatch.setattr(train.ckpt, "_fsync_dir", fsync_dir)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, out, err = _cli(capsys, "train.max_steps=3", "checkpoint.every_steps=3",
                              f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}")
    final = _finished_with_the_checkpoint(tmp_path, code, out, err)
    assert (f"checkpoint {final} is written, but its directory {tmp_path / 'ck'} could not be synced "
            "(Input/output error)") in caplog.text


# ---- small cases: the rescue folder, directories a failed checkpoint created, JSON nested too deeply

DEEP = b"[" * 200_000  # json.loads: RecursionError, not ValueError


def _model_with_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64)).save_pretrained(path)
    words = "the cat sat on a mat what is two plus four six".split()
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def test_the_rescue_folder_holds_the_tokenizer_as_output_dir_would(full_disk, tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    base = _model_with_tokenizer(tmp_path / "base")
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "what is two plus four", "completion": "six"}) + "\n")
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"path": str(base)}, "data": {"jsonl": str(data)},
                                  "train": {"seq_len": 8, "micro_batch": 1, "grad_accum": 1, "dtype": "fp32",
                                            "device": "cpu"}}))
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    full_disk(disk)
    code, _, err = _cli(capsys, f"output_dir={disk / 'final'}", "checkpoint.dir=null", config=config)
    line = _error_line(err)
    rescued = list(tmp.glob("polyaccel-moe-rescue-final-*"))
    assert code == 4 and len(rescued) == 1 and f"saved instead to {rescued[0]}" in line, err
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in rescued[0].iterdir()}
    assert AutoTokenizer.from_pretrained(rescued[0]).eos_token == "</s>"


@pytest.mark.parametrize("fs", ["ext4", "tmpfs"])
def test_the_rescue_line_says_the_folder_is_private_and_when_a_reboot_deletes_it(full_disk, tmp_path, capsys, monkeypatch, fs):
    disk = tmp_path / "disk"
    disk.mkdir()
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\n{fs} {tmp.resolve()} {fs} rw 0 0\n")
    monkeypatch.setattr(train, "_MOUNTS", mounts)
    full_disk(disk)
    code, _, err = _cli(capsys, f"output_dir={disk / 'final'}", "checkpoint.dir=null")
    line = _error_line(err)
    rescued = list(tmp.glob("polyaccel-moe-rescue-final-*"))
    assert code == 4 and len(rescued) == 1 and f"saved instead to {rescued[0]}" in line, err
    assert rescued[0].stat().st_mode & 0o777 == 0o700  # private, as the line says
    assert f"private to your user (mode 700): chmod -R go+rX {rescued[0]} if others need it" in line
    assert ("It is on a tmpfs (in memory): a reboot deletes it, so move it to a disk" in line) == (fs == "tmpfs")


def test_an_in_memory_file_system_is_the_mount_with_the_longest_mount_point(tmp_path, monkeypatch):
    base = tmp_path.resolve()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\n"
                      f"tmpfs {base}/in\\040memory tmpfs rw 0 0\n"  # /proc/mounts writes a space as \040
                      f"/dev/vdb {base}/in\\040memory/disk xfs rw 0 0\n"
                      f"none {base}/ram ramfs rw 0 0\n"
                      f"tmpfs {base}/over tmpfs rw 0 0\n"
                      f"/dev/vdc {base}/over ext4 rw 0 0\n")  # mounted later over the tmpfs: hides it
    monkeypatch.setattr(train, "_MOUNTS", mounts)
    assert train._memory_fs(base / "in memory/rescue") == "tmpfs"
    assert train._memory_fs(base / "ram") == "ramfs"
    assert train._memory_fs(base / "in memory/disk/rescue") is None
    assert train._memory_fs(base / "in memoryx") is None  # a prefix of the name is not a parent
    assert train._memory_fs(base / "over/rescue") is None
    monkeypatch.setattr(train, "_MOUNTS", tmp_path / "missing")  # not Linux: nothing said
    assert train._memory_fs(base / "in memory/rescue") is None


# -- a failed checkpoint write removes the directories it created, and only those -------------

def test_a_failed_checkpoint_removes_the_directories_it_created(full_disk, tmp_path, capsys, monkeypatch):
    _private_tmpdir(monkeypatch, tmp_path / "tmp")
    full_disk(tmp_path / "new")
    code, _, err = _cli(capsys, f"checkpoint.dir={tmp_path / 'new/a/ck'}", f"output_dir={tmp_path / 'out'}")
    line = _error_line(err)
    assert code == 4 and "the checkpoint could not be written" in line and "written to output_dir" in line
    assert (tmp_path / "out/model.safetensors").is_file()
    assert not (tmp_path / "new").exists()  # new/, new/a/ and new/a/ck/ were made by the failed save


@pytest.mark.parametrize("before", ["empty checkpoint.dir", "checkpoint.dir with a file", "empty parent"])
def test_a_failed_checkpoint_keeps_directories_that_were_there(full_disk, tmp_path, capsys, monkeypatch, before):
    _private_tmpdir(monkeypatch, tmp_path / "tmp")
    ck = tmp_path / "old/ck"
    (ck if before != "empty parent" else ck.parent).mkdir(parents=True)
    if before == "checkpoint.dir with a file":
        (ck / "notes.txt").write_text("mine")
    full_disk(ck)
    code, _, err = _cli(capsys, f"checkpoint.dir={ck}", f"output_dir={tmp_path / 'out'}")
    assert code == 4 and "the checkpoint could not be written" in _error_line(err)
    expected = {"empty checkpoint.dir": [], "checkpoint.dir with a file": ["notes.txt"]}
    if before in expected:
        assert sorted(p.name for p in ck.iterdir()) == expected[before]
    else:
        assert ck.parent.is_dir() and not ck.exists()  # old/ was there; ck/ was made by the save


def test_a_rescue_in_a_directory_the_failed_checkpoint_created_is_kept(full_disk, tmp_path, capsys, monkeypatch):
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    runs = tmp_path / "runs"  # made by the checkpoint save; the rescue then goes next to output_dir, into it
    full_disk(runs / "ck")
    code, _, err = _cli(capsys, f"checkpoint.dir={runs / 'ck'}", f"output_dir={runs / 'final'}",
                        "train.max_steps=4", "checkpoint.every_steps=2")
    line = _error_line(err)
    rescued = list(runs.glob("polyaccel-moe-rescue-step_00000002-*"))
    assert code == 4 and len(rescued) == 1 and str(rescued[0]) in line, err
    assert (rescued[0] / "model.safetensors").is_file() and list(tmp.iterdir()) == []
    assert sorted(p.name for p in runs.iterdir()) == [rescued[0].name]  # ck/ (empty) removed, runs/ kept


# -- JSON nested too deeply where train.py reads its metrics log back --------------------------

def test_a_metrics_log_line_nested_too_deeply_is_refused_naming_the_file(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b'{"step": 1}\n' + DEEP + b"\n")
    code, out, err = _cli(capsys, "checkpoint.dir=null", f"output_dir={tmp_path / 'out'}",
                          f"log.metrics_jsonl={metrics}")
    line = _error_line(err)
    assert code == 2 and out == "" and f"log.metrics_jsonl: {metrics} already exists" in line and "line 2" in line
    assert metrics.read_bytes() == b'{"step": 1}\n' + DEEP + b"\n" and not (tmp_path / "out").exists()


# A cut line starts as every line is written ('{"step": '); one that does not is not a metrics
# log's (session 21: a one-line note without newline was taken for one and emptied by a resume).
@pytest.mark.parametrize("cut", [b'{"step": 3, "x": ' + DEEP, b'{"step": 3, "loss": "\xc3'],
                         ids=["nested too deeply", "cut UTF-8"])
def test_a_cut_last_line_of_the_metrics_log_is_dropped_whatever_its_bytes(tmp_path, capsys, cut):
    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b'{"step": 1, "loss": 9.0}\n' + cut)  # no newline: the line a kill cut
    code, _, err = _cli(capsys, "checkpoint.dir=null", f"output_dir={tmp_path / 'out'}",
                        f"log.metrics_jsonl={metrics}", "log.every_steps=1")
    assert code == 0 and "Traceback" not in err, err
    records = [json.loads(line) for line in metrics.read_bytes().split(b"\n")[:-1]]
    assert [r["step"] for r in records] == [1, 2] and records[0]["loss"] != 9.0  # this run's, once each


# -- the summary a --ray run hands back ---------------------------------------------------------

@pytest.mark.parametrize("summary, why", [
    (DEEP, "not valid JSON (nested too deeply)"),
    (b"{not json", "not valid JSON (Expecting property name"),
    (b"\xff", "not valid JSON ('utf-8' codec can't decode"),
    (b"[1]", "a JSON list, not an object"),
])
def test_a_ray_summary_that_cannot_be_read_is_a_clean_error_naming_it(tmp_path, capsys, monkeypatch, summary, why):
    pytest.importorskip("ray.train.torch")
    import ray.train.torch

    from polyaccel.moe.ray_train import SUMMARY_FILE

    handed_back = tmp_path / "ray-checkpoint"
    handed_back.mkdir()
    (handed_back / SUMMARY_FILE).write_bytes(summary)

    class Trainer:  # stands in for TorchTrainer: the workers ran; this is what fit() returns
        def __init__(self, *args, **kwargs):
            pass

        def fit(self):
            return type("Result", (), {"checkpoint": ray.train.Checkpoint.from_directory(handed_back),
                                       "error": None})()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no cluster is started
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2})
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    code, out, err = _cli(capsys, f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}",
                          extra=("--ray", "--workers", "2"))
    line = _error_line(err)
    assert code == 2 and out == "", err
    assert f"summary {handed_back / SUMMARY_FILE} cannot be read: {why}" in line
    assert f"output_dir {tmp_path / 'out'} and checkpoint.dir {tmp_path / 'ck'}" in line


class _Killed(BaseException):
    """A kill, as far as the code under test can tell (nothing catches it)."""


@pytest.mark.parametrize("kill_at", ["second move", "config.json"])
@pytest.mark.parametrize("checkpoints", [False, True])
def test_a_kill_between_the_final_moves_leaves_a_folder_that_does_not_load_and_a_rerun_writes_it(
        tmp_path, capsys, monkeypatch, kill_at, checkpoints):
    """The final save moves its files into output_dir one by one: a kill between them must
    not leave the new weights under the earlier save's config (a model that loads, mixed).
    The earlier config goes first and the new one comes last, and the same command run again
    writes a whole model there (with checkpoints: from the final one, without training)."""
    out = tmp_path / "final"
    ck = [f"checkpoint.dir={tmp_path / 'ck2'}", "checkpoint.every_steps=2"] if checkpoints else ["checkpoint.dir=null"]
    assert _cli(capsys, f"output_dir={out}", "checkpoint.dir=null")[0] == 0
    first = load_file(out / "model.safetensors")
    sets = [f"output_dir={out}", "train.seed=7", *ck]
    real_replace, moves = os.replace, []

    def killed(src, dst, *args, **kwargs):
        if train._STAGING in str(src):
            moves.append(dst)
            if (len(moves) == 2) if kill_at == "second move" else Path(dst).name == "config.json":
                raise _Killed
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(_Killed):
        _cli(capsys, *sets)
    monkeypatch.undo()
    moved = load_file(out / "model.safetensors")
    assert any(not torch.equal(moved[k], first[k]) for k in first)  # the new weights are in
    assert not (out / "config.json").exists()  # ... and the folder does not load as a model
    code, _, err = _cli(capsys, *sets)
    assert code == 0, err
    assert (out / "config.json").is_file() and not (out / train._STAGING).exists()
    transformers.AutoConfig.from_pretrained(out)
    if checkpoints:
        final = load_file(tmp_path / "ck2/step_00000002/model.safetensors")
        assert all(torch.equal(load_file(out / "model.safetensors")[k], final[k]) for k in final)


def _save_into(out: Path, files: dict[str, bytes], kill_at: str | None = None, monkeypatch=None) -> None:
    """``train._write_output`` of a save made of ``files``; with ``kill_at``, killed as it moves
    that file into place."""
    from polyaccel.moe.train_config import load_config

    cfg = load_config(TINY, [f"output_dir={out}", "checkpoint.dir=null"])
    if kill_at is not None:
        real = os.replace

        def killed(src, dst, *args, **kwargs):
            if Path(dst).name == kill_at:
                raise _Killed
            return real(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", killed)

    def write(staging: Path) -> None:
        for name, data in files.items():
            (staging / name).write_bytes(data)

    train._write_output(cfg, write)


def test_a_save_cut_before_its_config_never_leaves_the_old_weights_beside_the_new_config(tmp_path, monkeypatch):
    """A single-file save replaced by a sharded one (Transformers prefers model.safetensors):
    the old file is gone before the new config lands, so no kill loads old weights."""
    out = tmp_path / "out"
    _save_into(out, {"config.json": b"{}", "model.safetensors": b"old"})
    shards = {"model-00001-of-00002.safetensors": b"a", "model-00002-of-00002.safetensors": b"b",
              "model.safetensors.index.json": b"{}", "config.json": b'{"new": 1}'}
    with pytest.raises(_Killed):
        _save_into(out, shards, kill_at="config.json", monkeypatch=monkeypatch)
    assert not (out / "model.safetensors").exists() and not (out / "config.json").exists()
    monkeypatch.undo()
    _save_into(out, shards)
    assert sorted(p.name for p in out.iterdir()) == sorted([*shards, train._RECORD])


def test_an_adapter_save_leaves_a_config_json_it_does_not_write(tmp_path):
    """PEFT writes no config.json: a user's own beside earlier adapters stays."""
    out = tmp_path / "out"
    _save_into(out, {"adapter_config.json": b"{}", "adapter_model.safetensors": b"old"})
    (out / "config.json").write_text("mine")
    _save_into(out, {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"new"})
    assert (out / "config.json").read_text() == "mine" and (out / "adapter_model.safetensors").read_bytes() == b"new"


def test_a_save_deletes_only_weight_files_named_as_a_save_names_them(tmp_path):
    """An earlier save's shards this save lacks go; a user's own weight files beside them
    (a variant, a backup) whose names no save writes stay."""
    out = tmp_path / "out"
    shards = {"model-00001-of-00002.safetensors": b"a", "model-00002-of-00002.safetensors": b"b",
              "model.safetensors.index.json": b"{}", "config.json": b"{}"}
    _save_into(out, shards)
    mine = {"model.fp16.safetensors": b"variant", "model.orig.safetensors": b"backup",
            "pytorch_model-final.bin": b"pickle", "model-best.safetensors": b"best"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    _save_into(out, {"model.safetensors": b"new", "config.json": b'{"new": 1}'})
    assert sorted(p.name for p in out.iterdir()) == sorted(["model.safetensors", "config.json", train._RECORD, *mine])
    assert all((out / name).read_bytes() == data for name, data in mine.items())


def test_a_run_from_step_0_keeps_an_earlier_metrics_log_instead_of_emptying_it(tmp_path, capsys):
    """A new run pointed at another run's metrics log (same log.metrics_jsonl, no checkpoint to
    resume) writes a fresh log; the earlier records are kept, renamed .1 (then .2), intact."""
    metrics = tmp_path / "m.jsonl"
    earlier = b'{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n'
    metrics.write_bytes(earlier)
    (tmp_path / "m.jsonl.1").write_bytes(b'{"step": 7}\n')  # an older one still: never replaced
    code, _, err = _cli(capsys, "checkpoint.dir=null", f"output_dir={tmp_path / 'out'}",
                        f"log.metrics_jsonl={metrics}", "log.every_steps=1")
    assert code == 0, err
    assert (tmp_path / "m.jsonl.2").read_bytes() == earlier and (tmp_path / "m.jsonl.1").read_bytes() == b'{"step": 7}\n'
    assert [json.loads(line)["loss"] != 9.0 for line in metrics.read_text().splitlines()] == [True, True]
