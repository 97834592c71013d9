"""Plot benchmark JSON lines: y against x, one line per distinct value of a series key, to a PNG.

Reads one or more JSON-lines files (lines that are not JSON objects or lack a needed key are
skipped), keeps the records matching every ``--where KEY=VALUE``, and draws each series sorted
by x with matplotlib's Agg backend (no display needed).

  python tools/plot_bench.py bench.jsonl --x batch --y rtfx --series system --logx \\
      -o docs/img/asr_batch_sweep.png --title "Whisper large-v3-turbo shape, 1x H200"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path


def read_points(paths: Iterable[str | Path], keys: Sequence[str],
                where: dict[str, str] | None = None) -> list[dict]:
    """Records of the JSON-lines files that have every key in ``keys`` and match ``where``
    (values compared as strings, so ``batch=64`` matches ``64``)."""
    where = where or {}
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if (isinstance(rec, dict) and all(k in rec for k in keys)
                        and all(str(rec.get(k)) == v for k, v in where.items())):
                    out.append(rec)
    return out


def plot(records: Sequence[dict], *, x: str, y: str, series: str | None = None, logx: bool = False,
         logy: bool = False, title: str | None = None):
    """A matplotlib figure with one marked line per value of ``series`` (one line if None), each
    sorted by ``x``; records whose x or y is not a number are left out. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    groups: dict[str, list[tuple[float, float]]] = {}
    for rec in records:
        try:
            point = (float(rec[x]), float(rec[y]))
        except (TypeError, ValueError):
            continue
        groups.setdefault(str(rec[series]) if series else y, []).append(point)

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name in sorted(groups):
        xs, ys = zip(*sorted(groups[name]))
        ax.plot(xs, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))  # 64, not 2^6
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    if title:
        ax.set_title(title)
    if series and groups:
        ax.legend(title=series)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one existing file (through links too)."""
    try:
        return Path(a).samefile(b)
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Read the files, draw, write the PNG; exit 1 when no record has the keys."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON-lines files")
    p.add_argument("--x", required=True, help="key of the x axis (e.g. batch)")
    p.add_argument("--y", required=True, help="key of the y axis (e.g. rtfx)")
    p.add_argument("--series", help="key whose distinct values are the lines (e.g. system)")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only records with this value (repeatable)")
    p.add_argument("--logx", action="store_true", help="log2 x axis (batch sizes)")
    p.add_argument("--logy", action="store_true", help="log10 y axis")
    p.add_argument("--title")
    p.add_argument("-o", "--out", required=True, help="PNG to write (folders are created)")
    args = p.parse_args(argv)

    if any("=" not in w for w in args.where):
        p.error("--where wants KEY=VALUE")
    where = dict(w.split("=", 1) for w in args.where)
    keys = [args.x, args.y] + ([args.series] if args.series else [])
    try:
        records = read_points(args.files, keys, where)
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"no record in {args.files} has keys {keys} and matches {where}", file=sys.stderr)
        return 1
    fig = plot(records, x=args.x, y=args.y, series=args.series, logx=args.logx, logy=args.logy,
               title=args.title)
    if any(_same_file(args.out, f) for f in args.files):
        print(f"error: -o {args.out} is an input file: drawing there would destroy it", file=sys.stderr)
        return 2
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out)
    except (OSError, ValueError) as e:  # ValueError: a suffix matplotlib cannot write (-o out.jsonl)
        print(f"error: -o {args.out}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({len(records)} points, {len(fig.axes[0].get_lines())} lines)")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
