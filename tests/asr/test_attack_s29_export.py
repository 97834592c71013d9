"""Session 29 attack pass on ``polyaccel-asr export``: an input whose name uses the 255 bytes a
file name may have with a short extension (``x…x.au``, ``x…x.ogg`` to ``.srt``) failed with
"File name too long" (exit 1): its file is now named with the stem cut to fit (whole UTF-8
characters), and two inputs whose cut names meet get ``-2``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from polyaccel.asr import cli

SEGMENTS = [{"start": 0.0, "end": 1.5, "text": "hello there"}]


def _results(tmp_path: Path, paths: list[str]) -> Path:
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"path": p, "text": "hello there", "duration_s": 2.0, "error": None,
                                       "segments": SEGMENTS}) + "\n" for p in paths))
    return out


@pytest.mark.parametrize("fmt", ["srt", "vtt", "txt"])
def test_a_name_with_no_room_for_the_extension_is_cut_to_fit(tmp_path: Path, capsys, fmt: str) -> None:
    long_au = "/clips/" + "x" * 252 + ".au"  # 255 bytes: x…x.srt would be 256
    long_utf8 = "/clips/" + "é" * 126 + ".au"  # 2-byte characters: a cut must not split one
    out = _results(tmp_path, [long_au, long_utf8, "/clips/short.wav"])
    subs = tmp_path / "subs"
    assert cli.main(["export", str(out), "-f", fmt, "-d", str(subs)]) == 0, capsys.readouterr().err
    names = sorted(os.listdir(subs))
    assert all(len(os.fsencode(n)) <= 255 for n in names)
    assert names == sorted(["x" * 251 + f".{fmt}", "é" * 125 + f".{fmt}", f"short.{fmt}"])
    assert "name cut to fit" in capsys.readouterr().err
    assert cli.main(["export", str(out), "-f", fmt, "-d", str(subs)]) == 0  # a rerun: already up to date


def test_two_long_names_that_meet_when_cut_get_a_suffix(tmp_path: Path, capsys) -> None:
    a, b = "/a/" + "y" * 252 + ".au", "/a/" + "y" * 251 + "z.au"  # one name once both are cut
    out = _results(tmp_path, [a, b])
    assert cli.main(["export", str(out), "-f", "srt", "-d", str(tmp_path / "subs")]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "subs")) == ["y" * 249 + "-2.srt", "y" * 251 + ".srt"]
    srt = (tmp_path / "subs" / ("y" * 251 + ".srt")).read_text()
    assert srt == "1\n00:00:00,000 --> 00:00:01,500\nhello there\n\n"


def test_a_rerun_removes_what_a_killed_export_left_and_nothing_else(tmp_path: Path, capsys) -> None:
    """An export killed (SIGKILL) while writing ``a.srt`` leaves ``a.srt.<12 hex>.tmp`` beside it,
    never a cut ``a.srt``; the rerun writes ``a.srt`` and removes that leftover. It used to stay
    for good. A file of that shape for a name this run does not write, or a fresh one (another
    export writing now), is left alone."""
    out = _results(tmp_path, ["/clips/a.wav", "/clips/b.wav"])
    subs = tmp_path / "subs"
    subs.mkdir()
    old = time.time() - 3600
    killed = subs / "a.srt.0123456789ab.tmp"
    killed.write_text("1\n00:00:00,000 --> 00:0")  # cut mid-write
    up_to_date = subs / "b.srt.0123456789ab.tmp"
    (subs / "b.srt").write_text("1\n00:00:00,000 --> 00:00:01,500\nhello there\n\n")
    up_to_date.write_text("1\n")
    theirs = subs / "notes.txt.0123456789ab.tmp"
    theirs.write_text("a user's file")
    for f in (killed, up_to_date, theirs):
        os.utime(f, (old, old))
    fresh = subs / "a.srt.fedcba987654.tmp"
    fresh.write_text("being written")
    assert cli.main(["export", str(out), "-f", "srt", "-d", str(subs)]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(subs)) == sorted(["a.srt", "b.srt", theirs.name, fresh.name])


@pytest.mark.parametrize("argv, said", [
    (["wer", "--refs", "/dev/null", "--hyps", "{out}"], "--refs /dev/null: is not a regular file"),
    (["wer", "--refs", "{out}", "--hyps", "/dev/null"], "--hyps /dev/null: is not a regular file"),
    (["export", "/dev/null", "-d", "{tmp}/subs"], "/dev/null is not a regular file"),
])
def test_a_device_is_not_called_missing(tmp_path: Path, capsys, argv: list[str], said: str) -> None:
    """``wer --refs /dev/zero`` said "not found", ``export /dev/stdin`` "no such results file"."""
    out = _results(tmp_path, ["/clips/a.wav"])
    argv = [a.format(out=out, tmp=tmp_path) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "not found" not in err and "no such" not in err, err
    assert not (tmp_path / "subs").exists()
