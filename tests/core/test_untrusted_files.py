"""tools/device_pack.py ``unpack``: a staged manifest that names a "part" outside the stage
folder (``../x``, ``/x``) is refused before any file is read or extracted."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def dp(load_tool):
    return load_tool("device_pack")


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_manifest_naming_a_part_outside_the_stage_folder_is_refused(dp, tmp_path: Path, where: str) -> None:
    outside = tmp_path / "elsewhere.tar"  # any file the user can read, here a valid tar
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("planted.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    outside.write_bytes(buf.getvalue())
    sha = hashlib.sha256(outside.read_bytes()).hexdigest()
    stage = tmp_path / "stage"
    stage.mkdir()
    name = "../elsewhere.tar" if where == "relative" else str(outside)
    (stage / "manifest.json").write_text(json.dumps({"tar_sha256": sha, "parts": [{"name": name, "sha256": sha}]}))
    dest = tmp_path / "dest"
    with pytest.raises(SystemExit, match="not a part-NNN"):
        dp.unpack(dest, stage)
    assert not (dest / "planted.txt").exists()
