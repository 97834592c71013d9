"""All five polyaccel distributions import side by side as one PEP 420 namespace."""

import importlib
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_all_subpackages_import_in_one_interpreter():
    code = ("import polyaccel.core, polyaccel.cuda, polyaccel.neuron, polyaccel.asr, polyaccel.moe;"
            "import polyaccel; print(len(list(polyaccel.__path__)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == 5  # one path entry per distribution


def test_no_namespace_init_files():
    offenders = list(ROOT.glob("packages/*/src/polyaccel/__init__.py"))
    assert offenders == []


def test_dependencies_point_one_way():
    """core imports no other polyaccel package; asr and moe import no backend."""
    rules = {
        "core": ("polyaccel.cuda", "polyaccel.neuron", "polyaccel.asr", "polyaccel.moe"),
        "asr": ("polyaccel.cuda", "polyaccel.neuron", "polyaccel.moe"),
        "moe": ("polyaccel.cuda", "polyaccel.neuron", "polyaccel.asr"),
    }
    pkg_dir = {"core": "core", "asr": "asr", "moe": "moe"}
    bad = []
    for pkg, forbidden in rules.items():
        for f in (ROOT / "packages" / pkg_dir[pkg] / "src").rglob("*.py"):
            text = f.read_text()
            bad += [f"{f.relative_to(ROOT)} imports {m}" for m in forbidden
                    if f"import {m}" in text or f"from {m}" in text]
    assert bad == []


def test_importing_backend_packages_is_light():
    """Importing a backend package imports no heavy SDK (STYLE: entry points stay light)."""
    code = ("import sys, polyaccel.cuda, polyaccel.neuron, polyaccel.cuda.plugin, polyaccel.neuron.plugin;"
            "heavy=[m for m in ('triton','transformer_engine','deep_ep','torch_neuronx','nki') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_package_versions_pinned_together():
    import importlib.metadata as md

    versions = {d: md.version(d) for d in ("polyaccel-core", "polyaccel-backend-cuda",
                                           "polyaccel-backend-neuron", "polyaccel-asr", "polyaccel-moe")}
    assert len(set(versions.values())) == 1, versions
    importlib.import_module("polyaccel.core")
