"""Red team, session 21: what an earlier audit left open in ``polyaccel-moe finetune``.

- ``log.metrics_jsonl`` naming a user's file whose last (or only) line has no newline: the
  piece after the last newline was taken for a line a kill cut, whatever it held, so a one-line
  note or a one-line JSON config counted as a metrics log. A run from step 0 renamed it aside
  (``notes.txt.1``) and wrote its metrics there; a resume rewrote it keeping only step
  records: emptied.
- A checkpoint written before trainer states recorded the model shape, whose ``config.json``
  is nested deeper than json parses or is not an object: resuming from it ended in a traceback
  (``RecursionError``, ``AttributeError``) where the other readers of checkpoint JSON give a
  reason; its shape now counts as unknown, as for an unreadable file (the weights' own shapes
  are still checked when they load).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe import train
from polyaccel.moe.cli import main
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


class Reached(Exception):
    """Raised instead of loading the model: every check before it passed."""


@pytest.mark.parametrize("content", [
    b"my notes, one line, no newline",
    b'{"lr": 0.001, "seed": 3}',  # a one-line JSON config (json.dump writes no newline)
    b'{"step": 1, "loss": 4.8}\nnotes appended without newline',
], ids=["note", "one-line json", "metrics then foreign tail"])
def test_a_file_whose_last_line_is_no_cut_record_is_not_a_metrics_log(tmp_path, capsys, content):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    code = main(["finetune", str(TINY), "--set", f"log.metrics_jsonl={notes}", "--set", "checkpoint.dir=null",
                 "--set", f"output_dir={tmp_path / 'out'}", "--set", "train.max_steps=1",
                 "--set", "log.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a metrics log" in err, err
    assert notes.read_bytes() == content and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_resume_never_empties_a_one_line_file_named_as_the_metrics_log(tmp_path, capsys):
    ck, out, notes = tmp_path / "ck", tmp_path / "out", tmp_path / "notes.txt"
    common = ["--set", f"checkpoint.dir={ck}", "--set", f"output_dir={out}", "--set", "checkpoint.every_steps=1",
              "--set", "log.progress_bar=false"]
    assert main(["finetune", str(TINY), *common, "--set", "train.max_steps=1"]) == 0
    notes.write_bytes(b"my notes, one line, no newline")
    code = main(["finetune", str(TINY), *common, "--set", "train.max_steps=2", "--set", f"log.metrics_jsonl={notes}"])
    assert code == 2 and "is not a metrics log" in capsys.readouterr().err
    assert notes.read_bytes() == b"my notes, one line, no newline"


@pytest.mark.parametrize("tail", [b"", b"{", b'{"st', b'{"step": ', b'{"step": 2, "lo'])
def test_a_metrics_log_cut_anywhere_in_its_last_record_is_still_one(tmp_path, monkeypatch, tail):
    log = tmp_path / "metrics.jsonl"
    log.write_bytes(b'{"step": 1, "loss": 4.8}\n' + tail)

    def refuse(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(train, "_load_model", refuse)
    cfg = load_config(TINY, [f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}",
                             "log.progress_bar=false", "train.max_steps=4", f"log.metrics_jsonl={log}"])
    with pytest.raises(Reached):
        train.finetune(cfg)


@pytest.mark.parametrize("config", ["[" * 200_000, "[1, 2]", '"a string"'],
                         ids=["nested too deeply", "a list", "a string"])
def test_an_old_checkpoints_config_json_that_is_no_object_is_an_unknown_shape_not_a_crash(tmp_path, config):
    from polyaccel.moe.resume_settings import saved_run

    d = ckpt.step_dir(tmp_path, 1)
    d.mkdir(parents=True)
    torch.save({"step": 1, "optimizer": None, "config": {}}, d / ckpt.TRAINER_STATE)  # no model_shape: older
    (d / "config.json").write_text(config)
    ckpt.write_manifest(d, 1)
    assert saved_run(d) == {"config": {}, "model_shape": {}}
