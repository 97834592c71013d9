"""``polyaccel-asr`` hardening (issue: CLI audit): a model folder whose weights are cut off,
corrupt or of other tensors, or whose Whisper tokenizer cannot be read, is a one-line usage
error before anything is written (not a traceback, not every file failing); a system error on
a model file is said as one, not as the output's; an empty input name ("$UNSET") is refused
instead of meaning the current folder; ``bench --batch-size`` is refused rather than ignored; a
failed ``convert`` leaves no folders; SIGTERM ends a run as Ctrl-C does (exit 143, lock gone,
results kept, the rerun resumes)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from polyaccel.asr import cli, transcriber
from polyaccel.asr.transcriber import Transcriber

SR = 16000
TINY_WHISPER = {"model_type": "whisper", "num_mel_bins": 80, "d_model": 16, "encoder_layers": 1,
                "decoder_layers": 1, "encoder_attention_heads": 2, "decoder_attention_heads": 2,
                "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "vocab_size": 8, "max_target_positions": 8,
                "max_source_positions": 1500, "decoder_start_token_id": 3, "eos_token_id": 2,
                "no_timestamps_token_id": None}


def _tiny_whisper(folder: Path) -> Path:
    """A random Whisper of the tiniest shape with a valid word-level tokenizer."""
    from tokenizers import Tokenizer, models

    from polyaccel.asr.whisper import WhisperASR, WhisperConfig

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_WHISPER))
    torch.manual_seed(0)
    model = WhisperASR(WhisperConfig.from_pretrained(folder))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    vocab = {w: i for i, w in enumerate("abcdefgh")}
    Tokenizer(models.WordLevel(vocab, unk_token="a")).save(str(folder / "tokenizer.json"))
    return folder


def _transcribe(asr_cli, tmp_path: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "out" / "out.jsonl"
    return cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "-q",
                     "--backend", "cpu", *extra]), out


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    def from_pretrained(name: str = "fake", *, batch_size: int | None = None, replicas: int | None = None, **kw):
        return Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=name)

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(from_pretrained))


# ---- model folders that cannot load: one line, exit 2, nothing written ------------------------------


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:1000])


def _garbage(f: Path) -> None:
    f.write_bytes(b"\xff" * 64)


def _other_tensors(f: Path) -> None:
    save_file({"x": torch.zeros(3)}, str(f))


def _other_shape(f: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(f))
    state["decoder.embed_tokens.weight"] = torch.zeros(9, 16)
    save_file(state, str(f))


@pytest.mark.parametrize("spoil, message", [
    (_cut, "unreadable weights (a cut-off or corrupt *.safetensors file?)"),
    (_garbage, "unreadable weights (a cut-off or corrupt *.safetensors file?)"),
    (_other_tensors, "the weights do not fit config.json: tensors 50 missing (e.g. 'decoder.embed_positions.weight'), "
                     "1 unexpected (e.g. 'x')"),
    (_other_shape, "the weights do not fit config.json: tensors 1 of another shape (e.g. "
                   "'decoder.embed_tokens.weight': [9, 16], config.json says [8, 16])"),
])
def test_weights_that_cannot_be_read_or_do_not_fit_are_a_usage_error(asr_cli, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture,
                                                                     spoil, message: str) -> None:
    model = _tiny_whisper(tmp_path / "m")
    spoil(model / "model.safetensors")
    code, out = _transcribe(asr_cli, tmp_path, "--model", str(model))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"polyaccel-asr transcribe: error: {model}: {message}")
    assert not out.parent.exists()


def test_conformer_weights_of_other_tensors_are_a_short_value_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    ConformerAED.from_config(tiny(), seed=0).save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["renamed"] = state.pop("decoder.embed_tokens.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"the weights do not fit config.json \(Error\(s\) in loading") as e:
        transcriber._load_model(tmp_path, "cpu", None)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400 + len(str(tmp_path))


@pytest.mark.parametrize("tokenizer", ["valid", "corrupt", "missing"])
def test_a_whisper_tokenizer_that_cannot_be_read_stops_the_run_before_anything_is_written(
        asr_cli, tmp_path: Path, capsys: pytest.CaptureFixture, tokenizer: str) -> None:
    """Not every file's error after its audio was decoded and recognized (exit 3, a results file
    of failures): the run stops at the model (exit 2) and -o is never made."""
    model = _tiny_whisper(tmp_path / "m")
    if tokenizer == "corrupt":
        (model / "tokenizer.json").write_text('{"model": {"type": "WordLevel"')
    elif tokenizer == "missing":
        (model / "tokenizer.json").unlink()
    code, out = _transcribe(asr_cli, tmp_path, "--model", str(model))
    err = capsys.readouterr().err
    if tokenizer == "valid":  # the tiny model itself transcribes
        assert code == 0 and json.loads(out.read_text())["error"] is None
        return
    assert code == 2 and err.count("\n") == 1 and not out.parent.exists()
    assert {"corrupt": f"{model / 'tokenizer.json'}: not a readable tokenizer (",
            "missing": f"tokenizer.json not found ({model / 'tokenizer.json'})"}[tokenizer] in err


def test_a_system_error_on_a_model_file_is_the_models_not_the_outputs(asr_cli, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable weights file (or a model cache we may not write) used to end the run as
    "stopped early: cannot write OUT.jsonl: Permission denied" (exit 1)."""
    weights = tmp_path / "m" / "model.safetensors"

    def unreadable(path, device, dtype):
        raise PermissionError(13, "Permission denied", str(weights))

    monkeypatch.setattr(transcriber, "_load_model", unreadable)
    code, out = _transcribe(asr_cli, tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and not out.parent.exists()
    assert err == f"polyaccel-asr transcribe: error: cannot load the model: Permission denied: {weights}\n"


# ---- names that are empty, options that would be ignored ---------------------------------------------


def test_an_empty_input_or_refs_name_is_refused_not_the_current_folder(asr_cli, fake: None, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for i in range(3):
        asr_cli.wav(tmp_path / f"mine{i}.wav")
    one = str(asr_cli.wav(tmp_path / "one.wav"))
    for argv in (["", one], [one, "--refs", ""]):
        assert cli.main(["transcribe", *argv, "-o", "out.jsonl", "-q"]) == 2
        assert "is an empty name (an unset shell variable?)" in capsys.readouterr().err
        assert not (tmp_path / "out.jsonl").exists()


def test_bench_refuses_batch_size_instead_of_ignoring_it(asr_cli, fake: None, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["bench", str(asr_cli.wav(tmp_path / "a.wav")), "--batch-size", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--batch-size would be ignored" in captured.err


def test_a_failed_convert_leaves_no_folders(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "kept").mkdir()
    assert cli.main(["convert", str(tmp_path / "missing-model"), str(tmp_path / "kept/new/deeper/out")]) == 2
    assert "missing-model: no such file" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["kept"] and not any((tmp_path / "kept").iterdir())


# ---- SIGTERM ---------------------------------------------------------------------------------------------


def _signal_at_third_batch(monkeypatch: pytest.MonkeyPatch, out: Path, sig: int, after=None) -> None:  # noqa: ANN001
    """A fake one-replica model whose third batch, once a line of ``out`` is written, sends this
    process ``sig`` and gives the main thread 0.2 s to unwind (then calls ``after``)."""
    calls = []

    def factory(i):  # noqa: ANN001, ANN202
        def recognize(batch):  # noqa: ANN001, ANN202
            calls.append(1)
            if len(calls) == 3:
                deadline = time.monotonic() + 10
                while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
                    time.sleep(0.01)  # the first lines are written
                os.kill(os.getpid(), sig)
                time.sleep(0.2)  # the main thread unwinds meanwhile, waiting for this batch
                if after is not None:
                    after()
            return [f"{len(a)} samples" for a in batch]
        return recognize

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(lambda *a, **kw: Transcriber(
        factory, sample_rate=SR, max_audio_seconds=30.0, replicas=1, batch_size=1, model_name="fake")))


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")])
def test_sigterm_ends_a_run_like_ctrl_c_and_the_rerun_resumes(asr_cli, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch, sig, code, word) -> None:
    """SIGTERM (sent here by the recognizer of the third file, once a line is written) used to kill the run on the spot,
    the lock and the folders it made left behind; now it unwinds as Ctrl-C does. So does SIGHUP (the terminal closed)."""
    wavs = [str(asr_cli.wav(tmp_path / f"c{i:02d}.wav")) for i in range(20)]
    out = tmp_path / "out" / "out.jsonl"
    unhandled = []
    _signal_at_third_batch(monkeypatch, out, sig)
    previous = signal.signal(sig, lambda *a: unhandled.append(1))  # not this test process's end
    if sig == signal.SIGHUP:
        signal.signal(sig, signal.SIG_DFL)  # only where SIGHUP would end the process is it taken over
    try:
        status = cli.main(["transcribe", *wavs, "-o", str(out), "-q"])
    finally:
        signal.signal(sig, previous)
    assert not unhandled and status == code
    assert capsys.readouterr().err == f"{word}; rerun the same command to resume\n"
    done = out.read_text()
    assert 1 <= done.count("\n") < 20 and done.endswith("\n")
    assert not Path(f"{out}.polyaccel-asr.lock").exists()
    assert cli.main(["transcribe", *wavs, "-o", str(out), "-q"]) == 0
    assert out.read_text().startswith(done) and out.read_text().count("\n") == 20


def test_a_second_ctrl_c_while_the_run_unwinds_ends_the_process_instead_of_raising_again(
        asr_cli, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C, then Ctrl-C again while the run waits for the batch in flight: the second raised
    inside that wait too, the run exited with the replicas' threads still in torch, and the
    process died of SIGABRT ("terminate called without an active exception", a core dump;
    reproduced with whisper-tiny.en and two SIGINTs 0.3 s apart). After the first, Ctrl-C is
    the default action (as a second SIGTERM already was), and stays so for the exit."""
    wavs = [str(asr_cli.wav(tmp_path / f"c{i:02d}.wav")) for i in range(6)]
    out = tmp_path / "out.jsonl"
    during_unwind = []
    _signal_at_third_batch(monkeypatch, out, signal.SIGINT,
                           after=lambda: during_unwind.append(signal.getsignal(signal.SIGINT)))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a shell
    try:
        assert cli.main(["transcribe", *wavs, "-o", str(out), "-q"]) == 130
        assert during_unwind == [signal.SIG_DFL]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert capsys.readouterr().err == "interrupted; rerun the same command to resume\n"
        assert not Path(f"{out}.polyaccel-asr.lock").exists()
        assert cli.main(["transcribe", *wavs, "-o", str(out), "-q"]) == 0  # no Ctrl-C: the handler is put back
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("command", ["transcribe", "wer", "bench", "compile"])
def test_each_subcommands_help_says_what_it_does_and_its_exit_statuses(command, capsys):
    """`polyaccel-asr COMMAND --help` describes the command and lists its exit statuses, not
    only its options."""
    from polyaccel.asr.cli import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "exit status: 0" in text and " 2 " in text.split("exit status:")[1]
    assert len(text.split("options:")[0].split("\n\n", 1)[1].split()) >= 20  # a description above the options


def test_a_path_inside_a_folder_we_may_not_enter_is_that_inputs_error_not_the_runs(tmp_path, monkeypatch):
    """For a user without search permission on ``locked/`` (root never sees this, so the
    denial is simulated), ``locked/x.wav`` used to stop the whole run ("cannot read ...", exit
    2) beside readable inputs, and alone was called "no such file or directory". It is now an
    input like a missing file: the others run, and its own error says why."""
    import pathlib

    from polyaccel.asr import cli, manifest

    ok = tmp_path / "ok.wav"
    ok.write_bytes(b"RIFF")
    locked = str(tmp_path / "locked" / "x.wav")
    real_is_dir, real_lstat = pathlib.Path.is_dir, os.lstat

    def is_dir(self, *a, **k):
        if str(self) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_is_dir(self, *a, **k)

    def lstat(path, *a, **k):
        if os.fspath(path) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_lstat(path, *a, **k)

    def stat(self, *a, **k):
        if str(self) == locked:
            raise PermissionError(13, "Permission denied", locked)
        return real_stat(self, *a, **k)

    real_stat = pathlib.Path.stat
    monkeypatch.setattr(pathlib.Path, "is_dir", is_dir)
    monkeypatch.setattr(pathlib.Path, "stat", stat)
    monkeypatch.setattr(os, "lstat", lstat)
    from polyaccel.asr.audio import AudioError, load_audio

    with pytest.raises(AudioError, match="permission denied: a folder on its path may not be entered"):
        load_audio(locked)
    assert [it.path for it in manifest.expand_inputs([str(ok), locked])] == [str(ok), locked]
    assert [it.path for it in cli._gather([locked])] == [locked]  # not "no such file or directory"
    with pytest.raises(cli.UsageError, match="no such file or directory"):
        cli._gather([str(tmp_path / "missing.wav")])


@pytest.mark.parametrize("layout", ["single", "glob", "index"])
def test_weights_that_are_a_fifo_are_refused_not_opened(tmp_path: Path, layout: str) -> None:
    """A FIFO as a Whisper folder's weights (``model.safetensors``, the only ``*.safetensors``,
    or a shard the index names) hung the CLI in native code that SIGTERM could not end; it is
    refused before anything opens it. A link to a regular file (the Hub cache's layout) loads."""
    from polyaccel.asr.weights import loaded_weight_files

    name = {"single": "model.safetensors", "glob": "weights.safetensors", "index": "part-1.safetensors"}[layout]
    if layout == "index":
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    os.mkfifo(tmp_path / name)
    with pytest.raises(ValueError, match="not a regular file"):
        loaded_weight_files(tmp_path)
    os.unlink(tmp_path / name)
    (tmp_path / "blob").write_bytes(b"x")
    (tmp_path / name).symlink_to(tmp_path / "blob")
    assert loaded_weight_files(tmp_path) == [tmp_path / name]


def test_conformer_weights_that_are_a_fifo_are_refused(tmp_path: Path) -> None:
    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    ConformerAED.from_config(tiny(), seed=0).save_pretrained(tmp_path)
    os.unlink(tmp_path / "model.safetensors")
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        ConformerAED.from_pretrained(tmp_path)
