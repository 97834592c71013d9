"""Options that a model or a command cannot honour are refused, not recorded as applied:
``--no-speech-threshold`` with a model that has no no-speech token (ConformerAED) is a usage
error, as ``--timestamps`` and ``--fp8-encoder`` are, instead of every line claiming a
threshold that never ran."""

from __future__ import annotations

from pathlib import Path

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
