"""Audit (session audit-asr): references matched to the right file whatever the spelling of
its path, and inputs that name standard input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.asr import cli
from polyaccel.asr.manifest import InputItem, attach_refs, read_refs


def _refs(tmp_path: Path) -> Path:
    """Absolute-path references for two files with one name in different folders."""
    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps(r) + "\n" for r in [
        {"path": str(tmp_path / "a" / "same.wav"), "text": "alpha"},
        {"path": str(tmp_path / "b" / "same.wav"), "text": "beta"},
    ]))
    return refs


def test_references_by_absolute_path_reach_inputs_named_relatively(tmp_path: Path, monkeypatch) -> None:
    """``b/same.wav`` fell through to the file-stem match and got ``a/same.wav``'s text."""
    refs = _refs(tmp_path)
    monkeypatch.chdir(tmp_path)
    items = [InputItem("a/same.wav"), InputItem("./b/../b/same.wav"), InputItem("c/same.wav")]
    attach_refs(items, read_refs(refs))
    assert [it.ref for it in items] == ["alpha", "beta", "alpha"]  # c: no path, so by stem


def test_wer_matches_relative_records_to_absolute_references(tmp_path: Path, monkeypatch, capsys) -> None:
    """``wer`` scored a record written from another folder against the wrong file's text."""
    refs = _refs(tmp_path)
    hyps = tmp_path / "out.jsonl"
    hyps.write_text("".join(json.dumps({"path": p, "text": t, "duration_s": 1.0, "error": None,
                                        "cwd": str(tmp_path)}) + "\n"
                            for p, t in [("a/same.wav", "alpha"), ("b/same.wav", "beta")]))
    monkeypatch.chdir(tmp_path / "..")
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(hyps)]) == 0
    assert json.loads(capsys.readouterr().out)["wer"] == 0.0


@pytest.mark.parametrize("name", ["-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0", "manifest"])
def test_standard_input_is_refused_before_anything_is_written(name: str, tmp_path: Path, monkeypatch,
                                                              capsys) -> None:
    """``transcribe /dev/stdin < a.wav`` wrote a line for "/dev/stdin", so a rerun with other
    audio on stdin said "nothing to do" and kept a.wav's text; ``<(...)`` failed only after the
    model had loaded, ``-`` was "no such file"."""
    monkeypatch.chdir(tmp_path)
    if name == "manifest":
        name = "m.jsonl"
        Path(name).write_text(json.dumps({"audio_filepath": "/dev/stdin"}) + "\n")
    assert cli.main(["transcribe", name, "-o", "out.jsonl", "-q"]) == 2
    err = capsys.readouterr().err
    assert "not read from standard input" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == (["m.jsonl"] if name == "m.jsonl" else [])


def test_a_manifest_line_for_part_of_a_file_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    """NeMo's ``offset``/``duration`` lines name part of a file: the whole file was transcribed
    and scored against that part's text, a wrong WER without a word. ``offset`` 0 is the whole."""
    monkeypatch.chdir(tmp_path)
    Path("m.jsonl").write_text(json.dumps({"audio_filepath": "a.wav", "offset": 0, "duration": 3.0, "text": "a"})
                               + "\n" + json.dumps({"audio_filepath": "b.wav", "offset": 12.5, "duration": 4.0,
                                                    "text": "b"}) + "\n")
    assert cli.main(["transcribe", "m.jsonl", "-o", "out.jsonl", "-q"]) == 2
    err = capsys.readouterr().err
    assert "m.jsonl:2: 'offset' 12.5" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]


def test_a_reference_file_giving_one_file_two_texts_is_refused(tmp_path: Path) -> None:
    """The later line won without a word (a manifest refuses the same); the same text twice is fine."""
    sphinx = tmp_path / "transcription"
    sphinx.write_text("<s> hello </s> (a)\n<s> good day </s> (b)\n<s> hello </s> (a)\n<s> goodbye </s> (a)\n")
    with pytest.raises(ValueError, match=r"transcription:4: 'a' has another text on line 1"):
        read_refs(sphinx)
    jsonl = tmp_path / "refs.jsonl"
    jsonl.write_text(json.dumps({"path": "/d/a.wav", "text": "one"}) + "\n" + json.dumps({"id": "a", "text": "two"})
                     + "\n" + json.dumps({"path": "/d/a.wav", "text": "three"}) + "\n")
    with pytest.raises(ValueError, match=r"refs.jsonl:3: '/d/a.wav' has another text on line 1"):
        read_refs(jsonl)


def test_a_file_that_may_not_be_read_says_so(tmp_path: Path, monkeypatch) -> None:
    """Was "could not read: PermissionError: [Errno 13] Permission denied: 'x.wav'" (a chmod 000
    file; faked here, as root reads any file)."""
    import numpy as np

    from polyaccel.asr import transcriber
    from polyaccel.asr.transcriber import Transcriber

    def denied(path: str, *a: object) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(transcriber, "audio_extent", denied)
    with Transcriber(lambda i: (lambda batch: ["x"] * len(batch)), batch_size=2) as tr:
        results = tr.transcribe([str(tmp_path / "x.wav"), np.zeros(16000, np.float32)])
    assert [r.error for r in results] == ["permission denied: the file may not be read", None]
