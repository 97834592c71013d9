"""Files someone else hands ``polyaccel-asr`` nested deeper than Python's JSON parser recurses
(a results file, a manifest, a reference file): each is refused with a clean error naming
it, never a ``RecursionError`` traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyaccel.asr.cli import main
from polyaccel.asr.manifest import read_manifest, read_refs
from polyaccel.asr.results_file import NotResultsFile, scan_results

DEEP = "[" * 200_000  # beyond the json module's recursion limit


def test_a_results_file_nested_too_deeply_is_not_a_results_file(tmp_path: Path, capsys) -> None:
    results = tmp_path / "out.jsonl"
    results.write_text('{"path": "a.wav", "text": "hi", "duration_s": 1.0, "error": null}\n' + DEEP + "\n")
    with pytest.raises(NotResultsFile, match="line 2"):
        scan_results(results)
    assert main(["export", str(results), "-d", str(tmp_path / "subs"), "-f", "txt"]) == 2
    assert "not a polyaccel-asr results file" in capsys.readouterr().err
    assert not (tmp_path / "subs").exists()


def test_a_manifest_nested_too_deeply_is_a_value_error_naming_the_line(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"audio_filepath": "a.wav"}\n' + DEEP + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object"):
        read_manifest(manifest)


def test_a_reference_file_nested_too_deeply_is_a_value_error_naming_the_line(tmp_path: Path) -> None:
    refs = tmp_path / "refs.jsonl"
    refs.write_text('{"id": "a", "text": "hi"}\n' + '{"a": ' * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"refs\.jsonl:2: nested too deeply"):
        read_refs(refs)
