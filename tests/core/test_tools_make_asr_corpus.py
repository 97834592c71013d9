"""tools/make_asr_corpus.py writes nothing through a link and nothing into a folder that another
user controls (a corpus folder left in a shared /tmp, as its --help example uses)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def corpus(load_tool):
    return load_tool("make_asr_corpus")


def _old_corpus(out: Path) -> Path:
    (out / "audio").mkdir(parents=True)
    (out / "audio" / "0000.wav").write_bytes(b"RIFF")
    (out / "corpus.json").write_text("{}\n")
    return out


@pytest.mark.parametrize("name", ["manifest.jsonl", "refs.jsonl", "corpus.json", "audio/0001.wav"])
def test_a_link_in_the_corpus_folder_is_never_written_through(corpus, tmp_path: Path, name: str) -> None:
    """A neighbour's link named like a corpus file would have the rebuild overwrite its target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    out = _old_corpus(tmp_path / "corpus")
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(victim)
    with pytest.raises(SystemExit, match="symbolic link"):
        corpus._check_out(out)
    assert victim.read_text() == "the user's file\n"


def test_a_linked_audio_folder_is_refused(corpus, tmp_path: Path) -> None:
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    (recordings / "0001.wav").write_bytes(b"a user's recording")
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "corpus.json").write_text("{}\n")
    (out / "audio").symlink_to(recordings)
    with pytest.raises(SystemExit, match="symbolic link"):
        corpus._check_out(out)


def test_a_folder_every_user_may_write_in_is_refused(corpus, tmp_path: Path) -> None:
    out = _old_corpus(tmp_path / "corpus")
    out.chmod(0o777)
    with pytest.raises(SystemExit, match="writable by every user"):
        corpus._check_out(out)
    out.chmod(0o755)
    (out / "audio").chmod(0o777)
    with pytest.raises(SystemExit, match="writable by every user"):
        corpus._check_out(out)
    (out / "audio").chmod(0o755)
    corpus._check_out(out)  # its own corpus, private: rebuilt in place


def test_a_folder_of_another_user_is_refused(corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Someone made /tmp/corpus first: writing there hands them the corpus (and a place to plant
    links after the checks)."""
    out = _old_corpus(tmp_path / "corpus")
    other = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: other)
    with pytest.raises(SystemExit, match="belongs to another user"):
        corpus._check_out(out)


def test_a_folder_made_by_another_user_after_the_first_check_is_refused(corpus, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "corpus"
    real, other = corpus._check_out, os.getuid() + 1
    calls = []

    def check(path: Path) -> None:  # the folder is new at the first check, made by "another user" after it
        calls.append(path)
        real(path)
        monkeypatch.setattr(os, "getuid", lambda: other)

    monkeypatch.setattr(corpus, "_check_out", check)
    monkeypatch.setattr(corpus, "read_sources", lambda src: [])
    monkeypatch.setattr(corpus, "writable_formats", lambda: [])
    with pytest.raises(SystemExit, match="belongs to another user"):
        corpus.build(out, files=1, long=0, long_s=1.0, seed=0, src=tmp_path, workers=1)
    assert calls == [out]
