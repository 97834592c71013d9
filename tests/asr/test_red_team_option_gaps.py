"""Gaps a red-team pass found (2026-12-03): options a model or a command cannot honour are
refused, not recorded as applied (``--no-speech-threshold`` for a model without a no-speech
token, a threshold that is not a number, an empty ``--model``); ``wer`` of a results file
against itself; a run with stderr closed (``2>&-``); audio left with no sample after
resampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr import cli
from polyaccel.asr.transcriber import Transcriber


@pytest.fixture(scope="module")
def conformer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    folder = tmp_path_factory.mktemp("conformer")
    ConformerAED.from_config(tiny(), seed=0).save_pretrained(folder)
    return folder


def test_a_no_speech_threshold_for_a_model_without_the_token_is_refused(
        asr_cli, conformer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="no no-speech token"):
        Transcriber.from_pretrained(str(conformer_dir), backend="cpu", no_speech_threshold=0.6)
    out = tmp_path / "out" / "out.jsonl"
    code = cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav")), "-o", str(out), "-q",
                     "--backend", "cpu", "--model", str(conformer_dir), "--no-speech-threshold", "0.6"])
    err = capsys.readouterr().err
    assert code == 2 and "no no-speech token" in err and "Traceback" not in err
    assert not out.parent.exists()
    # without the option the same model runs
    assert cli.main(["transcribe", str(tmp_path / "a.wav"), "-o", str(out), "-q", "--backend", "cpu",
                     "--model", str(conformer_dir)]) == 0
    assert "no_speech_threshold" not in asr_cli.results(out)[0]


def test_wer_of_a_results_file_against_itself_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A results file holds {"path", "text"} lines, which read as references too: given as both
    --refs and --hyps it scored WER 0 (exit 0)."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"path": "a.wav", "text": "hello there", "duration_s": 1.0, "error": null}\n')
    (tmp_path / "link.jsonl").symlink_to(out)
    for refs in (out, tmp_path / "link.jsonl"):
        assert cli.main(["wer", "--refs", str(refs), "--hyps", str(out)]) == 2
        captured = capsys.readouterr()
        assert "same file" in captured.err and captured.out == ""
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "hello world"}\n')
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(out)]) == 0
    assert '"wer": 0.5' in capsys.readouterr().out


@pytest.mark.parametrize("closed", [(2,), (0, 1, 2)])
def test_a_run_with_stderr_closed_writes_its_results_and_keeps_c_warnings_out_of_its_files(
        asr_cli, tmp_path: Path, closed: tuple[int, ...]) -> None:
    """``2>&-`` (cron, a supervisor): the progress bar had no stream (a traceback to nowhere,
    exit 1, nothing written), and the lock file took descriptor 2, so what C libraries write
    to stderr went into it (a lock file that is not ours stops a rerun after a kill)."""
    import os
    import subprocess
    import sys

    wav = asr_cli.wav(tmp_path / "a.wav")
    out = tmp_path / "out.jsonl"
    code = ("import os, sys; from polyaccel.asr import cli; from polyaccel.asr import results_file as rf\n"
            "acquire = rf.OutputLock.acquire\n"
            "def spy(self):\n"
            "    r = acquire(self); os.write(2, b'a C library warning\\n'); return r\n"
            "rf.OutputLock.acquire = spy\n"
            f"rc = cli.main(['transcribe', {str(wav)!r}, '-o', {str(out)!r}, '--backend', 'cpu', '--model', 'fake'])\n"
            "os.write(int(os.environ['REPORT_FD']), os.readlink('/proc/self/fd/2').encode()); sys.exit(rc)\n")
    fake = ("from polyaccel.asr.transcriber import Transcriber\n"
            "Transcriber.from_pretrained = staticmethod(lambda name, **kw: Transcriber(\n"
            "    lambda i: (lambda batch: ['hi' for a in batch]), sample_rate=16000, max_audio_seconds=30.0,\n"
            "    replicas=1, batch_size=1, model_name=name))\n")
    (tmp_path / "sitecustomize.py").write_text(fake)
    r, w = os.pipe()
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "REPORT_FD": str(w)}

    def close_standard_fds() -> None:
        for fd in closed:
            os.close(fd)

    p = subprocess.Popen([sys.executable, "-c", code], preexec_fn=close_standard_fds, env=env, pass_fds=(w,),
                         cwd=tmp_path)
    os.close(w)
    assert p.wait(timeout=300) == 0
    with os.fdopen(r, "rb") as f:
        assert f.read() == os.devnull.encode()
    assert [rec["text"] for rec in asr_cli.results(out)] == ["hi"]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.wav", "out.jsonl", "sitecustomize.py"]


@pytest.mark.parametrize("data, rate", [(np.full(1, 0.1, np.float32), 44100), (np.full(2, 0.1, np.float32), 768000),
                                        (np.zeros((0, 2), np.float32), 16000), (np.zeros((2, 0), np.float32), 16000)])
def test_audio_with_no_sample_left_is_empty_audio_not_an_internal_error(data: np.ndarray, rate: int) -> None:
    """A sample at 44.1 kHz resamples to none at 16 kHz, and a [0, 2] array has no channel
    to take: both said "could not read: ValueError/IndexError ..." instead of empty audio."""
    from polyaccel.asr.audio import AudioError, prepare_waveform, waveform_from_array

    with pytest.raises(AudioError, match=r"^empty audio \(0 samples"):
        waveform_from_array(data, rate)
    if data.ndim == 2:
        with pytest.raises(AudioError, match=r"^empty audio \(0 samples"):
            prepare_waveform(data, rate)


def test_a_one_sample_44k_file_is_empty_audio(asr_cli, tmp_path: Path) -> None:
    import soundfile as sf

    sf.write(tmp_path / "one.wav", np.full(1, 0.1), 44100)
    out = tmp_path / "out.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Transcriber, "from_pretrained", staticmethod(lambda name, **kw: Transcriber(
            lambda i: (lambda batch: ["hi" for _ in batch]), sample_rate=16000, max_audio_seconds=30.0,
            replicas=1, batch_size=1, model_name=name)))
        assert asr_cli.run(str(tmp_path / "one.wav"), "-o", str(out), "--backend", "cpu") == 3
    assert asr_cli.results(out)[0]["error"].startswith("empty audio (0 samples at 16000 Hz")


@pytest.mark.parametrize("threshold", ["0.6", float("nan"), -1, True])
def test_a_no_speech_threshold_that_is_not_a_number_is_refused_before_the_model_loads(
        threshold: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI checks it; from Python "0.6" failed every input (a TypeError in each batch), NaN
    turned the gate off and -1 emptied every text, each recorded as the threshold."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("polyaccel.asr.transcriber._resolve_model", no_load)
    with pytest.raises(ValueError, match="no_speech_threshold must be a finite number"):
        Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", no_speech_threshold=threshold)


@pytest.mark.parametrize("command", ["transcribe", "bench", "compile"])
def test_an_empty_model_name_is_refused_not_the_current_folder(
        command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``--model "$UNSET"`` loaded whatever model folder the command ran in (as inputs and
    --refs, an empty name is refused)."""
    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    ConformerAED.from_config(tiny(), seed=0).save_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)
    inputs = {"transcribe": ["a.wav", "-o", "out.jsonl"], "bench": ["a.wav"], "compile": []}[command]
    with pytest.raises(SystemExit) as e:
        cli.main([command, *inputs, "--model", "", "--backend", "cpu"])
    assert e.value.code == 2 and "an empty name" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("per_file", [False, True])
