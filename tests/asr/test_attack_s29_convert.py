"""Session 29 attack pass on ``polyaccel-asr convert``: an OUT that is a symbolic link to an
empty folder was let through and failed at the end with a raw ``[Errno 20] Not a directory:
'.OUT.<hex>' -> 'OUT'`` naming a temporary folder; it is now refused first, in words, and the
link and its folder are left as they were."""

from __future__ import annotations

import os
from pathlib import Path

from polyaccel.asr import cli


def test_an_out_that_is_a_symlink_is_refused_before_converting(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to("empty")
    rc = cli.main(["convert", str(tmp_path / "no-such-model"), str(tmp_path / "link")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().endswith("link is a symbolic link; converting writes a new folder and replaces nothing "
                                "(give the folder it leads to)"), err
    assert os.readlink(tmp_path / "link") == "empty" and not any((tmp_path / "empty").iterdir())
    assert sorted(os.listdir(tmp_path)) == ["empty", "link"]
