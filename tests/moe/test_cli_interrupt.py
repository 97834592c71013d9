"""Ctrl-C (SIGINT -> KeyboardInterrupt) in ``polyaccel-moe finetune`` / ``bench``: exit 130 and
one line on stderr naming the checkpoint a rerun resumes from, no traceback; an interrupt
during a checkpoint save leaves no half checkpoint. SIGTERM (143) and SIGHUP (129) end a run the
same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.moe import checkpoint as ckpt
from polyaccel.moe import train
from polyaccel.moe.cli import main

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _main(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except KeyboardInterrupt:  # (left to pytest, it would end the whole session)
        pytest.fail("main() let KeyboardInterrupt through (a traceback for the user)")
    out, err = capsys.readouterr()
    return code, out, err


def _finetune(capsys, *sets: str) -> tuple[int, str, str]:
    return _main(capsys, ["finetune", str(TINY), *[a for s in sets for a in ("--set", s)]])


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupted_finetune_exits_130_with_one_line_naming_the_newest_checkpoint(capsys, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    for step in (2, 4):
        (ck / f"step_{step:08d}").mkdir(parents=True)
        (ck / f"step_{step:08d}" / ckpt.MANIFEST).write_text(json.dumps({"step": step, "files": {}}))
    (ck / "step_00000006.tmp").mkdir()  # a save the interrupt cut off: not a checkpoint
    monkeypatch.setattr(train, "finetune", _interrupt)
    code, out, err = _finetune(capsys, f"checkpoint.dir={ck}", f"output_dir={tmp_path / 'out'}")
    assert code == 130 and out == ""
    assert err == ("polyaccel-moe: interrupted; rerun the same command to resume from the last checkpoint "
                   f"({ck / 'step_00000004'})\n")


def test_interrupted_finetune_without_checkpoints_says_nothing_was_saved(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(train, "finetune", _interrupt)
    code, _, err = _finetune(capsys, f"output_dir={tmp_path / 'out'}", "checkpoint.dir=null")
    assert code == 130 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("polyaccel-moe: interrupted; nothing of this run was saved")
    code, _, err = _finetune(capsys, f"checkpoint.dir={tmp_path / 'ck'}")
    assert code == 130 and err.count("\n") == 1
    assert "no checkpoint was completed in checkpoint.dir" in err and "starts over" in err


def test_interrupted_bench_exits_130(capsys, monkeypatch):
    monkeypatch.setattr(train, "benchmark", _interrupt)
    code, out, err = _main(capsys, ["bench", "--preset", "qwen3-moe-tiny", "--steps", "1", "--warmup", "0"])
    assert code == 130 and out == ""
    assert err == "polyaccel-moe: interrupted; bench writes nothing, so nothing was saved\n"


def test_an_interrupt_during_a_save_leaves_no_half_checkpoint_and_the_rerun_resumes(capsys, tmp_path, monkeypatch):
    """Ctrl-C while step 4's checkpoint is being written (its files are there, the manifest
    not yet): step_4 does not appear, the line names step 2, and the same command resumes
    from step 2 and finishes."""
    sets = (f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}", "train.max_steps=4",
            "checkpoint.every_steps=2", "checkpoint.keep_last=0", "log.progress_bar=false")
    original = ckpt.write_manifest

    def interrupted_at_step_4(directory, step):
        if step == 4:
            raise KeyboardInterrupt
        return original(directory, step)
    monkeypatch.setattr(ckpt, "write_manifest", interrupted_at_step_4)
    code, _, err = _finetune(capsys, *sets)
    step2 = tmp_path / "ck/step_00000002"
    assert code == 130 and "Traceback" not in err
    assert err.splitlines()[-1] == ("polyaccel-moe: interrupted; rerun the same command to resume from the last "
                                    f"checkpoint ({step2})")
    assert ckpt.complete_checkpoints(tmp_path / "ck") == [step2] and ckpt.verify_checkpoint(step2) is None
    assert not (tmp_path / "ck/step_00000004").exists() and not (tmp_path / "out").exists()
    monkeypatch.setattr(ckpt, "write_manifest", original)
    code, out, _ = _finetune(capsys, *sets)
    summary = json.loads(out.splitlines()[-1])
    assert code == 0 and summary["start_step"] == 2 and summary["steps"] == 4
    assert (tmp_path / "out/model.safetensors").is_file()


def test_sigterm_ends_finetune_like_ctrl_c_exit_143_naming_the_newest_checkpoint(capsys, tmp_path, monkeypatch):
    """SIGTERM (kill, timeout, a scheduler's pre-emption), delivered for real while training
    runs, unwinds as Ctrl-C does: exit 143, one line naming the checkpoint a rerun resumes from
    (no more the default end: no line, nothing said); the process's own handler is restored."""
    import os
    import signal

    ck = tmp_path / "ck"
    (ck / "step_00000002").mkdir(parents=True)
    (ck / "step_00000002" / ckpt.MANIFEST).write_text(json.dumps({"step": 2, "files": {}}))

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not end the run")

    unhandled = []
    previous = signal.signal(signal.SIGTERM, lambda *a: unhandled.append(1))  # never this test process's end
    try:
        monkeypatch.setattr(train, "finetune", terminated)
        code, out, err = _finetune(capsys, f"checkpoint.dir={ck}", f"output_dir={tmp_path / 'out'}")
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL and not unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and out == ""
    assert err == ("polyaccel-moe: terminated; rerun the same command to resume from the last checkpoint "
                   f"({ck / 'step_00000002'})\n")


def test_sighup_ends_finetune_like_sigterm_exit_129_unless_ignored(capsys, tmp_path, monkeypatch):
    """SIGHUP (the terminal closed) ends a run as SIGTERM does, with 129 "hung up"; under
    ``nohup`` (SIGHUP ignored) it stays ignored and the run goes on."""
    import os
    import signal

    seen = []

    def hung_up(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGHUP)
        seen.append("ran on")
        raise RuntimeError("SIGHUP did not end the run")

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        monkeypatch.setattr(train, "finetune", hung_up)
        code, out, err = _finetune(capsys, f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # put back
        assert code == 129 and out == "" and not seen, err
        assert err.startswith("polyaccel-moe: hung up"), err
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup leaves it
        with pytest.raises(RuntimeError, match="SIGHUP did not end the run"):
            _finetune(capsys, f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}")
        assert seen == ["ran on"]
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_second_ctrl_c_while_finetune_unwinds_ends_the_process_instead_of_raising_again(capsys, tmp_path,
                                                                                           monkeypatch):
    """Ctrl-C, delivered for real, unwinds the run (exit 130, the resume line); from then on
    Ctrl-C is the default action, so a second one while the run removes a half checkpoint or
    the interpreter exits ends the process at once instead of raising inside that cleanup (a
    traceback, or SIGABRT with threads left in torch). A run not interrupted puts Python's own
    handler back."""
    import os
    import signal

    during_unwind = []

    def interrupted(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("Ctrl-C did not end the run")
        finally:
            during_unwind.append(signal.getsignal(signal.SIGINT))

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a shell
    try:
        monkeypatch.setattr(train, "finetune", interrupted)
        code, _, err = _finetune(capsys, f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}")
        assert code == 130 and "interrupted" in err
        assert during_unwind == [signal.SIG_DFL] and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert _main(capsys, ["presets"])[0] == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
