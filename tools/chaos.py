#!/usr/bin/env python3
"""Chaos check (issue 10): run the kill / corrupt / bad-name scenarios end to end against the
CLIs as a user runs them, and print one row per scenario: expected, observed, ok.

Every scenario runs ``polyaccel-asr`` / ``polyaccel-moe`` (the console scripts next to this
interpreter, else ``python -m polyaccel.{asr,moe}.cli``) as subprocesses in its own folder of a
temporary directory, on CPU, with small inputs: the five LibriVox clips of ``make setup`` and
Whisper tiny.en (the CLI's default model) for ASR, ``packages/moe/examples/tiny_synthetic_cpu.yaml``
with ``--set`` overrides for MoE. Each scenario is bounded in time (``--timeout``); a scenario
that runs out of time is a failure. Exit status: 0 when every scenario's observed matches its
expected, 1 otherwise, 2 for bad arguments.

    python tools/chaos.py                       # all scenarios, a table (2-3 minutes on 2 cores)
    python tools/chaos.py --only asr-kill-resume --only moe   # one scenario, or an area
    python tools/chaos.py --json --keep          # JSON rows; keep the folders to look at

Subprocesses inherit the environment (PYTHONPATH included), with ``OMP_NUM_THREADS=1`` unless
set or ``--threads`` says otherwise.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MOE_TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"
DEFAULT_ASR_MODEL = "whisper-tiny.en"
SR = 16000


# ---- running the CLIs, bounded ----------------------------------------------------------------------


class ScenarioTimeout(Exception):
    """The scenario ran out of its time."""


@dataclasses.dataclass
class Proc:
    rc: int
    out: str
    err: str
    seconds: float


def _console(name: str, module: str) -> list[str]:
    """The console script next to this interpreter (what ``make setup`` installs), else ``-m``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.is_file() and os.access(script, os.X_OK) else [sys.executable, "-m", module]


class Ctx:
    """One chaos run: the temporary root, the environment of the subprocesses, the clock of the
    scenario in progress, and the processes started in the background (killed at its end)."""

    def __init__(self, root: Path, *, asr_model: str, timeout: float, threads: int | None, log: Callable[[str], None]):
        self.root, self.asr_model, self.timeout, self.log = root, asr_model, timeout, log
        self.env = dict(os.environ)
        if threads is not None:
            self.env["OMP_NUM_THREADS"] = str(threads)
        else:
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.asr = _console("polyaccel-asr", "polyaccel.asr.cli")
        self.moe = _console("polyaccel-moe", "polyaccel.moe.cli")
        self.deadline = float("inf")
        self.background: list[subprocess.Popen] = []
        self._moe_base: Path | None = None
        self._librivox: list[Path] | None = None

    # -- time --
    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ScenarioTimeout(f"ran past its {self.timeout:.0f} s")
        return left

    def folder(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=False)
        return d

    # -- processes --
    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Proc:
        """Run to the end (bounded by the scenario's time left)."""
        t0 = time.monotonic()
        p = subprocess.Popen(argv, cwd=cwd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             encoding="utf-8", errors="replace", start_new_session=True)
        try:
            out, err = p.communicate(timeout=self.left())
        except subprocess.TimeoutExpired:
            _kill_group(p)
            p.communicate()
            raise ScenarioTimeout(f"timed out in: {_show(argv)}") from None
        return Proc(p.returncode, out, err, time.monotonic() - t0)

    def start(self, argv: list[str], cwd: Path, name: str) -> subprocess.Popen:
        """Start in the background, stdout/stderr to files in ``cwd`` (read them with ``logs``)."""
        with open(cwd / f"{name}.out", "w") as out, open(cwd / f"{name}.err", "w") as err:
            p = subprocess.Popen(argv, cwd=cwd, env=self.env, stdout=out, stderr=err, start_new_session=True)
        p.chaos_name = name  # type: ignore[attr-defined]
        self.background.append(p)
        return p

    def finish(self, p: subprocess.Popen, cwd: Path) -> Proc:
        """Wait for a background process (bounded) and read what it wrote."""
        try:
            p.wait(timeout=self.left())
        except subprocess.TimeoutExpired:
            _kill_group(p)
            raise ScenarioTimeout(f"background process {p.args[0]} did not end") from None
        name = p.chaos_name  # type: ignore[attr-defined]
        return Proc(p.returncode, _read(cwd / f"{name}.out"), _read(cwd / f"{name}.err"), 0.0)

    def wait_for(self, what: Callable[[], bool], p: subprocess.Popen, poll: float = 0.01) -> bool:
        """Poll until ``what()`` holds (True), or ``p`` has exited (False); bounded."""
        while True:
            if what():
                return True
            if p.poll() is not None:
                return bool(what())
            self.left()
            time.sleep(poll)

    def cleanup(self) -> None:
        for p in self.background:
            if p.poll() is None:
                _kill_group(p)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.background.clear()

    # -- ASR inputs --
    def asr_args(self) -> list[str]:
        return ["--backend", "cpu"] + ([] if self.asr_model == DEFAULT_ASR_MODEL else ["--model", self.asr_model])

    def clips(self, folder: Path, n: int, prefix: str = "clip") -> list[Path]:
        """``n`` real speech clips (LibriVox, cycled) copied into ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        sources = self.librivox()
        paths = []
        for i in range(n):
            dst = folder / f"{prefix}{i:02d}.wav"
            if sources:
                shutil.copyfile(sources[i % len(sources)], dst)
            else:
                _write_noise_wav(dst, 1.5 + 0.25 * i, seed=i)
            paths.append(dst)
        return paths

    def librivox(self) -> list[Path]:
        if self._librivox is None:
            try:
                from polyaccel.asr import samples

                folder = samples.librivox_dir()
            except ImportError:
                folder = None
            self._librivox = sorted(folder.glob("*.wav")) if folder else []
            if not self._librivox:
                self.log("LibriVox clips not found (make setup brings them): using generated noise")
        return self._librivox

    # -- MoE --
    def moe_cmd(self, *sets: str) -> list[str]:
        """``polyaccel-moe finetune`` of the tiny example, outputs under the cwd (runs/tiny/)."""
        base = ["log.progress_bar=false", "log.every_steps=1", f"log.metrics_jsonl={METRICS}"]
        return [*self.moe, "finetune", str(MOE_TINY), *[a for s in (*base, *sets) for a in ("--set", s)]]

    def moe_base(self) -> Path:
        """A finished run of the example as it is (8 steps, checkpoints at 4 and 8), made once;
        scenarios copy it."""
        if self._moe_base is None:
            d = self.folder("_moe_finished")
            p = self.run(self.moe_cmd(), d)
            if p.rc != 0:
                raise RuntimeError(f"the plain tiny MoE run failed (exit {p.rc}): {_tail(p.err)}")
            (d / "summary.json").write_text(json.dumps(_summary(p.out)))
            self._moe_base = d
        return self._moe_base

    def copy_moe_base(self, name: str) -> tuple[Path, dict[str, Any]]:
        base = self.moe_base()
        d = self.root / name
        shutil.copytree(base, d)
        return d, json.loads((d / "summary.json").read_text())


METRICS = "runs/tiny/metrics.jsonl"
CKPTS = "runs/tiny/checkpoints"


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "replace") if path.exists() else ""


def _show(argv: list[str]) -> str:
    return " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv))


def _tail(text: str, n: int = 300) -> str:
    lines = [x for x in text.strip().splitlines() if "Writing model shards" not in x]
    return " | ".join(lines)[-n:]


def _write_noise_wav(path: Path, seconds: float, seed: int) -> None:
    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    sf.write(path, (0.01 * rng.standard_normal(int(SR * seconds))).astype("float32"), SR)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a results / metrics file, parsed (a line that does not parse raises)."""
    return [json.loads(x) for x in path.read_bytes().decode("utf-8").splitlines()]


