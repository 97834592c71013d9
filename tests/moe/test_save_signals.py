"""A Ctrl-C, SIGTERM or SIGHUP that arrives while the final save moves its staged files into
``output_dir`` waits until the last move: the folder then holds the whole new model (its
``config.json`` included) and the signal still ends the run the usual way (130/143/129, one
line). Delivered between the moves, it left a folder without ``config.json``, which does not
load, as only a SIGKILL (or a power loss) there still can."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest

from polyaccel.core.clitools import Terminated, interrupt_status, sigterm_as_interrupt
from polyaccel.moe import train

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
NEW = {"config.json": b'{"new": 1}', "generation_config.json": b'{"new": 2}', "model.safetensors": b"new weights"}


@pytest.fixture
def handlers_kept():
    """The handlers of the held signals are as they were after the test, whatever it did."""
    before = {n: signal.getsignal(n) for n in train._HELD_SIGNALS}
    yield before
    for signum, handler in before.items():
        signal.signal(signum, handler)


@pytest.fixture
def signal_on_first_weight_move(monkeypatch):
    """``signal_on_first_weight_move(signum, out)``: from now on, the first ``os.replace`` of a
    weight file into ``out`` moves it, then sends ``signum`` to this process (as a ``kill``
    between the moves would); returns the list of the names moved into ``out``."""
    real = os.replace

    def arm(signum: int, out: Path) -> list[str]:
        moved: list[str] = []

        def replace(src, dst, *args, **kwargs):
            real(src, dst, *args, **kwargs)
            if Path(dst).parent == out:
                first = not any(train._WEIGHT_FILE.match(n) for n in moved)
                moved.append(Path(dst).name)
                if first and train._WEIGHT_FILE.match(moved[-1]):
                    os.kill(os.getpid(), signum)

        monkeypatch.setattr(os, "replace", replace)
        return moved

    return arm


def _earlier_save(write_output, out: Path) -> None:
    """An earlier save in ``out``, sharded: its weight files are not the new one's."""
    write_output(out, {n: b"old" for n in ("config.json", "model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors")})


def _assert_new_model(out: Path) -> None:
    assert sorted(p.name for p in out.iterdir()) == sorted([*NEW, train._RECORD])
    assert all((out / n).read_bytes() == data for n, data in NEW.items())


_CASES = [pytest.param(signal.SIGINT, (130, "interrupted"), id="ctrl-c"),
          pytest.param(signal.SIGTERM, (143, "terminated"), id="sigterm")]
if hasattr(signal, "SIGHUP"):
    _CASES.append(pytest.param(signal.SIGHUP, (129, "hung up"), id="sighup"))


@pytest.mark.parametrize(("signum", "status"), _CASES)
def test_a_signal_between_the_moves_is_delivered_after_the_last_one(
        tmp_path, write_output, signal_on_first_weight_move, handlers_kept, signum, status):
    out = tmp_path / "out"
    _earlier_save(write_output, out)
    moved = signal_on_first_weight_move(signum, out)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own Ctrl-C: KeyboardInterrupt
    if hasattr(signal, "SIGHUP"):  # not ignored as under nohup, where the CLI keeps ignoring it
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    with pytest.raises(KeyboardInterrupt) as e, sigterm_as_interrupt():  # the CLI's SIGTERM/SIGHUP handling
        write_output(out, NEW)
    assert interrupt_status(e.value) == status
    assert isinstance(e.value, Terminated) == (signum != signal.SIGINT)
    assert moved[-2:] == ["config.json", train._RECORD]  # delivered once every file was in
    _assert_new_model(out)


def test_without_the_holding_the_same_signal_leaves_no_config(tmp_path, write_output, signal_on_first_weight_move,
                                                              handlers_kept, monkeypatch):
    """The control: the signal the test sends does land between the moves."""
    monkeypatch.setattr(train, "_signals_held", contextlib.nullcontext)
    out = tmp_path / "out"
    _earlier_save(write_output, out)
    signal_on_first_weight_move(signal.SIGTERM, out)
    with pytest.raises(Terminated), sigterm_as_interrupt():
        write_output(out, NEW)
    assert not (out / "config.json").exists() and (out / "model.safetensors").is_file()


def test_the_model_a_signal_during_the_moves_waited_for_loads(tmp_path, saved, signal_on_first_weight_move,
                                                               handlers_kept):
    """A real save (the tiny model's files) into a folder holding an earlier one: it loads."""
    import transformers

    from polyaccel.moe.train_config import load_config

    out = tmp_path / "out"
    shutil.copytree(saved, out)
    cfg = load_config(TINY, [f"output_dir={out}", "checkpoint.dir=null"])
    signal_on_first_weight_move(signal.SIGTERM, out)
    with pytest.raises(Terminated), sigterm_as_interrupt():
        train._write_output(cfg, lambda staging: [shutil.copy2(p, staging / p.name) for p in saved.iterdir()])
    assert not (out / train._STAGING).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([p.name for p in saved.iterdir()] + [train._RECORD])
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.num_experts == 4


def test_a_second_signal_of_a_kind_is_not_held(handlers_kept):
    """The way out of moves that hang (a file system gone): the second Ctrl-C or SIGTERM goes
    to the run's handler at once."""
    reached = []
    with pytest.raises(Terminated), sigterm_as_interrupt():
        with train._signals_held():
            signal.raise_signal(signal.SIGTERM)
            reached.append(1)
            signal.raise_signal(signal.SIGTERM)
            reached.append(2)
    assert reached == [1]


def test_the_handlers_are_put_back_and_nothing_is_delivered_without_a_signal(handlers_kept):
    def mine(signum, frame):
        raise AssertionError("delivered")

    signal.signal(signal.SIGTERM, mine)
    with train._signals_held():
        assert signal.getsignal(signal.SIGTERM) is not mine
    assert signal.getsignal(signal.SIGTERM) is mine
    assert {n: signal.getsignal(n) for n in train._HELD_SIGNALS if n != signal.SIGTERM} == {
        n: h for n, h in handlers_kept.items() if n != signal.SIGTERM}


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")
def test_an_ignored_signal_stays_ignored(handlers_kept):
    """Under ``nohup`` SIGHUP is ignored: holding it must not deliver it (to Python's default)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with train._signals_held():
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.raise_signal(signal.SIGHUP)
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_off_the_main_thread_nothing_is_installed(handlers_kept):
    seen: list[object] = []

    def save() -> None:
        try:
            with train._signals_held():
                seen.append({n: signal.getsignal(n) for n in train._HELD_SIGNALS})
        except BaseException as e:  # (signal.signal off the main thread: ValueError)
            seen.append(e)

    t = threading.Thread(target=save)
    t.start()
    t.join()
    assert seen == [handlers_kept]


def test_polyaccel_moe_terminated_during_the_final_moves_exits_143_with_the_model_saved(
        tmp_path, capsys, signal_on_first_weight_move, handlers_kept):
    import transformers

    from polyaccel.moe.cli import main

    out = tmp_path / "out"
    signal_on_first_weight_move(signal.SIGTERM, out)
    code = main(["finetune", str(TINY), "--set", f"output_dir={out}", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                 "--set", "train.max_steps=1", "--set", "log.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 143 and err.startswith("polyaccel-moe: terminated;") and "Traceback" not in err
    assert (out / "config.json").is_file() and not (out / train._STAGING).exists()
    transformers.AutoModelForCausalLM.from_pretrained(out)
