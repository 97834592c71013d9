"""The ``polyaccel-asr`` command's entry point: loads the CLI (torch with it: seconds) where a
Ctrl-C can still be caught, so one pressed while it loads is one line and exit 130, not a
traceback through torch's imports. Imports nothing heavy itself."""

from __future__ import annotations

import sys


def run() -> None:
    """Run :func:`polyaccel.asr.cli.main` and exit with its status."""
    try:
        from polyaccel.asr.cli import main
    except KeyboardInterrupt:
        print("polyaccel-asr: interrupted while starting; nothing was run or written", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(main())
