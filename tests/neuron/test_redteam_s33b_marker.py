"""A graph directory's marker that is not UTF-8 (a damaged disk, another tool's file) made
``collect_neffs`` raise UnicodeDecodeError for the whole artifacts root; it is now a marker of no
graph asked for, and the other graphs are still found."""

from __future__ import annotations

from pathlib import Path

from polyaccel.neuron import compile as ncompile


def _graph(root: Path, dir_name: str, marker: bytes) -> None:
    (root / dir_name).mkdir()
    (root / dir_name / ncompile.MARKER).write_bytes(marker)
    (root / dir_name / "graph.neff").write_bytes(b"neff")


def test_a_marker_that_is_not_utf8_does_not_stop_the_listing(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    root.mkdir(mode=0o700)
    _graph(root, "damaged-abc", b"\xff\xfe")
    _graph(root, "enc-def", b'{"name": "enc", "key": "def"}\n')
    assert sorted(ncompile.collect_neffs(root)) == ["damaged-abc", "enc-def"]
    assert list(ncompile.collect_neffs(root, name="enc")) == ["enc-def"]
