"""README.md against the code it names, so the README cannot rot unnoticed.

Every shell line of its ``bash`` blocks is checked without running a model: ``polyaccel*`` lines
parse with the real CLI parser (subcommand, flags, choices), ``polyaccel-moe`` configs load with
their ``--set`` overrides (a repository example whose input files do not exist must have them
overridden on the line), ``--model`` names are known, ``make`` targets, ``tools/*.py`` and
repository paths exist. The core snippet runs; the op list and the ``polyaccel backends`` table
match the code; every ``tools/*.py`` is in the layout; measured rows carry a date and a commit;
relative links resolve in README.md and docs/*.md. Each checker returns its findings as a list,
and each has a test that feeds it a broken README (the negative control lives here).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
STAND_IN = ROOT / "packages/moe/examples/tiny_synthetic_cpu.yaml"  # for placeholder configs (cfg.yaml)
EXTERNAL = {"cp", "ray start", "ray stop"}  # other programs' commands, shown as they are documented by them


def fenced(text: str, lang: str | None) -> list[str]:
    """The bodies of the ``` blocks tagged ``lang`` (None: untagged)."""
    blocks, body, tag = [], None, None
    for line in text.splitlines(keepends=True):
        if line.startswith("```") and body is None:
            body, tag = [], line[3:].strip() or None
        elif line.startswith("```"):
            blocks += ["".join(body)] if tag == lang else []
            body = None
        elif body is not None:
            body.append(line)
    return blocks