def _complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _summary(stdout: str) -> dict[str, Any]:
    """The JSON summary ``polyaccel-moe finetune`` prints last."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "start_step" in rec:
            return rec
    return {}


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"step_(\d+)", p.name))]
    return sorted(found)


def _complete_steps(root: Path) -> list[int]:
    """Steps whose checkpoint finished saving (has its manifest)."""
    return [s for s, p in _step_dirs(root) if (p / "manifest.json").is_file()]


def _write_manifest(directory: Path, step: int) -> None:
    """What a manifest of someone else's checkpoint would say: its files' sizes and sha256 (so
    the checksum passes and loading itself must refuse the file). Same format as polyaccel's."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            files[str(p.relative_to(directory))] = {"size": p.stat().st_size,
                                                    "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
    (directory / "manifest.json").write_text(json.dumps({"format": 1, "step": step, "files": files}, indent=1))


# ---- checks -----------------------------------------------------------------------------------------


class Checks:
    """Facts observed, each held against what was expected; ``observed`` lists them, a failed
    one marked with ``!!``."""

    def __init__(self) -> None:
        self.items: list[tuple[bool, str]] = []

    def __call__(self, ok: Any, text: str) -> bool:
        self.items.append((bool(ok), text))
        return bool(ok)

    def note(self, text: str) -> None:
        self.items.append((True, text))

    @property
    def ok(self) -> bool:
        return bool(self.items) and all(ok for ok, _ in self.items)

    @property
    def observed(self) -> str:
        return "; ".join(t if ok else f"!! {t}" for ok, t in self.items)


def _no_traceback(c: Checks, p: Proc, what: str = "") -> None:
    if "Traceback (most recent call last)" in p.err:
        c(False, f"{what}traceback on stderr: {_tail(p.err, 200)}")


# ---- ASR scenarios -----------------------------------------------------------------------------------


