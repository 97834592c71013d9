"""tools/bench_data_start.py writes its synthetic ``data.jsonl`` into ``--dir``: a
``data.jsonl`` already there that is smaller than ``--size-mb`` (a user's own data, in a folder
named by mistake) was replaced by random token ids, and ``data.tmp`` there overwritten. Now
neither is touched: one line, exit 2; a data file of its own is still reused."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def tool(load_tool):
    return load_tool("bench_data_start")


def test_a_smaller_data_jsonl_in_dir_is_never_replaced(tool, tmp_path: Path, capsys) -> None:
    mine = tmp_path / "data.jsonl"
    mine.write_text('{"text": "my own data"}\n')
    (tmp_path / "data.tmp").write_text("my notes\n")
    with pytest.raises(SystemExit) as e:
        tool.write_data(mine, 1)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "data.jsonl" in err and "not replaced" in err and len(err.splitlines()) == 1
    assert mine.read_text() == '{"text": "my own data"}\n'
    assert (tmp_path / "data.tmp").read_text() == "my notes\n"


def test_a_fresh_dir_gets_data_and_a_big_enough_one_is_reused(tool, tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    tool.write_data(data, 1)
    first = data.stat()
    assert first.st_size >= 1 << 20 and sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]
    tool.write_data(data, 1)
    assert data.stat().st_mtime_ns == first.st_mtime_ns
