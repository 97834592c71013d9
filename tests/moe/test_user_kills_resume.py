"""Real SIGKILLs of ``polyaccel-moe finetune`` (a separate process), then the same command again:
the run ends with the uninterrupted run's final weights, bit for bit on CPU, and its metrics log
holds each step once.

The child kills itself at an exact point (no timing race): in the middle of a checkpoint save
(its files written, before its manifest), and between the final save's moves into ``output_dir``
(the new weights moved in, the config not yet).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from polyaccel.moe.cli import main

# Runs polyaccel-moe's CLI with one function wrapped to SIGKILL the process at the chosen point.
_CHILD = r"""
import os, signal, sys
from polyaccel.moe import checkpoint, train
where, step = sys.argv[1], int(sys.argv[2])

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "manifest":
    real_manifest = checkpoint.write_manifest
    def write_manifest(directory, at):
        if at == step:
            die()
        return real_manifest(directory, at)
    checkpoint.write_manifest = write_manifest
elif where == "final_moves":
    real_replace = os.replace
    def replace(src, dst, *a, **k):
        real_replace(src, dst, *a, **k)
        if str(dst).endswith(os.sep + "final" + os.sep + "model.safetensors"):
            die()
    train.os.replace = replace
from polyaccel.moe.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _argv(base: Path, data: Path, run: Path) -> list[str]:
    sets = [f"model.path={base}", f"data.jsonl={data}", "train.seq_len=8", "train.micro_batch=2",
            "train.grad_accum=2", "train.max_steps=4", "train.lr=1e-2", "train.dtype=fp32", "train.device=cpu",
            f"output_dir={run}/final", f"checkpoint.dir={run}/ck", "checkpoint.every_steps=1",
            "checkpoint.keep_last=2", "log.progress_bar=false", f"log.metrics_jsonl={run}/metrics.jsonl"]
    return ["finetune", str(base / "run.yaml")] + [a for s in sets for a in ("--set", s)]


def _killed(where: str, step: int, argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", _CHILD, where, str(step), *argv], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def job(tmp_path_factory, saved):
    """A model folder with a tokenizer, JSONL text data, and the uninterrupted run's folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("kills")
    base = root / "base"
    shutil.copytree(saved, base)
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2, "b": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(base)
    (base / "run.yaml").write_text("model: {}\n")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join("ab"[j % 2] for j in range(i % 7 + 1))}) + "\n"
                            for i in range(24)))
    assert main(_argv(base, data, root / "straight")) == 0
    return base, data, root / "straight"


@pytest.mark.parametrize("kills", [[("manifest", 2)], [("final_moves", 0)]],
                         ids=["mid-checkpoint", "between-final-moves"])
def test_sigkilled_finetune_rerun_ends_with_the_uninterrupted_weights(tmp_path, job, kills):
    base, data, straight = job
    run = tmp_path / "killed"
    for where, step in kills:
        r = _killed(where, step, _argv(base, data, run))
        assert r.returncode == -9, r.stderr[-2000:]
    if kills[-1][0] == "final_moves":
        assert not (run / "final" / "config.json").exists()  # the kill did land between the moves
    assert main(_argv(base, data, run)) == 0
    want, got = load_file(straight / "final/model.safetensors"), load_file(run / "final/model.safetensors")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert transformers.AutoModelForCausalLM.from_pretrained(run / "final").config.num_hidden_layers == 2  # loads
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