def asr_output_not_results(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-output-not-results")
    (clip,) = ctx.clips(d / "clips", 1)
    (d / "refs.tsv").write_text("utt1\thello world\nutt2\tgood night\n")
    (d / "manifest.jsonl").write_text(json.dumps({"audio_filepath": str(clip), "text": "x"}) + "\n")
    before = _snapshot(d)
    cases = [
        ("a .tsv", [str(clip), "-o", "refs.tsv"], "is not a polyaccel-asr results file"),
        ("a .tsv, --overwrite", [str(clip), "-o", "refs.tsv", "--overwrite"], "is not a polyaccel-asr results file"),
        ("a .wav (an input), --overwrite", [str(d / "clips"), "-o", str(clip), "--overwrite"],
         "named like an audio file"),
        ("the input manifest, --overwrite", ["manifest.jsonl", "-o", "manifest.jsonl", "--overwrite"], "is an input"),
    ]
    codes = []
    for label, args, message in cases:
        p = ctx.run([*ctx.asr, "transcribe", *args, *ctx.asr_args()], d)
        codes.append(str(p.rc))
        c(p.rc == 2 and message in p.err, f"-o {label}: exit {p.rc}, "
          + (f"'{message}'" if message in p.err else f"stderr: {_tail(p.err, 160)!r}"))
        _no_traceback(c, p, f"{label}: ")
    after = _snapshot(d)
    changed = sorted(k for k in before if before[k] != after.get(k))
    created = sorted(set(after) - set(before))
    c(not changed and not created, "every file byte-identical, nothing created" if not changed and not created
      else f"changed {changed}, created {created}")


def asr_mistyped_model(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-mistyped-model")
    ctx.clips(d / "clips", 2)
    first = ctx.run([*ctx.asr, "transcribe", "clips", "-o", "out.jsonl", *ctx.asr_args()], d)
    if not c(first.rc == 0 and _complete_lines(d / "out.jsonl") == 2,
             f"first run exit {first.rc}, {_complete_lines(d / 'out.jsonl')} results"):
        return
    before = _snapshot(d)
    m = ctx.asr_model
    typo = m[:-1] + ("m" if m[-1] != "m" else "n")
    p = ctx.run([*ctx.asr, "transcribe", "clips", "-o", "out.jsonl", "--backend", "cpu", "--model", typo,
                 "--overwrite"], d)
    c(p.rc == 2, f"--model {typo} --overwrite: exit {p.rc}")
    c(typo in p.err, f"error names {typo!r}" if typo in p.err else f"stderr: {_tail(p.err, 160)!r}")
    _no_traceback(c, p)
    after = _snapshot(d)
    c(after == before, "out.jsonl byte-identical, no files created" if after == before
      else f"changed: {sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}")


def asr_non_utf8_name(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-non-utf8-name")
    clips = ctx.clips(d / "clips", 3)
    odd = os.fsencode(d / "clips") + b"/caf\xe9.wav"  # Latin-1, as an old archive would have it
    os.rename(clips[0], odd)
    cmd = [*ctx.asr, "transcribe", str(d / "clips"), "-o", "out.jsonl", *ctx.asr_args()]
    p = ctx.run(cmd, d)
    raw = (d / "out.jsonl").read_bytes() if (d / "out.jsonl").exists() else b""
    try:
        raw.decode("utf-8")
        recs = _lines(d / "out.jsonl")
        valid = True
    except (UnicodeDecodeError, json.JSONDecodeError, FileNotFoundError):
        recs, valid = [], False
    ok_recs = [r for r in recs if not r.get("error")]
    odd_recs = [r for r in recs if isinstance(r.get("path_bytes"), str)
                and base64.b64decode(r["path_bytes"]).endswith(b"/caf\xe9.wav")]
    c(p.rc == 0, f"run 1 exit {p.rc}")
    c(valid, "results valid UTF-8 JSONL" if valid else "results file not valid UTF-8 JSONL")
    c(len(recs) == 3 and len(ok_recs) == 3, f"{len(ok_recs)}/{len(recs)} of 3 files transcribed"
      + ("" if len(ok_recs) == 3 else f" (errors: {[r.get('error') for r in recs if r.get('error')]})"))
    c(len(odd_recs) == 1 and not odd_recs[0].get("error"),
      "caf\\xe9.wav transcribed, its bytes kept (path_bytes)" if len(odd_recs) == 1 else "no record for caf\\xe9.wav")
    p2 = ctx.run(cmd, d)
    same = (d / "out.jsonl").read_bytes() == raw
    c(p2.rc == 0 and "0 ok, 0 failed, 3 skipped" in p2.err, f"rerun exit {p2.rc}, "
      + ("'0 ok, 0 failed, 3 skipped'" if "3 skipped" in p2.err else f"stderr: {_tail(p2.err, 160)!r}"))
    c(same, "results byte-identical after the rerun" if same else "the rerun changed the results")
    _no_traceback(c, p)
    _no_traceback(c, p2)


def asr_kill_resume(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-kill-resume")
    n = 12 if ctx.asr_model == DEFAULT_ASR_MODEL else 60
    clips = ctx.clips(d / "clips", n)
    out = d / "out.jsonl"
    cmd = [*ctx.asr, "transcribe", str(d / "clips"), "-o", "out.jsonl", "--batch-size", "1", *ctx.asr_args()]
    p = ctx.start(cmd, d, "run1")
    alive = ctx.wait_for(lambda: _complete_lines(out) >= 3 and p.poll() is None, p)
    if not c(alive, "killed mid-run" if alive else f"the run ended (exit {p.poll()}) before 3 results: cannot kill it "
             f"mid-run: {_tail(_read(d / 'run1.err'), 200)!r}"):
        return
    p.send_signal(signal.SIGKILL)  # kill -9 of the CLI's process
    p.wait(timeout=30)
    _kill_group(p)
    kept = out.read_bytes()
    kept = kept[: kept.rfind(b"\n") + 1]
    k = kept.count(b"\n")
    c(0 < k < n, f"SIGKILL after {k} of {n} results")
    p2 = ctx.run(cmd, d)
    try:
        recs = _lines(out)
        parses = True
    except (json.JSONDecodeError, UnicodeDecodeError):
        recs, parses = [], False
    names = Counter(Path(r["path"]).name for r in recs)
    missing = sorted(x.name for x in clips if names[x.name] == 0)
    dups = sorted(name for name, cnt in names.items() if cnt > 1)
    errors = [r.get("error") for r in recs if r.get("error")]
    c(p2.rc == 0, f"rerun exit {p2.rc}")
    c(f"{k} of {n} already done" in p2.err, f"rerun said 'resuming ... {k} of {n} already done'"
      if f"{k} of {n} already done" in p2.err else f"rerun stderr: {_tail(p2.err, 160)!r}")
    c(parses, "every line parses" if parses else "a line does not parse")
    c(len(recs) == n and not missing and not dups and not errors,
      f"{len(recs)} lines: every input exactly once" if len(recs) == n and not missing and not dups and not errors
      else f"{len(recs)} lines, missing {missing}, duplicated {dups}, errors {errors}")
    c(out.read_bytes().startswith(kept), f"the {k} lines written before the kill kept as they were")
    _no_traceback(c, p2)


def asr_missing_input(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-missing-input")
    p = ctx.run([*ctx.asr, "transcribe", "no_such_dir/", "-o", "out.jsonl", *ctx.asr_args()], d)
    c(p.rc == 2 and "no such directory: no_such_dir/" in p.err,
      f"'no_such_dir/': exit {p.rc}" + (", 'no such directory'" if "no such directory" in p.err else
                                      f", stderr: {_tail(p.err, 160)!r}"))
    c(sorted(os.listdir(d)) == [], "nothing written" if sorted(os.listdir(d)) == [] else f"wrote {os.listdir(d)}")
    p2 = ctx.run([*ctx.asr, "transcribe", "no_such_dir", "-o", "out.jsonl", *ctx.asr_args()], d)
    c(p2.rc == 2 and not os.listdir(d), f"'no_such_dir' (no slash): exit {p2.rc}, "
      + ("nothing written" if not os.listdir(d) else f"wrote {os.listdir(d)}"))
    _no_traceback(c, p)
    _no_traceback(c, p2)


def asr_corrupt_audio(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-corrupt-audio")
    clips = ctx.clips(d / "clips", 2)
    data = clips[0].read_bytes()
    bad = {"truncated.wav": data[: len(data) // 2], "header_only.wav": data[:30],
           "garbage.wav": data[:44] + bytes(range(256)) * 8, "empty.wav": b"", "text.wav": b"not audio at all\n"}
    for name, content in bad.items():
        (d / "clips" / name).write_bytes(content)
    p = ctx.run([*ctx.asr, "transcribe", "clips", "-o", "out.jsonl", *ctx.asr_args()], d)
    recs = _lines(d / "out.jsonl") if (d / "out.jsonl").exists() else []
    by = {Path(r["path"]).name: r for r in recs}
    c(p.rc == 1, f"exit {p.rc} (1 = some files failed)")
    c(len(recs) == 7 and len(by) == 7, f"{len(recs)} lines for 7 inputs")
    errs = {name: (by.get(name) or {}).get("error") for name in bad}
    c(all(errs.values()), "a per-file error for each bad file: "
      + ", ".join(f"{n}: {e!r}" for n, e in errs.items()))
    good = [by.get(x.name) or {} for x in clips]
    c(all(r.get("error") is None and r.get("text") for r in good),
      f"{sum(r.get('error') is None and bool(r.get('text')) for r in good)}/2 good files transcribed")
    _no_traceback(c, p)


def asr_two_runs(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-two-runs")
    n = 6 if ctx.asr_model == DEFAULT_ASR_MODEL else 60
    ctx.clips(d / "clips", n)
    cmd = [*ctx.asr, "transcribe", "clips", "-o", "out.jsonl", "--batch-size", "1", *ctx.asr_args()]
    lock = d / "out.jsonl.polyaccel-asr.lock"
    first = ctx.start(cmd, d, "first")
    held = ctx.wait_for(lambda: lock.exists() and lock.read_text().startswith("polyaccel-asr lock, pid ")
                        and lock.read_text().endswith("\n"), first)
    if not c(held and first.poll() is None, f"first run (pid {first.pid}) holds {lock.name}" if held
             else f"first run ended (exit {first.poll()}) before it could be raced"):
        return
    second = ctx.run(cmd, d)
    r1 = ctx.finish(first, d)
    msg = f"another run (pid {first.pid}) is writing out.jsonl"
    c(second.rc == 2 and msg in second.err, f"second run exit {second.rc}, "
      + (f"'{msg}'" if msg in second.err else f"stderr: {_tail(second.err, 160)!r}"))
    recs = _lines(d / "out.jsonl") if (d / "out.jsonl").exists() else []
    names = Counter(Path(r["path"]).name for r in recs)
    c(r1.rc == 0 and len(recs) == n and len(names) == n,
      f"first run exit {r1.rc}, {len(recs)} lines for {n} inputs, each once" if len(names) == len(recs)
      else f"first run exit {r1.rc}, duplicated: {[k for k, v in names.items() if v > 1]}")
    c(not lock.exists(), "lock file removed at the end" if not lock.exists() else "lock file left behind")
    _no_traceback(c, second, "second: ")
    _no_traceback(c, r1, "first: ")


def asr_lock_not_ours(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("asr-lock-not-ours")
    (clip,) = ctx.clips(d / "clips", 1)
    (d / "notes.txt").write_text("the user's notes\n")
    before = _snapshot(d)
    for label, text in (("a symlink to the user's notes", None), ("a file of the user's", "not a pid\n"),
                        ("a file of the user's holding a number", "12345\n")):
        lock = d / "out.jsonl.polyaccel-asr.lock"
        lock.symlink_to(d / "notes.txt") if text is None else lock.write_text(text)
        p = ctx.run([*ctx.asr, "transcribe", str(clip), "-o", "out.jsonl", *ctx.asr_args()], d)
        said = "not a lock file of ours" in p.err
        c(p.rc == 2 and said, f"out.jsonl.polyaccel-asr.lock {label}: exit {p.rc}, "
          + ("'not a lock file of ours'" if said else f"stderr: {_tail(p.err, 160)!r}"))
        kept = os.path.lexists(lock) and (lock.is_symlink() if text is None else lock.read_text() == text)
        c(kept, "the lock path left as it was" if kept else "the lock path was changed")
        _no_traceback(c, p, f"{label}: ")
        lock.unlink()
    after = _snapshot(d)
    same = after == before
    c(same, "the notes byte-identical, no results written" if same
      else f"changed: {sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}")


# ---- MoE scenarios -------------------------------------------------------------------------------------


KILL_STEPS = 50
KILL_SETS = ("train.seq_len=128", "train.micro_batch=4", f"train.max_steps={KILL_STEPS}", "checkpoint.every_steps=5")


def _losses(path: Path) -> dict[int, float | None]:
    return {r["step"]: r["loss"] for r in _lines(path)} if path.exists() else {}


def moe_kill_resume(ctx: Ctx, c: Checks) -> None:
    ref_dir, kill_dir = ctx.folder("moe-kill-resume/uninterrupted"), ctx.folder("moe-kill-resume/killed")
    ref = ctx.run(ctx.moe_cmd(*KILL_SETS), ref_dir)
    ref_sum = _summary(ref.out)
    if not c(ref.rc == 0 and ref_sum.get("steps") == KILL_STEPS, f"uninterrupted run exit {ref.rc}, "
             f"final loss {ref_sum.get('final_loss')}"):
        return
    metrics = kill_dir / METRICS

    def past_step(n: int) -> bool:
        try:
            return any(json.loads(x)["step"] >= n for x in metrics.read_text().splitlines()[-2:] if x.endswith("}"))
        except (OSError, json.JSONDecodeError):
            return False

    p = ctx.start(ctx.moe_cmd(*KILL_SETS), kill_dir, "run1")
    alive = ctx.wait_for(lambda: past_step(12) and p.poll() is None, p, poll=0.005)
    if not c(alive, "killed mid-training" if alive else f"the run ended (exit {p.poll()}) before step 12: cannot "
             "kill it mid-training"):
        return
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    _kill_group(p)
    logged = max((json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.endswith("}")), default=0)
    steps = _complete_steps(kill_dir / CKPTS)
    newest = steps[-1] if steps else 0
    c(newest >= 10, f"SIGKILL at step ~{logged}, newest complete checkpoint step {newest}")
    p2 = ctx.run(ctx.moe_cmd(*KILL_SETS), kill_dir)
    s = _summary(p2.out)
    c(p2.rc == 0 and s.get("steps") == KILL_STEPS, f"rerun exit {p2.rc}, {s.get('steps')} steps")
    c(s.get("start_step") == newest, f"resumed from step {s.get('start_step')}")
    c(s.get("final_loss") == ref_sum["final_loss"], f"final loss {s.get('final_loss')} "
      + ("== uninterrupted" if s.get("final_loss") == ref_sum["final_loss"] else f"!= uninterrupted {ref_sum['final_loss']}"))
    records = [r["step"] for r in _lines(metrics)]
    got, want = _losses(metrics), _losses(ref_dir / METRICS)
    every = list(range(1, KILL_STEPS + 1))
    c(records == every, f"metrics.jsonl: steps 1-{KILL_STEPS} once each" if records == every
      else f"metrics.jsonl steps {records}")
    diff = [k for k in want if got.get(k) != want[k]]
    c(not diff, "every step's loss equal to the uninterrupted run's" if not diff else f"losses differ at steps {diff}")
    _no_traceback(c, p2)


def moe_corrupt_checkpoint(ctx: Ctx, c: Checks) -> None:
    d, base = ctx.copy_moe_base("moe-corrupt-checkpoint")
    weights = d / CKPTS / "step_00000008/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern inside a tensor; same size
    weights.write_bytes(bytes(data))
    p = ctx.run(ctx.moe_cmd(), d)
    s = _summary(p.out)
    warned = "not resuming from checkpoint step_00000008" in p.err and "model.safetensors fails its sha256 check" in p.err
    c(p.rc == 0, f"exit {p.rc}")
    c(warned, "warned: 'not resuming from checkpoint step_00000008: ...model.safetensors fails its sha256 check'"
      if warned else f"no warning naming the file: {_tail(p.err, 200)!r}")
    c(s.get("start_step") == 4 and s.get("steps") == 8, f"resumed from step {s.get('start_step')}, "
      f"ran to {s.get('steps')}")
    c(s.get("final_loss") == base["final_loss"], f"final loss {s.get('final_loss')} "
      + ("== the intact run's" if s.get("final_loss") == base["final_loss"] else f"!= the intact run's {base['final_loss']}"))
    _no_traceback(c, p)


PAYLOAD = ("import os\n"
           "open(os.environ.get('CHAOS_MARKER', {default!r}), 'w').write('payload ran')\n")


class _Payload:
    """Unpickles as ``exec(code)``: what a hostile checkpoint would carry."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


def moe_malicious_pickle(ctx: Ctx, c: Checks) -> None:
    import torch

    d, _ = ctx.copy_moe_base("moe-malicious-pickle")
    marker = d / "PAYLOAD_RAN"
    step8 = d / CKPTS / "step_00000008"
    state = torch.load(step8 / "trainer_state.pt", map_location="cpu", weights_only=True)
    payload = _Payload(PAYLOAD.format(default=str(marker)))
    torch.save({**state, "scheduler": payload}, step8 / "trainer_state.pt")
    _write_manifest(step8, 8)  # its manifest matches its bytes: only loading can refuse it
    # The payload is live: plain unpickling runs it (in a throwaway process).
    armed = d / "armed_check"
    env = {**ctx.env, "CHAOS_MARKER": str(armed)}
    ctx.run([sys.executable, "-c", "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))",
             pickle.dumps(payload).hex()], d, env=env)
    c(armed.exists(), "payload live (unpickling runs it)" if armed.exists()
      else "payload did not run even unpickled: the scenario proves nothing")
    p = ctx.run(ctx.moe_cmd("train.max_steps=12"), d)
    refused = "trainer_state.pt: refused" in p.err
    c(p.rc == 2, f"continuing from it (max_steps=12): exit {p.rc}")
    c(refused, "'trainer_state.pt: refused'" if refused else f"stderr: {_tail(p.err, 200)!r}")
    c(not marker.exists(), "payload not executed" if not marker.exists() else "PAYLOAD EXECUTED")
    _no_traceback(c, p)


def moe_nonfinite(ctx: Ctx, c: Checks) -> None:
    d = ctx.folder("moe-nonfinite")
    p = ctx.run(ctx.moe_cmd("train.lr=1e30", "checkpoint.every_steps=1"), d)
    m = re.search(r"step (\d+): non-finite loss", p.err)
    c(p.rc == 3, f"exit {p.rc}")
    if not c(m, f"error names the step: 'step {m.group(1)}: non-finite loss'" if m
             else f"no step named: {_tail(p.err, 200)!r}"):
        return
    bad = int(m.group(1))
    steps = _complete_steps(d / CKPTS)
    saved_bad = any(s >= bad for s, _ in _step_dirs(d / CKPTS))
    c(not saved_bad, f"checkpoints {steps}, none of step {bad}")
    if steps:
        named = f"step_{steps[-1]:08d}" in p.err
        c(named, f"names the last good checkpoint step_{steps[-1]:08d}" if named else "does not name the last checkpoint")
    c(not (d / "runs/tiny/final").exists(), "no final output written")
    _no_traceback(c, p)


def moe_finished_rerun(ctx: Ctx, c: Checks) -> None:
    d, base = ctx.copy_moe_base("moe-finished-rerun")
    before = _snapshot(d / "runs")
    p = ctx.run(ctx.moe_cmd(), d)
    s = _summary(p.out)
    c(p.rc == 0, f"exit {p.rc}")
    said = "nothing to do" in p.err and "run already finished at step 8" in p.err
    c(said, "'run already finished at step 8 ...; nothing to do'" if said else f"stderr: {_tail(p.err, 200)!r}")
    c(s.get("final_loss") is None and s.get("start_step") == 8, f"no step trained (summary start_step "
      f"{s.get('start_step')}, final_loss {s.get('final_loss')})")
    after = _snapshot(d / "runs")
    c(after == before, "checkpoints, metrics and final output unchanged" if after == before
      else f"changed: {sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}")
    _no_traceback(c, p)


def moe_output_over_input(ctx: Ctx, c: Checks) -> None:
    d, _ = ctx.copy_moe_base("moe-output-over-input")
    final = d / "runs/tiny/final"
    mine = d / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's notes\n")
    (mine / "model-00001-of-00002.safetensors").write_text("the user's file named like a shard\n")
    before = _snapshot(d)
    cases = [("model.path", ("checkpoint.dir=runs/next", f"model.path={final}", f"output_dir={final}"),
              "is model.path, which this run reads"),
             ("a checkpoint", (f"output_dir={CKPTS}/step_00000004",),
              "is inside checkpoint.dir"),
             ("a folder of the user's files", ("checkpoint.dir=runs/next", f"output_dir={mine}"),
              "already holds files and no saved model")]
    for label, sets, message in cases:
        p = ctx.run(ctx.moe_cmd(*sets), d)
        c(p.rc == 2 and message in p.err, f"output_dir at {label}: exit {p.rc}, "
          + (f"'{message}'" if message in p.err else f"stderr: {_tail(p.err, 160)!r}"))
        _no_traceback(c, p, f"{label}: ")
    after = {k: v for k, v in _snapshot(d).items() if not k.startswith("runs/next")}
    same = after == before
    c(same, "the model, the checkpoints and the user's files byte-identical" if same
      else f"changed: {sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))}")


def moe_killed_final_save(ctx: Ctx, c: Checks) -> None:
    d, _ = ctx.copy_moe_base("moe-killed-final-save")
    weights = d / "runs/tiny/final/model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 3])  # what a kill in the middle of the final save leaves
    p = ctx.run(ctx.moe_cmd(), d)
    c(p.rc == 0, f"rerun: exit {p.rc}")
    said = "does not hold the final model" in p.err
    c(said, "says it rewrites output_dir from the last checkpoint" if said else f"stderr: {_tail(p.err, 200)!r}")
    same = weights.is_file() and weights.read_bytes() == good
    c(same, "final model.safetensors byte-identical to the uninterrupted run's" if same
      else "final weights not restored")
    again = ctx.run(ctx.moe_cmd(), d)
    c(again.rc == 0 and "does not hold" not in again.err, f"a second rerun: exit {again.rc}, nothing rewritten")
    _no_traceback(c, p)


# ---- the table ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Scenario:
    name: str
    expected: str
    fn: Callable[[Ctx, Checks], None]

    @property
    def area(self) -> str:
        return self.name.split("-", 1)[0]


SCENARIOS = [
    Scenario("asr-output-not-results", "-o at a .tsv, a .wav, the input manifest (with and without --overwrite): "
             "exit 2, every file byte-identical, nothing created", asr_output_not_results),
    Scenario("asr-mistyped-model", "--model typo --overwrite over existing results: exit 2 naming it, "
             "results byte-identical", asr_mistyped_model),
    Scenario("asr-non-utf8-name", "a Latin-1 file name among inputs: every file transcribed, UTF-8 results; "
             "rerun: exit 0, all skipped, results unchanged", asr_non_utf8_name),
    Scenario("asr-kill-resume", "kill -9 mid-run, rerun: exit 0, every input exactly once, earlier lines kept",
             asr_kill_resume),
    Scenario("asr-missing-input", "nonexistent input dir: non-zero exit ('dir/': 2, nothing written)",
             asr_missing_input),
    Scenario("asr-corrupt-audio", "truncated/empty/garbage/text .wav: a per-file error each, good files "
             "transcribed, exit 1", asr_corrupt_audio),
    Scenario("asr-two-runs", "two runs on one -o at once: second exits 2 naming the first's pid; first "
             "finishes, each input once", asr_two_runs),
    Scenario("asr-lock-not-ours", "out.jsonl.polyaccel-asr.lock is a symlink to a user's file, or a user's file: exit 2, "
             "nothing written through it or replaced", asr_lock_not_ours),
    Scenario("moe-kill-resume", "kill -9 mid-training, rerun: resumes from the newest checkpoint, finishes; "
             "losses equal an uninterrupted run's, each step logged once", moe_kill_resume),
    Scenario("moe-corrupt-checkpoint", "a flipped byte in the newest checkpoint: warning naming the file, "
             "resume from the previous one, exit 0, same final loss", moe_corrupt_checkpoint),
    Scenario("moe-malicious-pickle", "a code-running pickle in trainer_state.pt (valid manifest): exit 2, "
             "'refused', payload not executed", moe_malicious_pickle),
    Scenario("moe-nonfinite", "lr=1e30: exit 3 naming the step, that step never checkpointed, no final output",
             moe_nonfinite),
    Scenario("moe-finished-rerun", "rerun of a finished run: exit 0, 'nothing to do', nothing trained or changed",
             moe_finished_rerun),
    Scenario("moe-output-over-input", "output_dir at model.path, a checkpoint, a folder of user files: exit 2, "
             "every file byte-identical", moe_output_over_input),
    Scenario("moe-killed-final-save", "final weights cut short (a kill mid-save), rerun: exit 0, rewritten "
             "from the last checkpoint byte for byte; a second rerun changes nothing", moe_killed_final_save),
]


@dataclasses.dataclass
class Row:
    scenario: str
    expected: str
    observed: str
    ok: bool
    seconds: float


def run_scenario(ctx: Ctx, sc: Scenario) -> Row:
    c = Checks()
    t0 = time.monotonic()
    ctx.deadline = t0 + ctx.timeout
    try:
        sc.fn(ctx, c)
    except ScenarioTimeout as e:
        c(False, f"TIMEOUT: {e}")
    except Exception as e:  # a broken scenario is a failed row, not a crash of the table
        c(False, f"chaos error: {type(e).__name__}: {e}")
    finally:
        ctx.cleanup()
        ctx.deadline = float("inf")
    return Row(sc.name, sc.expected, c.observed, c.ok, round(time.monotonic() - t0, 1))


def select(only: list[str] | None) -> list[Scenario]:
    if not only:
        return list(SCENARIOS)
    wanted = [w for arg in only for w in arg.split(",") if w]
    names = {s.name for s in SCENARIOS} | {s.area for s in SCENARIOS}
    unknown = [w for w in wanted if w not in names]
    if unknown:
        raise SystemExit(f"chaos.py: unknown scenario {', '.join(unknown)}; known: "
                         f"{', '.join(s.name for s in SCENARIOS)} (or asr, moe)")
    return [s for s in SCENARIOS if s.name in wanted or s.area in wanted]


def table(rows: list[Row]) -> str:
    widths = (24, 46, 70, 4)
    head = ("scenario", "expected", "observed", "ok")
    out = []

    def line(cells: tuple[str, ...]) -> None:
        wrapped = [textwrap.wrap(t, w) or [""] for t, w in zip(cells, widths)]
        for i in range(max(map(len, wrapped))):
            out.append(" | ".join((col[i] if i < len(col) else "").ljust(w) for col, w in zip(wrapped, widths)).rstrip())

    line(head)
    out.append("-+-".join("-" * w for w in widths))
    for r in rows:
        line((f"{r.scenario} ({r.seconds:.0f} s)", r.expected, r.observed, "ok" if r.ok else "FAIL"))
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="scenarios:\n" + "\n".join(f"  {s.name:<24} {s.expected}" for s in SCENARIOS))
    p.add_argument("--only", action="append", metavar="NAME", help="run this scenario (or area: asr, moe); repeatable")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per scenario (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the CLIs (default: as set, else 1)")
    p.add_argument("--asr-model", default=DEFAULT_ASR_MODEL, help="model for the ASR runs (default: %(default)s)")
    p.add_argument("--workdir", type=Path, help="put the scenario folders here (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the scenario folders")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(s.name for s in SCENARIOS))
        return 0
    try:
        chosen = select(args.only)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"chaos: {msg}", file=sys.stderr, flush=True)

    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="polyaccel-chaos-", dir=args.workdir))
    ctx = Ctx(root, asr_model=args.asr_model, timeout=args.timeout, threads=args.threads, log=log)
    rows = []
    t0 = time.monotonic()
    try:
        for sc in chosen:
            log(f"{sc.name} ...")
            rows.append(run_scenario(ctx, sc))
            log(f"{sc.name}: {'ok' if rows[-1].ok else 'FAIL'} ({rows[-1].seconds:.0f} s)")
    finally:
        ctx.cleanup()
        if args.keep:
            log(f"scenario folders kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - t0
    failed = [r.scenario for r in rows if not r.ok]
    if args.json:
        print(json.dumps({"ok": not failed, "seconds": round(total, 1), "rows": [dataclasses.asdict(r) for r in rows]},
                         indent=1))
    else:
        print(table(rows))
        print(f"{len(rows) - len(failed)} of {len(rows)} scenarios as expected in {total:.0f} s"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
