"""``polyaccel-asr`` messages and flags: a manifest or reference file that is not UTF-8, or a
JSON reference line that does not parse, is a usage error naming the file and line (it said
only "'utf-8' codec can't decode byte 0xff" or "Expecting ',' delimiter", not which of the
files); ``bench --help`` no longer lists ``--batch-size`` (refused there: ``--batch-sizes``
runs); ``--address`` / ``--num-actors`` without ``--ray`` are refused instead of silently
running one local process."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyaccel.asr import cli


@pytest.mark.parametrize("content, expected", [
    (b'{"path": "a.wav"}\n\xff\xfe\n', ":2: not UTF-8 text"),
])
def test_a_manifest_that_is_not_utf8_is_named_with_its_line(asr_cli, tmp_path: Path, capsys, content: bytes,
                                                            expected: str) -> None:
    asr_cli.wav(tmp_path / "a.wav", value=0.0)
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(content)
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"{manifest}{expected}" in err and not out.exists(), err


@pytest.mark.parametrize("content, expected", [
    (b'<s> hello </s> (a)\n{"path": "a", "text": "x"\n', ":2: not valid JSON"),
    (b'<s> caf\xe9 </s> (a)\n', ":1: not UTF-8 text"),
])
def test_a_bad_reference_file_is_named_with_its_line(asr_cli, tmp_path: Path, capsys, content: bytes,
                                                     expected: str) -> None:
    refs = tmp_path / "refs.txt"
    refs.write_bytes(content)
    hyps = tmp_path / "h.jsonl"
    hyps.write_text('{"path": "a.wav", "text": "x", "duration_s": 1, "error": null}\n')
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(hyps)]) == 2
    assert f"{refs}{expected}" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav", value=0.0)), "--refs", str(refs),
                     "-o", str(out), "-q"]) == 2
    assert f"{refs}{expected}" in capsys.readouterr().err and not out.exists()


def test_bench_help_does_not_offer_the_batch_size_it_refuses(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--batch-sizes" in text and "--batch-size " not in text and "--batch-size\n" not in text
    assert "--batch-size BATCH_SIZE" not in text
    with pytest.raises(SystemExit):
        cli.main(["compile", "--help"])
    assert "--batch-size BATCH_SIZE" in capsys.readouterr().out  # compile still takes it


@pytest.mark.parametrize("flags", [["--num-actors", "2"], ["--address", "127.0.0.1:6379"]])
def test_ray_flags_without_ray_are_refused(asr_cli, tmp_path: Path, capsys, flags: list[str]) -> None:
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(asr_cli.wav(tmp_path / "a.wav", value=0.0)), "-o", str(out), "-q",
                     *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} only applies to a Ray job" in err and not out.exists(), err