def shell_commands(text: str) -> list[list[str]]:
    """Each command of the ``bash`` blocks and each ``$ `` line of the untagged ones, as argv:
    continuations joined, comments dropped, ``a && b`` split, ``ray job submit ... -- CMD`` and
    ``torchrun ... -m MOD`` unwrapped."""
    lines = [s for b in fenced(text, "bash") for s in b.replace("\\\n", " ").splitlines()]
    lines += [s[2:] for b in fenced(text, None) for s in b.splitlines() if s.startswith("$ ")]
    commands = []
    for line in lines:
        argv = shlex.split(line, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            commands.append(_unwrap(argv[:cut]))
            argv = argv[cut + 1:]
    return [c for c in commands if c]


def _unwrap(argv: list[str]) -> list[str]:
    if argv[:3] == ["ray", "job", "submit"] and "--" in argv:
        return _unwrap(argv[argv.index("--") + 1:])
    if argv[:1] == ["torchrun"] and "-m" in argv:
        i = argv.index("-m")
        module, rest = argv[i + 1], argv[i + 2:]
        return (["polyaccel-moe"] if module == "polyaccel.moe.cli" else ["python", "-m", module]) + rest
    return argv


class _Parsed(Exception):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.namespace = args


def _parse(main, argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """The arguments ``main(argv)`` parses, stopped right there (nothing runs), or argparse's
    error line."""
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, *a, **k):
        raise _Parsed(real(parser, *a, **k))

    err = io.StringIO()
    with contextlib.redirect_stderr(err), mock.patch.object(argparse.ArgumentParser, "parse_args", parse_and_stop):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.namespace, ""
        except SystemExit:
            return None, err.getvalue().strip().splitlines()[-1]
    return None, f"{main.__module__}.main returned without parsing its arguments"


def _check_asr(argv: list[str]) -> list[str]:
    from polyaccel.asr.cli import main
    from polyaccel.asr.weights import known_name

    args, err = _parse(main, argv)
    if args is None:
        return [err]
    model = getattr(args, "model", None)
    if model and "/" not in model and known_name(model) is None:
        return [f"--model {model}: not a known model name"]
    return []


def _check_moe(argv: list[str]) -> list[str]:
    from polyaccel.moe.cli import main
    from polyaccel.moe.train_config import ConfigError, load_config

    args, err = _parse(main, argv)
    if args is None:
        return [err]
    if args.command not in ("finetune", "bench"):
        return []
    overrides = ([f"model.preset={args.preset}"] if getattr(args, "preset", None) else []) + list(args.set or [])
    config = Path(args.config) if args.config else None
    in_repo = config is not None and (ROOT / config).is_file()
    if config is not None and not in_repo and config.parent != Path("."):
        return [f"{config}: no such file in the repository"]
    try:
        cfg = load_config(ROOT / config if in_repo else STAND_IN if config else None, overrides)
    except ConfigError as e:
        return [str(e)]
    if not in_repo:
        return []
    given = {o.split("=", 1)[0] for o in overrides}
    inputs = {"model.path": cfg.model.path, "data.jsonl": cfg.data.jsonl}
    return [f"{config}: its {key} {value} does not exist: the line must set it (--set {key}=...)"
            for key, value in inputs.items()
            if value and key not in given and not ((ROOT / config).parent / value).exists()]


def _check_core(argv: list[str]) -> list[str]:
    from polyaccel.core.cli import main

    args, err = _parse(main, argv)
    return [] if args is not None else [err]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_command(argv: list[str]) -> list[str]:
    """Why this README command would not run as written ([] if it would)."""
    prog = argv[0]
    if prog == "polyaccel-asr":
        return _check_asr(argv[1:])
    if prog == "polyaccel-moe":
        return _check_moe(argv[1:])
    if prog == "polyaccel":
        return _check_core(argv[1:])
    if prog == "make":
        return [f"make {t}: no such target" for t in argv[1:] if t not in _make_targets()]
    if prog in ("python", "python3") and argv[1:2] != ["-m"]:
        return [] if (ROOT / argv[1]).is_file() else [f"{argv[1]}: no such file"]
    if prog == "eval" and len(argv) == 2:  # eval "$(python -m MODULE ARGS)"
        inner = shlex.split(argv[1].removeprefix("$(").removesuffix(")"))
        if inner[:3] == ["python", "-m", "polyaccel.core.ray_local"]:
            return [] if inner[3:] == ["env"] else [f"ray_local {inner[3:]}: its only command is env"]
    if prog in EXTERNAL or " ".join(argv[:2]) in EXTERNAL:
        return []
    return [f"no checker for {' '.join(argv[:3])!r}: add one to {Path(__file__).name}"]


def command_problems(text: str) -> list[str]:
    return [f"{shlex.join(argv)}: {p}" for argv in shell_commands(text) for p in check_command(argv)]


def preset_problems(text: str) -> list[str]:
    """Preset names a README line lists after ``--preset ... # ... also``."""
    from polyaccel.moe.train_config import PRESETS

    named = []
    for line in text.splitlines():
        if "--preset" in line and "also " in line:
            named += [n.strip(" .") for n in line.split("also ", 1)[1].split(",")]
    return [f"unknown preset {n!r}" for n in named if n not in PRESETS]


def path_problems(text: str) -> list[str]:
    """Repository paths written in the README (packages/..., tools/..., requirements/...)."""
    found = set(re.findall(r"(?<![\w/.])((?:packages|tools|requirements|tests|docs)/[\w./-]*\.(?:py|yaml|txt|md))", text))
    return [f"{p}: no such file" for p in sorted(found) if not (ROOT / p).exists()]


def op_problems(text: str) -> list[str]:
    """The op list (README's "Ops (...)", architecture.md's "defines the named ops (...)")
    against the registry (`polyaccel kernels --json`)."""
    from polyaccel.core.cli import main

    listed = re.search(r"(?:Ops|defines the named ops) \((.*?)(?:`polyaccel kernels` lists them\)|\)\. Each)", text, re.S)
    if listed is None:
        return ["no op list paragraph"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["kernels", "--json"])
    real = {row["op"] for row in json.loads(out.getvalue())}
    named = set(re.findall(r"`(\w+)`", listed.group(1)))
    return ([f"op {o} is not in the registry" for o in sorted(named - real)]
            + [f"op {o} is missing from the list" for o in sorted(real - named)])


def backends_table_problems(text: str) -> list[str]:
    """The ``$ polyaccel backends`` sample: its header and backend names, in order."""
    from polyaccel.core.cli import main

    samples = [b for b in fenced(text, None) if b.startswith("$ polyaccel backends\n")]
    if not samples:
        return ["no '$ polyaccel backends' sample"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["backends"])
    real = out.getvalue().splitlines()
    shown = samples[0].splitlines()[1:]
    shown = shown[:next((i for i, s in enumerate(shown) if s.startswith("$")), len(shown))]
    problems = [] if shown[0] == real[0] else [f"header {shown[0]!r}, the CLI prints {real[0]!r}"]
    names = [s.split()[0] for s in shown[1:]], [r.split()[0] for r in real[1:]]
    return problems + ([] if names[0] == names[1] else [f"backends {names[0]}, the CLI lists {names[1]}"])


def layout_problems(text: str) -> list[str]:
    """Every tools/*.py is named on the layout's tools/ line(s)."""
    layout = next((b for b in fenced(text, None) if b.startswith("packages/")), "")
    tools = re.search(r"^tools/ (.*?)(?=^\S)", layout + "\nEND", re.M | re.S)
    named = set(re.findall(r"[\w]+\.py", tools.group(1))) if tools else set()
    return [f"tools/{p.name} is not in the layout" for p in sorted((ROOT / "tools").glob("*.py"))
            if p.name not in named]


def measured_problems(text: str) -> list[str]:
    """Rows of the ASR 'Measured' table without a date (YYYY-MM-DD) and a commit."""
    table = text.split("Measured:", 1)[1].split("\n\n", 2)[1] if "Measured:" in text else ""
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    return [f"no date or commit: {r[:70]}..." for r in rows
            if not (re.search(r"20\d\d-\d\d-\d\d", r) and re.search(r"commits? [0-9a-f]{7}", r))]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link_problems(md: Path, text: str) -> list[str]:
    """Relative links of one markdown file: the file exists, the #anchor is one of its headings."""
    problems = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+:", link):
            continue
        name, _, anchor = link.partition("#")
        target = (md.parent / name) if name else md
        if not target.exists():
            problems.append(f"{md.name}: {link}: no such file")
        elif anchor and target.suffix == ".md":
            heads = {_slug(h) for h in re.findall(r"^#+\s+(.*)$", target.read_text(), re.M)}
            if anchor not in heads:
                problems.append(f"{md.name}: {link}: no such heading")
    return problems


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_every_readme_command_would_run_as_written(readme):
    assert len(shell_commands(readme)) >= 20  # the blocks were found
    assert command_problems(readme) == []


def test_presets_named_in_readme_exist(readme):
    assert preset_problems(readme) == []


def test_repository_paths_in_readme_exist(readme):
    assert path_problems(readme) == []


@pytest.mark.parametrize("md", ["README.md", "docs/architecture.md"])
def test_op_list_is_the_registry(md):
    assert op_problems((ROOT / md).read_text()) == []


@pytest.mark.parametrize("md", ["README.md", "docs/architecture.md"])
def test_backends_sample_matches_the_cli(md):
    assert backends_table_problems((ROOT / md).read_text()) == []


def test_layout_names_every_tool(readme):
    assert layout_problems(readme) == []


def test_measured_rows_say_when_and_at_which_commit(readme):
    assert measured_problems(readme) == []


def test_relative_links_resolve():
    problems = []
    for md in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        problems += link_problems(md, md.read_text())
    assert problems == []


def test_core_snippet_runs(readme):
    snippet = next(b for b in fenced(readme, "python") if "select_backend" in b)
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["y"].shape == scope["x"].shape


def test_moe_snippet_imports(readme):
    snippet = next(b for b in fenced(readme, "python") if "from polyaccel.moe import" in b)
    exec(compile(snippet.splitlines()[0], "README.md", "exec"), {})


def test_asr_snippet_names_exist(readme):
    import inspect

    from polyaccel.asr.transcriber import Transcriber, TranscriptResult

    snippet = next(b for b in fenced(readme, "python") if "Transcriber" in b)
    kwargs = set(re.findall(r"(\w+)=", snippet.split("from_pretrained(", 1)[1].split(")")[0]))
    assert kwargs <= set(inspect.signature(Transcriber.from_pretrained).parameters)
    assert hasattr(Transcriber, "transcribe_iter")
    fields = {f for f in re.findall(r"\br\.(\w+)", snippet)}
    assert fields <= {f.name for f in __import__("dataclasses").fields(TranscriptResult)}


# Negative controls: each checker finds the breakage it exists for.

@pytest.mark.parametrize("line, expect", [
    ("polyaccel-asr transcribe clips/ -o out.jsonl --beam-size 4", "unrecognized arguments"),
    ("polyaccel-asr export t.jsonl --format ass -d subs/", "invalid choice"),
    ("polyaccel-asr transcribe clips/ -o o.jsonl --model whisper-tiny.eng", "not a known model"),
    ("polyaccel-moe finetune cfg.yaml --set train.max_step=3", "unknown config key"),
    ("polyaccel-moe bench --preset qwen3-30b-a3b-l8", "unknown preset"),
    ("polyaccel-moe finetune packages/moe/examples/sft_jsonl.yaml --set train.lr=2e-5", "model.path"),
    ("polyaccel-moe finetune packages/moe/examples/nope.yaml", "no such file"),
    ("polyaccel kernel", "invalid choice"),
    ("make demos", "no such target"),
    ("python tools/demos.py", "no such file"),
    ('eval "$(python -m polyaccel.core.ray_local envs)"', "only command is env"),
    ("ray job submit --address http://127.0.0.1:8265 -- polyaccel-asr transcribe --rays x -o y.jsonl",
     "unrecognized arguments"),
    ("torchrun --nproc-per-node 2 -m polyaccel.moe.cli finetune cfg.yaml --set parallel.epp=2", "unknown config key"),
    ("sox in.wav out.wav", "no checker"),
])
def test_command_checker_catches(line, expect):
    problems = command_problems(f"```bash\n{line}\n```\n")
    assert problems and all(expect in p for p in problems[:1]), problems


def test_other_checkers_catch(readme):
    assert command_problems("```\n$ polyaccel kernel\n```\n")  # a `$ ` line of an untagged block
    assert preset_problems(readme.replace("also olmoe-1b-7b", "also olmoe-1b-7B"))
    assert path_problems(readme + "\nsee tools/no_such_tool.py\n")
    assert op_problems(readme.replace("`rms_norm`, ", "`rms_norm`, `rms_nrom`, "))
    assert op_problems(readme.replace("`swiglu`,", ""))
    assert backends_table_problems(readme.replace("backend  available devices", "backend  ok devices"))
    assert layout_problems(readme.replace("chaos.py, ", ""))
    assert measured_problems(readme.replace("(2026-12-04, commit 481dd80, a fresh clone", "(a fresh clone"))
    assert link_problems(README, "[x](docs/asr.md#no-such-heading) [y](docs/nope.md)") == [
        "README.md: docs/asr.md#no-such-heading: no such heading", "README.md: docs/nope.md: no such file"]
