"""Small robustness cases of ``polyaccel-moe finetune``: the rescue folder holds the tokenizer
as ``output_dir`` would; a checkpoint write that fails removes the directories it created
(and only those, when empty); JSON nested too deeply in the metrics log or in the summary a
``--ray`` run hands back is a clean error naming the file (or, as the line a kill cut, dropped)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import transformers.modeling_utils
from safetensors import SafetensorError

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
QUICK = ["log.progress_bar=false", "train.max_steps=2", "checkpoint.every_steps=0"]
DEEP = b"[" * 200_000  # json.loads: RecursionError, not ValueError


def _cli(capsys, *sets: str, config: Path = TINY, extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    code = main(["finetune", str(config), *extra, *[a for s in (*QUICK, *sets) for a in ("--set", s)]])
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


# -- the rescue folder holds what output_dir would: the tokenizer too ---------------------------

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


def test_the_rescue_folder_holds_the_tokenizer_as_output_dir_would(tmp_path, capsys, monkeypatch):
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
    _full_disk(monkeypatch, disk)
    code, _, err = _cli(capsys, f"output_dir={disk / 'final'}", "checkpoint.dir=null", config=config)
    line = _error_line(err)
    rescued = list(tmp.glob("polyaccel-moe-rescue-final-*"))
    assert code == 4 and len(rescued) == 1 and f"saved instead to {rescued[0]}" in line, err
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in rescued[0].iterdir()}
    assert AutoTokenizer.from_pretrained(rescued[0]).eos_token == "</s>"


# -- a failed checkpoint write removes the directories it created, and only those -------------

def test_a_failed_checkpoint_removes_the_directories_it_created(tmp_path, capsys, monkeypatch):
    _private_tmpdir(monkeypatch, tmp_path / "tmp")
    _full_disk(monkeypatch, tmp_path / "new")
    code, _, err = _cli(capsys, f"checkpoint.dir={tmp_path / 'new/a/ck'}", f"output_dir={tmp_path / 'out'}")
    line = _error_line(err)
    assert code == 4 and "the checkpoint could not be written" in line and "written to output_dir" in line
    assert (tmp_path / "out/model.safetensors").is_file()
    assert not (tmp_path / "new").exists()  # new/, new/a/ and new/a/ck/ were made by the failed save


@pytest.mark.parametrize("before", ["empty checkpoint.dir", "checkpoint.dir with a file", "empty parent"])
def test_a_failed_checkpoint_keeps_directories_that_were_there(tmp_path, capsys, monkeypatch, before):
    _private_tmpdir(monkeypatch, tmp_path / "tmp")
    ck = tmp_path / "old/ck"
    (ck if before != "empty parent" else ck.parent).mkdir(parents=True)
    if before == "checkpoint.dir with a file":
        (ck / "notes.txt").write_text("mine")
    _full_disk(monkeypatch, ck)
    code, _, err = _cli(capsys, f"checkpoint.dir={ck}", f"output_dir={tmp_path / 'out'}")
    assert code == 4 and "the checkpoint could not be written" in _error_line(err)
    expected = {"empty checkpoint.dir": [], "checkpoint.dir with a file": ["notes.txt"]}
    if before in expected:
        assert sorted(p.name for p in ck.iterdir()) == expected[before]
    else:
        assert ck.parent.is_dir() and not ck.exists()  # old/ was there; ck/ was made by the save


def test_a_rescue_in_a_directory_the_failed_checkpoint_created_is_kept(tmp_path, capsys, monkeypatch):
    tmp = _private_tmpdir(monkeypatch, tmp_path / "tmp")
    runs = tmp_path / "runs"  # made by the checkpoint save; the rescue then goes next to output_dir, into it
    _full_disk(monkeypatch, runs / "ck")
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


@pytest.mark.parametrize("cut", [DEEP, b'{"step": 3, "loss": "\xc3'], ids=["nested too deeply", "cut UTF-8"])
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
