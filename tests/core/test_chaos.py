"""tools/chaos.py (issue 10): the kill / corrupt / bad-name scenarios run end to end against the
real CLIs and hold; and the check is not vacuous: with a guarantee broken in the CLI's process
(a ``sitecustomize`` on PYTHONPATH patches the installed code) the scenario fails and the
tool exits 1. The full table (about 2 minutes on 2 cores) and the slower controls are ``slow``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def chaos(load_tool):
    return load_tool("chaos")


FAST = ["asr-output-not-results", "asr-lock-not-ours", "moe-nonfinite"]  # no model load for ASR; MoE takes seconds


def _chaos(chaos, capsys: pytest.CaptureFixture, tmp_path: Path, *only: str) -> tuple[int, dict]:
    argv = ["--json", "--timeout", "300", "--workdir", str(tmp_path / "chaos")]
    code = chaos.main([*argv, *[a for name in only for a in ("--only", name)]])
    return code, json.loads(capsys.readouterr().out)


def _break(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: str) -> None:
    """Run every CLI subprocess with ``code`` executed at interpreter start."""
    site = tmp_path / "broken_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    monkeypatch.setenv("PYTHONPATH", str(site))


@pytest.mark.timeout(300)
def test_fast_scenarios_hold(capsys: pytest.CaptureFixture, tmp_path: Path, chaos) -> None:
    code, report = _chaos(chaos, capsys, tmp_path, *FAST)
    assert [r["scenario"] for r in report["rows"]] == FAST
    assert code == 0 and report["ok"], json.dumps(report, indent=1)
    assert all(r["ok"] and "!!" not in r["observed"] for r in report["rows"])
    assert not any((tmp_path / "chaos").iterdir()), "scenario folders removed without --keep"


@pytest.mark.timeout(300)
def test_a_broken_guarantee_fails_the_row_and_the_exit_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture, chaos) -> None:
    """Negative control: a non-finite stop that exits 0 instead of 3 is caught."""
    _break(monkeypatch, tmp_path, """
        import polyaccel.moe.cli
        polyaccel.moe.cli.EXIT_NONFINITE = 0
    """)
    code = chaos.main(["--only", "moe-nonfinite", "--timeout", "300", "--workdir", str(tmp_path / "chaos")])
    table = capsys.readouterr().out
    assert code == 1
    assert "!! exit 0" in table and "FAIL" in table and "FAILED: moe-nonfinite" in table


def test_scenario_selection(capsys: pytest.CaptureFixture, chaos) -> None:
    assert chaos.main(["--list"]) == 0
    names = capsys.readouterr().out.split()
    assert len(names) == 15 and names[0] == "asr-output-not-results" and names[-1] == "moe-killed-final-save"
    assert [s.name for s in chaos.select(["moe"])] == [n for n in names if n.startswith("moe-")]
    assert chaos.main(["--only", "no-such-scenario"]) == 2
    assert "unknown scenario no-such-scenario" in capsys.readouterr().err


@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_every_scenario_holds(capsys: pytest.CaptureFixture, tmp_path: Path, chaos) -> None:
    code, report = _chaos(chaos, capsys, tmp_path)
    assert [r["scenario"] for r in report["rows"]] == [s.name for s in chaos.SCENARIOS]  # every one ran
    assert code == 0 and report["ok"], json.dumps([r for r in report["rows"] if not r["ok"]], indent=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unsafe_loading_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                  capsys: pytest.CaptureFixture, chaos) -> None:
    """Negative control: checkpoints loaded with weights_only=False run the payload; caught."""
    _break(monkeypatch, tmp_path, """
        import torch
        _load = torch.load
        def load(*args, **kwargs):
            kwargs["weights_only"] = False
            return _load(*args, **kwargs)
        torch.load = load
    """)
    code, report = _chaos(chaos, capsys, tmp_path, "moe-malicious-pickle")
    (row,) = report["rows"]
    assert code == 1 and not row["ok"] and "!! PAYLOAD EXECUTED" in row["observed"], row


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_output_check_removed_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture, chaos) -> None:
    """Negative control: without the checks on -o, the .tsv and the manifest get written; caught."""
    _break(monkeypatch, tmp_path, """
        import polyaccel.asr.cli, polyaccel.asr.results_file
        polyaccel.asr.results_file.output_problem = lambda *args: None
        polyaccel.asr.cli._previous_results = lambda *args: []
    """)
    code, report = _chaos(chaos, capsys, tmp_path, "asr-output-not-results")
    (row,) = report["rows"]
    assert code == 1 and not row["ok"], row
    assert "!! changed ['manifest.jsonl', 'refs.tsv']" in row["observed"], row
