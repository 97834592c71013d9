"""tools/device_pack.py: files over the device tool's carry limit go in parts, one per call,
and come back byte for byte only when every part is there and intact."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def dp(load_tool):
    return load_tool("device_pack")


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


def test_pack_never_overwrites_a_users_manifest_or_part(dp, tmp_path):
    model = _source(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    (here / "manifest.json").write_text('{"name": "the user\'s project"}')
    with pytest.raises(SystemExit, match="not a pack's manifest"):
        dp.pack(here, [model], part_bytes=1 << 20)
    assert (here / "manifest.json").read_text() == '{"name": "the user\'s project"}'
    (here / "manifest.json").unlink()
    (here / "part-001").write_text("the user's notes")
    with pytest.raises(SystemExit, match="part-001 but no manifest"):
        dp.pack(here, [model], part_bytes=1 << 20)
    assert (here / "part-001").read_text() == "the user's notes"
    (here / "part-001").unlink()
    dp.pack(here, [model], part_bytes=1 << 20)
    (here / "part-001").write_text("the user's notes")  # beside a pack, yet not one of its parts
    with pytest.raises(SystemExit, match="part-001 not written by"):
        dp.pack(here, [model], part_bytes=1 << 20)
    assert (here / "part-001").read_text() == "the user's notes"
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    (here / "part-001").unlink()
    (here / "part-000").unlink()
    (here / "part-000").symlink_to(victim)
    with pytest.raises(SystemExit, match="part-000"):
        dp.pack(here, [model], part_bytes=1 << 20)
    assert victim.read_text() == "the user's file"


def test_a_repack_replaces_the_earlier_parts_and_stage_moves_only_parts(dp, tmp_path):
    model = _source(tmp_path)
    here, stage = tmp_path / "here", tmp_path / "stage"
    assert len(dp.pack(here, [model], part_bytes=20_000)["parts"]) == 5
    (model / "model.bin").write_bytes(os.urandom(10_000))
    assert len(dp.pack(here, [model], part_bytes=20_000)["parts"]) == 2
    assert sorted(p.name for p in here.iterdir()) == ["manifest.json", "part-000", "part-001"]
    (here / "part-time-rota.txt").write_text("the user's file")
    assert dp.stage(here, stage) == ["part-000", "part-001", "manifest.json"]
    assert (here / "part-time-rota.txt").read_text() == "the user's file"
    assert dp.unpack(tmp_path / "out", stage) == ["model"]
    assert _tree(tmp_path / "out" / "model") == _tree(model)


def test_parts_left_by_a_killed_pack_are_replaced_by_a_rerun(dp, tmp_path, monkeypatch):
    model = _source(tmp_path)
    here = tmp_path / "here"
    writes = []
    real = Path.write_bytes

    def dies_on_the_third_part(self, data):
        writes.append(self.name)
        if len(writes) == 3:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", dies_on_the_third_part)
    with pytest.raises(KeyboardInterrupt):
        dp.pack(here, [model], part_bytes=20_000)
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="sha256 differs"):  # the half pack is never unpacked
        dp.unpack(tmp_path / "half", here)
    dp.pack(here, [model], part_bytes=20_000)
    assert dp.unpack(tmp_path / "out", here) == ["model"]
    assert _tree(tmp_path / "out" / "model") == _tree(model)
