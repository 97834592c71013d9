"""tools/device_pack.py: files over the device tool's carry limit go in parts, one per call,
and come back byte for byte only when every part is there and intact."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def dp():
    spec = importlib.util.spec_from_file_location("polyaccel_tools_device_pack", TOOLS / "device_pack.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _source(tmp_path: Path) -> Path:
    model = tmp_path / "src" / "model"
    (model / "sub").mkdir(parents=True)
    (model / "model.bin").write_bytes(os.urandom(70_000))
    (model / "config.json").write_text('{"model_type": "whisper"}')
    (model / "sub" / "vocab.txt").write_text("a\nb\n")
    return model


def test_parts_staged_one_call_at_a_time_unpack_byte_for_byte(dp, tmp_path):
    model = _source(tmp_path)
    here, there, stage = tmp_path / "here", tmp_path / "there", tmp_path / "stage"
    manifest = dp.pack(here, [model], part_bytes=20_000)
    assert len(manifest["parts"]) == 5 and all(p["bytes"] <= 20_000 for p in manifest["parts"])
    parts = sorted(here.glob("part-*"))
    for i, part in enumerate(parts):  # each "call" carries one part (the first also the manifest)
        there.mkdir(exist_ok=True)
        shutil.copy(part, there / part.name)
        if i == 0:
            shutil.copy(here / "manifest.json", there / "manifest.json")
        dp.stage(there, stage)
        if i < len(parts) - 1:
            with pytest.raises(SystemExit, match="not staged yet"):
                dp.unpack(tmp_path / "out", stage)
    assert dp.unpack(tmp_path / "out", stage) == ["model"]
    assert _tree(tmp_path / "out" / "model") == _tree(model)


def test_a_corrupt_part_is_named_and_nothing_is_extracted(dp, tmp_path):
    model = _source(tmp_path)
    dp.pack(tmp_path / "here", [model], part_bytes=30_000)
    dp.stage(tmp_path / "here", tmp_path / "stage")
    part = tmp_path / "stage" / "part-001"
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="part-001: sha256 differs"):
        dp.unpack(tmp_path / "out", tmp_path / "stage")
    assert not (tmp_path / "out").exists()


def test_pack_keeps_a_users_pack_tar_and_refuses_an_outdir_inside_a_source(dp, tmp_path):
    model = _source(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    (here / "pack.tar").write_bytes(b"the user's own archive")
    dp.pack(here, [model], part_bytes=1 << 20)
    assert (here / "pack.tar").read_bytes() == b"the user's own archive"
    assert sorted(p.name for p in here.iterdir()) == ["manifest.json", "pack.tar", "part-000"]
    with pytest.raises(SystemExit, match="inside"):
        dp.pack(model / "parts", [model], part_bytes=1 << 20)
    assert not (model / "parts").exists()
