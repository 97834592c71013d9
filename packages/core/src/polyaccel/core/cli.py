"""polyaccel command: what backends and kernels are installed, available, and why not."""

from __future__ import annotations

import argparse
import platform
import sys

from polyaccel.core.clitools import broken_pipe, dumps
from polyaccel.core.plugins import PluginImportError


def _backends(args: argparse.Namespace) -> int:
    from polyaccel.core.plugins import backends

    rows = [b.describe() for b in backends().values()]
    if args.json:
        print(dumps(rows, indent=2))
        return 0
    print(f"{'backend':<8} {'available':<9} {'devices':>7}  detail")
    for r in rows:
        detail = r["reason"] + (f" (install: {r['install_hint']})" if r["install_hint"] and not r["available"] else "")
        print(f"{r['name']:<8} {'yes' if r['available'] else 'no':<9} {r['devices']:>7}  {detail}")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from polyaccel.core import ops  # noqa: F401  (defines the ops)
    from polyaccel.core.kernels import registry
    from polyaccel.core.plugins import activate, backends

    for b in backends().values():
        if b.availability().ok:
            activate(b)
    rows = registry.table()
    if args.json:
        print(dumps(rows, indent=2))
        return 0
    devices = sorted({k for r in rows for k in r if k not in ("op", "reference")})
    columns = ["op", "reference", *devices]
    _print_table(columns, [[str(r.get(c, "-")) for c in columns] for r in rows])
    return 0


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Left-aligned columns, each as wide as its widest cell (header included), two spaces
    apart, so that no op or backend name, however long, shifts the columns after it."""
    widths = [max(len(cell) for cell in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _doctor(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    import torch

    from polyaccel.core.plugins import ENTRY_POINT_GROUP, backends, broken_plugins

    print(f"python     {platform.python_version()} ({sys.executable})")
    print(f"torch      {torch.__version__} (cuda build: {torch.version.cuda or 'no'})")
    for dist in ("polyaccel-core", "polyaccel-backend-cuda", "polyaccel-backend-neuron",
                 "polyaccel-asr", "polyaccel-moe", "transformers", "ray", "pluggy", "flash-attn-4"):
        try:
            print(f"{dist:<26} {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"{dist:<26} not installed")
    eps = md.entry_points(group=ENTRY_POINT_GROUP)
    print(f"entry points ({ENTRY_POINT_GROUP}): " + ", ".join(f"{e.name}={e.value}" for e in eps))
    ok = True
    for b in backends().values():
        a = b.availability()
        print(f"backend {b.name:<7} {'OK ' if a.ok else 'NO '} {a.reason}"
              + (f" -> {a.install_hint}" if a.install_hint and not a.ok else ""))
        ok &= b.name != "cpu" or a.ok
    return 0 if ok and not broken_plugins() else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="polyaccel", description=__doc__,
                                epilog="exit status: 0 ok, 1 doctor found the cpu backend unusable or a backend plugin that "
                                       "fails to load (or another error, "
                                       "named in one line), 2 usage error, 141 the reader of the output went away "
                                       "(e.g. `| head`)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("backends", help="list backends, whether each is available here, and why not")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(fn=_backends)
    s = sub.add_parser("kernels", help="list kernel ops and which backend implements each")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=_kernels)
    s = sub.add_parser("doctor", help="check the installation: versions, entry points, backends")
    s.set_defaults(fn=_doctor)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError as e:  # `polyaccel kernels | head`: the reader left; no traceback
        return broken_pipe(e, "polyaccel")
    except PluginImportError as e:  # a typo in POLYACCEL_PLUGINS: one line, not a traceback
        print(f"polyaccel: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
