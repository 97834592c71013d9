"""docs/cost_model.md's worked example is what tools/cost_model.py prints for the input the doc
shows, and every command of its "Running it" block runs (exit 0) with that input."""

from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "cost_model.md"


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of the ``` blocks tagged ``lang`` ("" for untagged)."""
    found, body, tag = [], None, ""
    for line in text.splitlines(keepends=True):
        if line.startswith("```") and body is None:
            body, tag = [], line[3:].strip()
        elif line.startswith("```"):
            found += ["".join(body)] if tag == lang else []
            body = None
        elif body is not None:
            body.append(line)
    return found


def run(cost_model, argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cost_model.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue() + err.getvalue()


def tables(output: str) -> str:
    """The printed table and sensitivity table (what follows the JSON lines and assumptions)."""
    return output[output.index("\nkind ") + 1:].rstrip()


def example_problems(text: str, cost_model, folder: Path) -> list[str]:
    """Where the doc's example output differs from the tool's for the doc's example input."""
    (folder / "hf_generate.jsonl").write_text(blocks(text, "json")[0])
    shown = next(b for b in blocks(text, "") if b.startswith("kind "))
    code, printed = run(cost_model, ["--measured", str(folder / "hf_generate.jsonl")])
    if code != 0:
        return [f"exit {code}: {printed}"]
    want, got = shown.rstrip().splitlines(), tables(printed).splitlines()
    return [f"line {i + 1}: doc {w!r}, tool {g!r}" for i, (w, g) in enumerate(zip(want, got)) if w != g] + (
        [f"doc has {len(want)} lines, the tool {len(got)}"] if len(want) != len(got) else [])


@pytest.fixture(scope="module")
def cost_model(load_tool):
    return load_tool("cost_model")


def test_worked_example_is_the_tools_output(cost_model, tmp_path):
    assert example_problems(DOC.read_text(), cost_model, tmp_path) == []


def test_every_running_it_command_runs(cost_model, tmp_path, monkeypatch):
    text = DOC.read_text()
    (tmp_path / "asr_bench.jsonl").write_text(blocks(text, "json")[0])
    monkeypatch.chdir(tmp_path)
    commands = [shlex.split(line, comments=True) for block in blocks(text, "") for line in block.splitlines()
                if line.startswith("python tools/cost_model.py")]
    assert len(commands) >= 5
    for argv in commands:
        code, printed = run(cost_model, argv[2:])
        assert code == 0, (argv, printed)


def test_example_check_catches_a_stale_number(cost_model, tmp_path):
    """Negative control: one changed figure, or a dropped line, in the doc is found."""
    text = DOC.read_text()
    assert example_problems(text.replace("2,179   5.41   403", "2,179   5.41   404"), cost_model, tmp_path)
    dropped = text.replace("----------------------  ------------------------------  ---", "", 1)
    assert example_problems(dropped, cost_model, tmp_path)
