"""A results record whose ``cwd`` no folder can have (a NUL, a lone surrogate: never written by
a run) is not a record: ``wer`` and ``export`` refused it with a ValueError traceback from
``os.path.realpath``; they now say which line in one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyaccel.asr import cli

BAD_CWD = ['"cwd": "a\\u0000b"', '"cwd": "\\ud800"']


@pytest.mark.parametrize("cwd", BAD_CWD)
@pytest.mark.parametrize("command", ["wer", "export"])
def test_a_record_with_an_impossible_cwd_is_one_line_and_exit_2(tmp_path: Path, capsys, cwd: str,
                                                                   command: str) -> None:
    hyps = tmp_path / "out.jsonl"
    hyps.write_text('{"path": "b.wav", "text": "hello there", "duration_s": 1.0, "error": null}\n'
                    f'{{"path": "a.wav", "text": "hello there", "duration_s": 1.0, "error": null, {cwd}}}\n')
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"path": "/nowhere/zz.wav", "text": "hello world"}\n')
    argv = (["wer", "--refs", str(refs), "--hyps", str(hyps)] if command == "wer"
            else ["export", str(hyps), "--format", "txt", "-d", str(tmp_path / "txt")])
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "line 2" in err and str(hyps) in err
    assert len(err.strip().splitlines()) == 1