def test_wer_into_a_full_disk_is_one_line_and_exit_1(tmp_path: Path, per_file: bool) -> None:
    """`wer ... > /dev/full` (stdout on a full disk) printed a traceback; a reader that went
    away is still quiet (141, tests/asr/test_cli_output_streams.py)."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    hyps = tmp_path / "out.jsonl"
    hyps.write_text('{"path": "a.wav", "text": "hello there", "duration_s": 1.0, "error": null}\n')
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "a.wav", "text": "hello world"}\n')
    argv = ["wer", "--refs", str(refs), "--hyps", str(hyps)] + (["--per-file"] if per_file else [])
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", "import sys; from polyaccel.asr import cli; sys.exit(cli.main())",
                            *argv], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr == "polyaccel-asr wer: error: cannot write standard output: No space left on device\n"


def test_a_progress_bar_that_cannot_be_written_does_not_stop_the_run(asr_cli, tmp_path: Path) -> None:
    """`transcribe ... 2>/dev/full` (a log on a full disk): the bar's first write stopped the run
    before any result, said as "cannot write OUT.jsonl"; now the bar goes off, every result is
    written and the run ends 0 (its summary, which cannot be written either, made it 1)."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    wavs = [str(asr_cli.wav(tmp_path / f"{i}.wav")) for i in range(3)]
    out = tmp_path / "out.jsonl"
    (tmp_path / "sitecustomize.py").write_text(
        "from polyaccel.asr.transcriber import Transcriber\n"
        "Transcriber.from_pretrained = staticmethod(lambda name, **kw: Transcriber(\n"
        "    lambda i: (lambda batch: ['hi' for a in batch]), sample_rate=16000, max_audio_seconds=30.0,\n"
        "    replicas=1, batch_size=1, model_name=name))\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-c", "import sys; from polyaccel.asr import cli; sys.exit(cli.main())",
                            "transcribe", *wavs, "-o", str(out), "--backend", "cpu", "--model", "fake"],
                           stderr=full, env=env, timeout=300)
    assert [r["text"] for r in asr_cli.results(out)] == ["hi"] * 3
    assert r.returncode == 0  # the summary lines are lost, not the run's status
