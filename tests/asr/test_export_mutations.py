"""``polyaccel-asr export``: the checks that keep a user's files, pinned by mutation testing (each
test fails when one check of ``export.py`` is loosened: what counts as "already up to date", what
``--overwrite`` may replace). Results files are written by hand; no model runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.asr.cli import main


def _results(tmp_path: Path, text: str, path: str = "clips/a.wav") -> Path:
    res = tmp_path / "out.jsonl"
    res.write_text(json.dumps({"path": path, "text": text, "duration_s": 1.0, "error": None},
                              ensure_ascii=False) + "\n")
    return res


@pytest.mark.parametrize("edit", ["same length", "export plus a note"])
def test_a_file_edited_by_hand_is_not_taken_for_an_up_to_date_export(tmp_path: Path, edit: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A rerun counts a file as done only when it holds exactly what would be written. A hand
    correction of the same length, or the export with the user's note appended, is the user's
    work: left alone and reported (exit 3), never counted as "already up to date" (exit 0)."""
    res = _results(tmp_path, "hello world")
    subs = tmp_path / "subs"
    subs.mkdir()
    mine = "hello W0rld\n" if edit == "same length" else "hello world\nchecked by Ann\n"
    assert len(mine) == len("hello world\n") or mine.startswith("hello world\n")
    (subs / "a.txt").write_text(mine)
    assert main(["export", str(res), "-f", "txt", "-d", str(subs)]) == 3
    err = capsys.readouterr().err
    assert "exists with other content" in err and "up to date" not in err
    assert (subs / "a.txt").read_text() == mine


def test_overwrite_never_replaces_binary_data_that_happens_to_be_valid_utf8(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """Raw audio of silence (zero bytes) or a UTF-16 text file of ASCII letters decodes as UTF-8,
    but its NUL bytes say it is not a file export wrote: ``--overwrite`` leaves it."""
    res = _results(tmp_path, "new words")
    subs = tmp_path / "subs"
    subs.mkdir()
    data = bytes(8192)  # headerless PCM silence
    (subs / "a.txt").write_bytes(data)
    assert main(["export", str(res), "-f", "txt", "-d", str(subs), "--overwrite", "-q"]) == 3
    assert "does not hold text (audio?); never replaced" in capsys.readouterr().err
    assert (subs / "a.txt").read_bytes() == data


def test_overwrite_replaces_a_long_non_ascii_export_cut_mid_character_by_the_probe(tmp_path: Path) -> None:
    """``--overwrite`` reads the first 64 KiB of the old file to tell text from audio. An earlier
    export of a long French transcript whose 65,536th byte is the first half of an ``é`` is text:
    it is replaced, not refused as binary."""
    res = _results(tmp_path, "nouveau texte")
    subs = tmp_path / "subs"
    subs.mkdir()
    old = ("a" * 65535 + "é" + " fin\n").encode()
    assert old[65535] == 0xC3  # the probe ends inside the character
    (subs / "a.txt").write_bytes(old)
    assert main(["export", str(res), "-f", "txt", "-d", str(subs), "--overwrite", "-q"]) == 0
    assert (subs / "a.txt").read_text() == "nouveau texte\n"
