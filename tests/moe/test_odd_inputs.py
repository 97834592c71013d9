"""Values and files no user means but any may meet, each refused by ``polyaccel-moe finetune``
with one line naming what is wrong and exit 2, before anything trains or is written (they
used to end in tracebacks, or to hang): a seed beyond 64 bits, the file system's root as an
output folder, a name longer than the file system takes, a NUL character in a path, a FIFO
where a run's lock file goes, a trainer state that is no dict, and a ``--set key=`` with no
value blamed on the config file's line of that key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _finetune(capsys, tmp_path: Path, *sets: str, config: Path = TINY) -> tuple[int, str]:
    sets = ("log.progress_bar=false", "train.max_steps=1", f"checkpoint.dir={tmp_path / 'ck'}",
            f"output_dir={tmp_path / 'out'}", *sets)
    code = main(["finetune", str(config), *[a for s in sets for a in ("--set", s)]])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("sets", "message"), [
    (["train.seed=99999999999999999999999"], "train.seed must be an integer in [0, 2**63), got 9999"),
    (["train.seed=-1"], "train.seed must be an integer in [0, 2**63), got -1"),
    (["output_dir=/"], "output_dir: / is the root of the file system; name a folder of its own"),
    (["checkpoint.dir=/"], "checkpoint.dir: / is the root of the file system; name a folder of its own"),
    (["output_dir={tmp}/" + "n" * 300], ("error: output_dir: ", "File name too long")),
    (["checkpoint.dir={tmp}/" + "n" * 300 + "/ck"], ("error: checkpoint.dir: ", "File name too long")),
    (["log.metrics_jsonl={tmp}/" + "n" * 300], "an output location cannot be used: File name too long: "),
    (["train.lr="], "polyaccel-moe: error: train.lr: expected a number, got None"),
])
def test_odd_values_are_refused_with_one_line(capsys, tmp_path, sets, message):
    code, err = _finetune(capsys, tmp_path, *[s.format(tmp=tmp_path) for s in sets])
    parts = (message,) if isinstance(message, str) else message
    assert code == 2 and all(p in err for p in parts) and "Traceback" not in err, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_nul_character_in_a_path_of_the_config_file_is_refused(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(TINY.read_text() + f'\nlog:\n  metrics_jsonl: "{tmp_path}/m\\0.jsonl"\n')
    code, err = _finetune(capsys, tmp_path, config=config)
    assert code == 2 and "log.metrics_jsonl: " in err and "holds a NUL character" in err, err[-2000:]


@pytest.mark.parametrize("where", ["beside", "inside"])
def test_a_fifo_at_a_lock_path_is_refused_not_read(capsys, tmp_path, where):
    """Beside output_dir, the run's lock file's name; inside, a file of output_dir's listing
    (read to tell a run's lock from the user's files): neither may block the run."""
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(tmp_path / "out.lock" if where == "beside" else out / "x.lock")
    code, err = _finetune(capsys, tmp_path)
    expected = (f"output_dir: {tmp_path / 'out.lock'} exists and is not a lock file of polyaccel-moe" if where == "beside"
                else "already holds files and no saved model (x.lock)")
    assert code == 2 and expected in err, err[-2000:]


def test_a_trainer_state_that_is_no_dict_is_named(capsys, tmp_path):
    code, _ = _finetune(capsys, tmp_path, "checkpoint.every_steps=1")
    assert code == 0
    folder = tmp_path / "resume"
    os.rename(tmp_path / "ck/step_00000001", folder)
    (folder / "manifest.json").unlink()
    torch.save([1, 2], folder / "trainer_state.pt")
    code, err = _finetune(capsys, tmp_path, f"checkpoint.resume={folder}", "checkpoint.dir=null",
                          f"output_dir={tmp_path / 'out2'}", "train.max_steps=3")
    assert code == 2 and f"{folder / 'trainer_state.pt'} is not a polyaccel trainer state" in err, err[-2000:]


def test_a_model_type_other_than_the_checkpoints_is_refused_not_ignored(capsys, tmp_path, saved):
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import ModelConfig

    code, err = _finetune(capsys, tmp_path, f"model.path={saved}", "model.config.model_type=mixtral")
    assert code == 2 and "model.config.model_type='mixtral': model.path" in err and "'qwen3_moe' model" in err, err
    assert resolve_model_config(ModelConfig(path=str(saved), config={"model_type": "qwen3_moe"})).model_type == \
        "qwen3_moe"


def test_a_field_overridden_under_its_other_name_replaces_the_presets_value():
    """Qwen3-MoE's ``num_experts`` is Transformers' other name of ``num_local_experts``, which
    the preset sets: ``--set model.config.num_experts=40`` used to be refused as two names of
    one field; it now replaces the preset's value. Both names in one layer, with two values,
    are still refused."""
    from polyaccel.moe.train import resolve_model_config
    from polyaccel.moe.train_config import ConfigError, load_config

    cfg = load_config(None, ["model.preset=qwen3-30b-a3b-L8", "model.config.num_experts=6"])
    assert resolve_model_config(cfg.model).num_experts == 6
    cfg = load_config(None, ["model.preset=qwen3-30b-a3b-L8", "model.config.num_experts=6",
                             "model.config.num_local_experts=8"])
    with pytest.raises(ConfigError, match="two names of one field"):
        resolve_model_config(cfg.model)


@pytest.mark.parametrize("key", ["output_dir", "checkpoint.dir", "log.metrics_jsonl"])
def test_a_path_that_is_a_symlink_loop_is_one_line(capsys, tmp_path, key):
    """Python 3.11's Path.resolve() raises RuntimeError on a loop: it ended in a traceback."""
    (tmp_path / "loop").symlink_to("loop")
    code, err = _finetune(capsys, tmp_path, f"{key}={tmp_path / 'loop' / 'sub'}")
    assert code == 2 and "Too many levels of symbolic links" in err and "Traceback" not in err, err[-2000:]
    out = tmp_path / "out"
    out.mkdir()
    (out / "loop").symlink_to("loop")  # inside output_dir, beside a metrics log kept elsewhere
    code, err = _finetune(capsys, tmp_path, f"log.metrics_jsonl={tmp_path / 'm.jsonl'}")
    assert code == 2 and "already holds files and no saved model (loop)" in err, err[-2000:]
