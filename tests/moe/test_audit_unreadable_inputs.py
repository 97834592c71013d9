"""Inputs the user running ``polyaccel-moe`` may not read (another user's files, mode 000) are
one line and exit 2, or, for a checkpoint ``resume: auto`` would pick, a warning and the
newest one that can be read; never a ``PermissionError`` traceback. Tests run as root, which
reads everything: :func:`as_a_user` drops the capabilities that let root ignore permissions
(this thread's effective set only, restored after)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import transformers  # noqa: F401  (at collection: its log handler binds the sys.stderr of its first import, not a test's capsys)

from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _VERSION_3 = 1, 2, 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capabilities(libc, data=None):
    """This thread's capability sets (``capget``), or set them to ``data`` (``capset``)."""
    header, sets = _Header(_VERSION_3, 0), (data if data is not None else (_Data * 2)())
    if (libc.capset if data is not None else libc.capget)(ctypes.byref(header), sets) != 0:
        raise OSError(ctypes.get_errno(), "capget/capset failed")
    return sets


@pytest.fixture
def as_a_user():
    """Permissions apply from here to the end of the test, even when it runs as root."""
    if os.geteuid() != 0:
        yield
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        saved = _capabilities(libc)
        dropped = (_Data * 2).from_buffer_copy(saved)
        dropped[0].effective &= ~((1 << _CAP_DAC_OVERRIDE) | (1 << _CAP_DAC_READ_SEARCH))
        _capabilities(libc, dropped)
    except (OSError, AttributeError) as e:
        pytest.skip(f"cannot drop root's file capabilities here ({e})")
    try:
        yield
    finally:
        _capabilities(libc, saved)


def _finetune(capsys, tmp_path: Path, *sets: str) -> tuple[int, str, str]:
    base = ("train.max_steps=2", "log.progress_bar=false", f"output_dir={tmp_path / 'out'}", "checkpoint.dir=null")
    code = main(["finetune", str(TINY), *[a for s in (*base, *sets) for a in ("--set", s)]])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_a_data_file_the_user_may_not_read_is_one_line_exit_2(tmp_path, capsys, as_a_user, kind):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    data.chmod(0)
    code, _, err = _finetune(capsys, tmp_path, f"data.{kind}={data}")
    assert code == 2, err
    assert f"data.{kind}: cannot read {data} (Permission denied)" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_a_model_folder_or_weights_the_user_may_not_read_are_one_line_exit_2(tmp_path, capsys, as_a_user, saved):
    model = tmp_path / "model"
    shutil.copytree(saved, model)
    model.chmod(0)
    code, _, err = _finetune(capsys, tmp_path, "model.preset=null", f"model.path={model}")
    assert code == 2 and f"model.path: cannot read {model} (Permission denied)" in err and "Traceback" not in err
    model.chmod(0o755)
    (model / "model.safetensors").chmod(0)
    code, _, err = _finetune(capsys, tmp_path, "model.preset=null", f"model.path={model}")
    assert code == 2 and f"{model / 'model.safetensors'} cannot be read (Permission denied)" in err, err


def test_a_checkpoint_the_user_may_not_read_is_passed_over_or_refused_naming_it(tmp_path, capsys, caplog, as_a_user):
    ck = tmp_path / "ck"
    code, _, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", "checkpoint.every_steps=1")
    assert code == 0, err
    (ck / "step_00000002").chmod(0)
    code, _, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", f"checkpoint.resume={ck / 'step_00000002'}",
                             f"output_dir={tmp_path / 'out2'}")
    assert code == 2 and "Traceback" not in err, err
    assert f"checkpoint.resume: {ck / 'step_00000002/manifest.json'} cannot be read (Permission denied)" in err
    (ck / "step_00000002").chmod(0o755)
    (ck / "step_00000002/trainer_state.pt").chmod(0)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        code, out, err = _finetune(capsys, tmp_path, f"checkpoint.dir={ck}", "train.max_steps=3",
                                   f"output_dir={tmp_path / 'out3'}")
    assert code == 0, err
    assert "not resuming from checkpoint step_00000002" in caplog.text and "trainer_state.pt cannot be read" in caplog.text
    assert json.loads(out.splitlines()[-1])["start_step"] == 1
