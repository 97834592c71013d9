"""``export --overwrite`` never loses a file that export did not write. Subtitles beside the
videos (``-d clips/``) meet the user's own ``talk.srt`` or a dataset's reference ``talk.txt``:
export skips it and says "(--overwrite replaces it)"; the user adds ``--overwrite`` and the file
was gone. Export now remembers the sha256 of every file it writes (``exports_sha256.json``
in the cache root); ``--overwrite`` replaces such a file as before, and keeps any other (a
user's, or an export edited since) as ``<name>.bak-<time>``, saying so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.asr.cli import main


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("POLYACCEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _results(tmp_path: Path, text: str) -> Path:
    res = tmp_path / "out.jsonl"
    res.write_text(json.dumps({"path": str(tmp_path / "clips/talk.wav"), "text": text, "duration_s": 1.0,
                               "error": None}) + "\n")
    return res


def test_a_users_file_is_kept_aside_by_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "talk.txt").write_text("REFERENCE: the true words\n")
    res = _results(tmp_path, "the words")
    assert main(["export", str(res), "-f", "txt", "-d", str(clips)]) == 3
    assert "(--overwrite replaces it)" in capsys.readouterr().err
    assert main(["export", str(res), "-f", "txt", "-d", str(clips), "--overwrite"]) == 0
    err = capsys.readouterr().err
    (aside,) = clips.glob("talk.txt.bak-*")
    assert aside.read_text() == "REFERENCE: the true words\n" and f"kept as {aside.name}" in err
    assert (clips / "talk.txt").read_text() == "the words\n"


def test_its_own_earlier_export_is_replaced_in_place(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    assert main(["export", str(_results(tmp_path, "first take")), "-f", "txt", "-d", str(subs), "-q"]) == 0
    assert main(["export", str(_results(tmp_path, "second take")), "-f", "txt", "-d", str(subs), "-q",
                 "--overwrite"]) == 0
    assert (subs / "talk.txt").read_text() == "second take\n"
    assert [p.name for p in subs.iterdir()] == ["talk.txt"]
    assert main(["export", str(_results(tmp_path, "third take")), "-f", "txt", "-d", str(subs), "-q",
                 "--overwrite"]) == 0  # what --overwrite wrote is remembered too
    assert [p.name for p in subs.iterdir()] == ["talk.txt"]


def test_an_export_edited_since_is_kept_aside(tmp_path: Path) -> None:
    subs = tmp_path / "subs"
    assert main(["export", str(_results(tmp_path, "first take")), "-f", "txt", "-d", str(subs), "-q"]) == 0
    (subs / "talk.txt").write_text("first take, corrected by hand\n")
    assert main(["export", str(_results(tmp_path, "second take")), "-f", "txt", "-d", str(subs), "-q",
                 "--overwrite"]) == 0
    (aside,) = subs.glob("talk.txt.bak-*")
    assert aside.read_text() == "first take, corrected by hand\n"
    assert (subs / "talk.txt").read_text() == "second take\n"


def test_without_a_home_folder_every_file_is_kept_aside_and_nothing_fails(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POLYACCEL_CACHE")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    subs = tmp_path / "subs"
    assert main(["export", str(_results(tmp_path, "first take")), "-f", "txt", "-d", str(subs), "-q"]) == 0
    assert main(["export", str(_results(tmp_path, "second take")), "-f", "txt", "-d", str(subs), "-q",
                 "--overwrite"]) == 0
    assert (subs / "talk.txt").read_text() == "second take\n"
    assert [p.read_text() for p in subs.glob("talk.txt.bak-*")] == ["first take\n"]
